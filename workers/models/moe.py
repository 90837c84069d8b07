"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): router softmax, top-k, experts, weighted sum.

Expert weights are stacked per rank: w13 [E_local, 2 * I_shard, H] (gate rows then up rows) and
w2 [E_local, H, I_shard]. With TP, each expert's intermediate dim is split over the TP ranks and
the outputs are summed across them. With EP (expert_parallel_size > 1), whole experts (no TP split)
are spread contiguously over the EP group (the TP x SP ranks of a stage) and tokens travel to them
(parallel/moe_dispatch.py); the TP ranks, which hold the same tokens, each dispatch a share of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import reduce_partial_sums
from parallel.linear import ReplicatedLinear, set_weight_loader
from parallel.moe_dispatch import ep_moe, expert_range, gather_token_shares, token_share
from parallel.state import Group, ep_group, tp_group

try:  # Triton grouped-GEMM MoE for the CUDA path; the expert loop below is the reference and the CPU path
    from parallel.kernels.fused_moe import fused_moe as _fused_moe
except ImportError:
    _fused_moe = None


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group: Group | None = None,
                 local_experts: range | None = None):
        """group: the ranks splitting each expert's intermediate dim (TP); local_experts: the experts held here (EP)."""
        super().__init__()
        self.group = group or tp_group()
        if intermediate_size % self.group.size:
            raise ValueError(f"moe intermediate size {intermediate_size} not divisible by tensor_parallel_size {self.group.size}")
        self.num_experts = num_experts
        local = local_experts if local_experts is not None else range(num_experts)
        self.expert_start, self.num_local_experts = local.start, len(local)
        self.i_shard = intermediate_size // self.group.size
        e = self.num_local_experts
        self.w13 = set_weight_loader(nn.Parameter(torch.empty(e, 2 * self.i_shard, hidden_size), requires_grad=False), self.weight_loader)
        self.w2 = set_weight_loader(nn.Parameter(torch.empty(e, hidden_size, self.i_shard), requires_grad=False), self.weight_loader)

    def is_local(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """shard_id: 'gate' / 'up' ([I, H] in the checkpoint) or 'down' ([H, I])."""
        e = expert_id - self.expert_start
        r, n = self.group.rank, self.i_shard
        if shard_id == "down":
            param.data[e].copy_(loaded.narrow(1, r * n, n))
        else:
            offset = 0 if shard_id == "gate" else n
            param.data[e].narrow(0, offset, n).copy_(loaded.narrow(0, r * n, n))

    use_fused = True  # the fused kernel on CUDA when Triton imports (benchmarks switch it off to compare)

    @property
    def graph_safe(self) -> bool:
        """No host sync in forward (CUDA graphs): true for the fused kernel, not for the expert loop."""
        return _fused_moe is not None and self.use_fused and self.w13.is_cuda

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids/topk_weights [T, k] (global expert ids, fp32 weights) -> partial [T, H]."""
        if x.shape[0] == 0:  # an EP rank that was sent no tokens
            return torch.zeros_like(x)
        if x.is_cuda and self.graph_safe:
            return _fused_moe(x, self.w13, self.w2, topk_ids, topk_weights, self.expert_start, self.num_experts)
        out = torch.zeros_like(x)
        n_local = self.num_local_experts
        local_ids = topk_ids - self.expert_start
        # Other ranks' experts (EP) map to a sentinel bin after the local ones, which is never computed.
        local_ids = torch.where((local_ids >= 0) & (local_ids < n_local), local_ids, n_local)
        # Sorting the (token, slot) pairs by expert makes each expert's tokens one contiguous slice.
        flat = local_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=n_local + 1).tolist()
        token_of = order // topk_ids.shape[1]
        weight_of = topk_weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts[:n_local]):
            if n:
                tok = token_of[start : start + n]
                h = F.linear(x[tok], self.w13[e])
                gate, up = h.chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.w2[e])
                out.index_add_(0, tok, (y * weight_of[start : start + n, None]).to(x.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize, self.num_experts = top_k, renormalize, num_experts
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.ep = ep_group()
        if self.ep.size == 1:
            self.experts = Experts(num_experts, hidden_size, intermediate_size)
        else:
            if num_experts < self.ep.size:
                raise ValueError(f"expert_parallel_size ({self.ep.size}) exceeds the number of experts ({num_experts})")
            # Each token's expert runs on one rank, whole: nothing to split over TP.
            self.experts = Experts(num_experts, hidden_size, intermediate_size, group=Group(),
                                   local_experts=expert_range(num_experts, self.ep.size, self.ep.rank))
        # Where the EP group is the TP group (no SP), every EP rank already holds every token: each runs its
        # own experts on all of them and one all-reduce sums the partial outputs, as TP's MoE does. No
        # all-to-all, no token counts read on the host, so decode stays inside CUDA graphs. (With top-8 of
        # 128 experts over 2 ranks nearly every token needs both ranks, so a dispatch would move as many
        # bytes as the all-reduce, in three collectives and a host sync per layer.)
        self.ep_tokens_replicated = self.ep.size > 1 and sorted(self.ep.ranks) == sorted(tp_group().ranks)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if self.ep.size == 1 or self.ep_tokens_replicated:
            ids, weights = self.route(x)
            group = self.ep if self.ep_tokens_replicated else self.experts.group
            return reduce_partial_sums(self.experts(x, ids, weights), group)
        # EP over TP x SP ranks: the SP ranks hold different tokens, so tokens travel to their experts. The TP
        # ranks of one SP rank hold the same T tokens: each routes and dispatches its own share, then they gather.
        tp = tp_group()
        share = x[token_share(x.shape[0], tp)]
        ids, weights = self.route(share)
        out = ep_moe(share, ids, weights, self.num_experts, self.experts, self.ep)
        return gather_token_shares(out, x.shape[0], tp)
