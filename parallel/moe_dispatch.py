"""Expert parallelism (EP): whole experts spread over the EP group, tokens sent to where their experts are.

Experts are divided contiguously: EP rank r holds experts `expert_range(E, ep, r)`. One MoE layer is

  1. dispatch: each token goes ONCE to every rank holding at least one of its top-k experts (a token
     whose top-k experts share a rank is not sent twice), with its top-k ids and router weights.
     Split sizes are exchanged first (an all_to_all of counts), then rows with uneven all_to_alls.
  2. the receiving rank runs its local experts on what it got; for each received row it returns the
     router-weighted sum over those of the token's experts that it holds (one row back per row in).
  3. combine: the reverse all_to_all brings the rows home, where they are summed per token.

Ranks that receive no tokens (or have no tokens to send) take part in the collectives with empty
tensors, so every rank must call `ep_moe` for every MoE layer, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from parallel.comm import all_to_all_rows, gather_first_dim
from parallel.state import Group

# (x [N, H], topk_ids [N, k] global expert ids, topk_weights [N, k] fp32) -> [N, H]:
# the weighted sum over the experts this rank holds; non-local ids must be ignored.
ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Experts held by one EP rank: contiguous, the first num_experts % ep_size ranks one more."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def expert_owner(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """The EP rank holding each expert id, same shape as topk_ids."""
    ends = torch.tensor([expert_range(num_experts, ep_size, r).stop for r in range(ep_size)], device=topk_ids.device)
    return torch.bucketize(topk_ids, ends, right=True)


@dataclass
class DispatchPlan:
    """Where this rank's tokens went, to bring the results back."""

    send_tokens: torch.Tensor  # [S] local token index of each sent row, grouped by destination rank
    send_counts: list[int]  # rows sent to each EP rank
    recv_counts: list[int]  # rows received from each EP rank
    num_tokens: int



def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             group: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchPlan]:
    """x [T, H], topk_ids [T, k], topk_weights [T, k] -> the rows this rank must compute:
    (x [R, H], topk_ids [R, k], topk_weights [R, k] fp32, plan)."""
    n, k = group.size, topk_ids.shape[1]
    owner = expert_owner(topk_ids, num_experts, n)  # [T, k]
    needs = torch.zeros(x.shape[0], n, dtype=torch.bool, device=x.device)
    needs.scatter_(1, owner, True)  # [T, n]: token t goes to rank d (once, however many of its experts d holds)
    dest, send_tokens = needs.t().nonzero(as_tuple=True)  # sorted by destination, then token
    send_counts = torch.bincount(dest, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.device_group)
    plan = DispatchPlan(send_tokens, send_counts.tolist(), recv_counts.tolist(), x.shape[0])
    # Ids travel with the weights as fp32 (exact below 2**24), so routing is one message.
    meta = torch.cat([topk_ids[send_tokens].float(), topk_weights[send_tokens].float()], dim=1)  # [S, 2k]
    x_recv = all_to_all_rows(x[send_tokens], plan.recv_counts, plan.send_counts, group)
    meta_recv = all_to_all_rows(meta, plan.recv_counts, plan.send_counts, group)
    return x_recv, meta_recv[:, :k].long(), meta_recv[:, k:], plan


def combine(y: torch.Tensor, plan: DispatchPlan, group: Group) -> torch.Tensor:
    """y [R, H] (results of the received rows, in arrival order) -> [T, H], summed per local token."""
    back = all_to_all_rows(y, plan.send_counts, plan.recv_counts, group)  # [S, H], aligned with plan.send_tokens
    out = torch.zeros((plan.num_tokens, y.shape[1]), dtype=y.dtype, device=y.device)
    return out.index_add_(0, plan.send_tokens, back)


def ep_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
           expert_fn: ExpertFn, group: Group) -> torch.Tensor:
    """The MoE output [T, H] for this rank's tokens, with experts spread over `group`."""
    if group.size == 1:
        return expert_fn(x, topk_ids, topk_weights)
    x_recv, ids_recv, weights_recv, plan = dispatch(x, topk_ids, topk_weights, num_experts, group)
    return combine(expert_fn(x_recv, ids_recv, weights_recv), plan, group)


# ---- EP under TP: the TP ranks hold the same tokens, so each dispatches a share of them ----
def _share_bounds(num_tokens: int, size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(num_tokens, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def token_share(num_tokens: int, group: Group) -> slice:
    """This rank's contiguous share of num_tokens rows (the first num_tokens % size ranks one more)."""
    return slice(*_share_bounds(num_tokens, group.size, group.rank))


def gather_token_shares(y: torch.Tensor, num_tokens: int, group: Group) -> torch.Tensor:
    """Every rank's `token_share` rows y [share, H] -> all num_tokens rows [num_tokens, H], on every rank."""
    if group.size == 1:
        return y
    width = -(-num_tokens // group.size)  # shares differ by at most one row: pad each to the largest
    padded = y.new_zeros((width, *y.shape[1:]))
    padded[: y.shape[0]] = y
    rows = gather_first_dim(padded, group)  # [size * width, H]
    sizes = [b - a for a, b in (_share_bounds(num_tokens, group.size, r) for r in range(group.size))]
    return torch.cat([rows[r * width : r * width + n] for r, n in enumerate(sizes)])
