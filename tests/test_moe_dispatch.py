"""Expert-parallel MoE (all-to-all dispatch/combine) against a dense single-process MoE."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from parallel.moe_dispatch import dispatch, ep_moe, expert_owner, expert_range, gather_token_shares, token_share
from parallel.state import Group, ep_group, sp_group, tp_group
from tests.multiprocess import run_ranks
from workers.models import moe as moe_module
from workers.models.moe import Experts, SparseMoE

H, I = 16, 24


def full_weights(num_experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(num_experts, I, H, generator=g) * 0.3,
        "up": torch.randn(num_experts, I, H, generator=g) * 0.3,
        "down": torch.randn(num_experts, H, I, generator=g) * 0.3,
        "router": torch.randn(num_experts, H, generator=g),
    }


def load_experts(experts: Experts, w: dict[str, torch.Tensor]) -> Experts:
    """What the checkpoint loader does: only local experts are read, each through the weight loader."""
    for e in range(experts.num_experts):
        if experts.is_local(e):
            for shard in ("gate", "up", "down"):
                param = experts.w2 if shard == "down" else experts.w13
                experts.weight_loader(param, w[shard][e], e, shard)
    return experts


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(x @ router.t(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True) if renormalize else weights


# ---- single process ----
def test_expert_ranges_are_contiguous_and_cover_all():
    for e, n in [(8, 2), (6, 4), (8, 3), (5, 5)]:
        ranges = [expert_range(e, n, r) for r in range(n)]
        assert [x for rg in ranges for x in rg] == list(range(e))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
        owner = expert_owner(torch.arange(e), e, n)
        assert owner.tolist() == [r for r, rg in enumerate(ranges) for _ in rg]


def test_token_shares_cover_all_rows():
    for t in (0, 1, 5, 8):
        shares = [token_share(t, Group(ranks=[0, 1, 2], rank=r)) for r in range(3)]
        assert [i for s in shares for i in range(t)[s]] == list(range(t))


def test_ep_moe_on_one_rank_is_the_dense_moe():
    w = full_weights(4)
    experts = load_experts(Experts(4, H, I, group=Group()), w)
    x = torch.randn(6, H)
    ids, weights = route(x, w["router"], 2, True)
    torch.testing.assert_close(ep_moe(x, ids, weights, 4, experts, Group()), experts(x, ids, weights))


# ---- multi-process ----
def _check_dispatch(rank: int, num_experts: int, tokens_per_rank: list[int], top_k: int, renormalize: bool,
                    router_bias: torch.Tensor | None) -> None:
    """Different tokens on every EP rank (as under SP); experts spread; compare with the dense MoE."""
    ep = ep_group()
    w = full_weights(num_experts, seed=num_experts)
    router = w["router"] if router_bias is None else w["router"] * 0.01 + router_bias[:, None]
    dense = load_experts(Experts(num_experts, H, I, group=Group()), w)
    mine = load_experts(Experts(num_experts, H, I, group=Group(), local_experts=expert_range(num_experts, ep.size, ep.rank)), w)
    x = torch.randn(tokens_per_rank[rank], H, generator=torch.Generator().manual_seed(100 + rank))
    ids, weights = route(x, router, top_k, renormalize)
    out = ep_moe(x, ids, weights, num_experts, mine, ep)
    torch.testing.assert_close(out, dense(x, ids, weights), rtol=1e-5, atol=1e-5)
    # Each token goes once to each rank holding any of its experts, however many of them that rank holds.
    *_, plan = dispatch(x, ids, weights, num_experts, ep)
    owners = expert_owner(ids, num_experts, ep.size)
    assert sum(plan.send_counts) == sum(len(set(row)) for row in owners.tolist())


def _check_sparse_moe_layer(rank: int, num_experts: int, top_k: int, renormalize: bool) -> None:
    """The SparseMoE layer under EP x TP: the TP ranks hold the same tokens (odd count) and share them out."""
    ep, tp = ep_group(), tp_group()
    w = full_weights(num_experts, seed=7)
    layer = SparseMoE(H, num_experts, top_k, I, renormalize)
    layer.gate.weight.data.copy_(w["router"])
    load_experts(layer.experts, w)
    assert layer.experts.num_local_experts == len(expert_range(num_experts, ep.size, ep.rank))
    sp_rank = rank // tp.size
    x = torch.randn(7 + sp_rank, H, generator=torch.Generator().manual_seed(sp_rank))
    dense = load_experts(Experts(num_experts, H, I, group=Group()), w)
    ids, weights = route(x, w["router"], top_k, renormalize)
    # EP over the TP group alone: every rank holds every token, so no token may travel (one all-reduce), over the
    # TP group object itself (which carries the P2P all-reduce on GPUs)
    assert layer.ep_tokens_replicated == (sp_group().size == 1) == (ep is tp)
    with mock.patch.object(moe_module, "ep_moe", side_effect=AssertionError("dispatched")) if layer.ep_tokens_replicated \
            else contextlib.nullcontext():
        out = layer(x)
    torch.testing.assert_close(out, dense(x, ids, weights), rtol=1e-5, atol=1e-5)


def _check_gather_token_shares(rank: int) -> None:
    tp = tp_group()
    for t in (0, 1, 5):
        full = torch.arange(t * 3, dtype=torch.float32).view(t, 3)
        torch.testing.assert_close(gather_token_shares(full[token_share(t, tp)], t, tp), full)


def _all_checks(rank: int, num_experts: int) -> None:
    n = ep_group().size
    tokens = [5, 0, 9, 3][:n]  # one rank has no tokens at all
    _check_dispatch(rank, num_experts, tokens, top_k=2, renormalize=True, router_bias=None)
    _check_dispatch(rank, num_experts, tokens, top_k=2, renormalize=False, router_bias=None)
    _check_dispatch(rank, num_experts, tokens, top_k=1, renormalize=False, router_bias=None)
    # Every token picks experts 0 and 1 (both on rank 0): sent once each; the other ranks get nothing.
    bias = torch.full((num_experts,), -10.0)
    bias[:2] = 10.0
    _check_dispatch(rank, num_experts, tokens, top_k=2, renormalize=True, router_bias=bias)
    # The last expert is never picked (its rank may still get other experts' tokens, or none).
    bias = torch.zeros(num_experts)
    bias[-1] = -100.0
    _check_dispatch(rank, num_experts, tokens, top_k=2, renormalize=False, router_bias=bias)
    _check_sparse_moe_layer(rank, num_experts, top_k=2, renormalize=True)
    _check_sparse_moe_layer(rank, num_experts, top_k=2, renormalize=False)
    _check_gather_token_shares(rank)


@pytest.mark.slow
@pytest.mark.parametrize("world,num_experts,parallel", [
    (2, 4, {"expert_parallel_size": 2}),  # EP over TP: the all-reduce form
    (3, 8, {"expert_parallel_size": 3}),
    (2, 4, {"sequence_parallel_size": 2, "expert_parallel_size": 2}),
    (3, 8, {"sequence_parallel_size": 3, "expert_parallel_size": 3}),  # 3, 3, 2 experts
    (4, 6, {"tensor_parallel_size": 2, "sequence_parallel_size": 2, "expert_parallel_size": 4}),  # 2, 2, 1, 1
])
def test_ep_moe_matches_dense(world: int, num_experts: int, parallel: dict):
    run_ranks(_all_checks, world, num_experts, parallel=parallel)
