"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): router softmax, top-k, experts, weighted sum.

Expert weights are stacked per rank: w13 [E_local, 2 * I_shard, H] (gate rows then up rows) and
w2 [E_local, H, I_shard]. With TP, each expert's intermediate dim is split over the TP ranks and
the outputs are summed across them; with EP (expert_parallel_size > 1), whole experts are spread over
the EP group and tokens travel to them (see parallel/moe.py when present).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import reduce_partial_sums
from parallel.linear import ReplicatedLinear, set_weight_loader
from parallel.state import Group, tp_group


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group: Group | None = None):
        super().__init__()
        self.group = group or tp_group()
        if intermediate_size % self.group.size:
            raise ValueError(f"moe intermediate size {intermediate_size} not divisible by tensor_parallel_size {self.group.size}")
        self.num_experts = num_experts
        self.expert_start, self.num_local_experts = 0, num_experts
        self.i_shard = intermediate_size // self.group.size
        self.w13 = set_weight_loader(nn.Parameter(torch.empty(num_experts, 2 * self.i_shard, hidden_size), requires_grad=False), self.weight_loader)
        self.w2 = set_weight_loader(nn.Parameter(torch.empty(num_experts, hidden_size, self.i_shard), requires_grad=False), self.weight_loader)

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

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids/topk_weights [T, k] (global expert ids, fp32 weights) -> partial [T, H]."""
        out = torch.zeros_like(x)
        local_ids = topk_ids - self.expert_start
        # Sorting the (token, slot) pairs by expert makes each expert's tokens one contiguous slice.
        flat = local_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat.clamp(0, self.num_local_experts), minlength=self.num_local_experts + 1).tolist()
        token_of = order // topk_ids.shape[1]
        weight_of = topk_weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts[: self.num_local_experts]):
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
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return reduce_partial_sums(self.experts(x, ids, weights), self.experts.group)
