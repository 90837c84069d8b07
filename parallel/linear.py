"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that narrows the full
checkpoint tensor to this rank's shard, so loading code never needs to know the layout.

Shapes use the HF convention: weight is [out_features, in_features].
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from parallel.comm import gather_last_dim, reduce_partial_sums
from parallel.matmul import linear
from parallel.state import Group, tp_group

WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight (e.g. the MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = set_weight_loader(nn.Parameter(torch.empty(output_size, input_size), requires_grad=False), default_weight_loader)
        self.bias = set_weight_loader(nn.Parameter(torch.empty(output_size), requires_grad=False), default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over TP ranks: weight [out/tp, in]. Output stays sharded unless gather_output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False, group: Group | None = None):
        super().__init__()
        self.group = group or tp_group()
        self.input_size = input_size
        self.output_size_per_rank = _divide(output_size, self.group.size, "output size")
        self.gather_output = gather_output
        self.weight = set_weight_loader(
            nn.Parameter(torch.empty(self.output_size_per_rank, input_size), requires_grad=False), self.weight_loader
        )
        self.bias = (
            set_weight_loader(nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False), self.weight_loader)
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.group.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.group) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate_proj + up_proj).

    Each rank's weight is [gate shard; up shard], so the split after the matmul is local.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, group: Group | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias=bias, group=group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:  # type: ignore[override]
        size = _divide(self.output_sizes[shard_id], self.group.size, f"merged output {shard_id}")
        offset = sum(self.output_sizes[:shard_id]) // self.group.size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.group.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split over TP ranks.

    With tp > num_kv_heads each KV head is replicated on tp / num_kv_heads ranks (its query heads
    live there), so every rank holds max(1, num_kv_heads / tp) KV heads.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, group: Group | None = None):
        group = group or tp_group()
        tp = group.size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            if tp % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of num_key_value_heads ({num_kv_heads}) when larger")
            self.num_kv_heads = 1
            self.kv_head_start = group.rank // (tp // num_kv_heads)
        else:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = group.rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # The per-rank width is q + k + v of this rank's heads; KV heads may be replicated, so the
        # whole output is that width times tp (not num_heads + 2 * num_kv_heads heads).
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias=bias, group=group)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        if shard_id == "q":
            dst_offset, size, src_offset = 0, self.q_size, self.group.rank * self.q_size
        elif shard_id in ("k", "v"):
            dst_offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_offset = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        param.data.narrow(0, dst_offset, size).copy_(loaded.narrow(0, src_offset, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """Input features split over TP ranks: weight [out, in/tp]; partial outputs summed across ranks.

    The bias is added after the reduction, so it counts exactly once whatever the TP size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, group: Group | None = None):
        super().__init__()
        self.group = group or tp_group()
        self.input_size_per_rank = _divide(input_size, self.group.size, "input size")
        self.weight = set_weight_loader(
            nn.Parameter(torch.empty(output_size, self.input_size_per_rank), requires_grad=False), self.weight_loader
        )
        self.bias = set_weight_loader(nn.Parameter(torch.empty(output_size), requires_grad=False), default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.group.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_partial_sums(linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y
