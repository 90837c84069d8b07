"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that narrows the full
checkpoint tensor to this rank's shard, so loading code never needs to know the layout.

Shapes use the HF convention: weight is [out_features, in_features]. The parameters themselves come
from the layer's quantization method (parallel/quant): by default one plain weight, else the packed
codes, zeros, scales and group indices of a GPTQ / AWQ / FP8 checkpoint, whose attributes tell the
one generic `weight_loader` below which dims hold output and input features and in what units.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from parallel import row_reduce
from parallel.comm import gather_last_dim, reduce_partial_sums
from parallel.matmul import linear
from parallel.quant.base import QuantConfig, UnquantizedLinearMethod, units
from parallel.state import Group, tp_group

WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def check_dtype(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Refuse a checkpoint tensor whose dtype the parameter cannot hold as is: copying int32 codes or
    FP8 values into a float parameter would convert them silently into a wrong weight."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if param.dtype.is_floating_point and param.dtype not in fp8:
        ok = loaded.dtype.is_floating_point and loaded.dtype not in fp8
    else:
        ok = loaded.dtype == param.dtype
    if not ok:
        raise ValueError(f"checkpoint tensor of dtype {loaded.dtype} does not fit a {param.dtype} parameter "
                         "(a quantized checkpoint needs its quantization_config in config.json)")


def _narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    if start + length > t.shape[dim]:
        raise ValueError(f"checkpoint tensor of shape {tuple(t.shape)} is too small along dim {dim} for [{start}, {start + length})")
    return t.narrow(dim, start, length)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_dtype(param, loaded)
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


class _TPLinear(nn.Module):
    """Base of the TP layers: the quantization method creates the parameters, `weight_loader` fills them.

    Subclasses set `group`, `row_parallel`, and `out_slice(shard_id) -> (projection index, first
    checkpoint row of this rank)`; `out_shards` lists the per-rank output sizes of the fused projections.
    """

    row_parallel = False

    def _create_weights(self, in_per_rank: int, out_shards: list[int], in_full: int, quant_config: QuantConfig | None) -> None:
        self.tp_rank, self.tp_size = self.group.rank, self.group.size
        self.in_per_rank, self.out_shards = in_per_rank, out_shards
        self.quant_method = quant_config.linear_method() if quant_config is not None else UnquantizedLinearMethod()
        self.quantized = self.quant_method.quantized
        self.quant_method.create_weights(self, in_per_rank, sum(out_shards), in_full)

    def init_buffers(self) -> None:
        self.quant_method.init_buffers(self)

    def fp8_input_rows(self, x: torch.Tensor) -> int | None:
        """Rows of FP8 activations this layer would quantize x to (dynamic W8A8 GEMM), for the kernel producing x
        to emit them (parallel/quant/fp8_act.py); None when it would not."""
        fn = getattr(getattr(self, "packed", None), "fp8_input_rows", None)  # tinygemm's int4 weights have none
        return fn(x) if fn is not None else None

    def out_slice(self, shard_id) -> tuple[int, int]:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no fused shards (got {shard_id!r})")
        return 0, self.group.rank * self.out_shards[0]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of a full checkpoint tensor (one fused projection's, with shard_id) into param."""
        check_dtype(param, loaded)
        dst = param.data
        out_dim = getattr(param, "out_dim", 0)
        if out_dim is not None:
            idx, src = self.out_slice(shard_id)
            unit, ceil = getattr(param, "out_unit", 1), getattr(param, "ceil", False)
            if src % unit:
                raise ValueError(f"this rank's output rows start at {src}, inside a pack/block of {unit}")
            size = units(self.out_shards[idx], unit, ceil, "output features")
            dst = dst.narrow(out_dim, sum(units(s, unit, ceil, "output features") for s in self.out_shards[:idx]), size)
            if getattr(param, "scalar_ok", False):
                if loaded.numel() == 1:  # per-tensor scale: every row of this projection shares it
                    dst.fill_(loaded.reshape(()).item())
                    return
                loaded = loaded.reshape(-1, 1) if loaded.dim() == 1 else loaded  # per-channel [out] -> [out, 1]
            loaded = _narrow(loaded, out_dim, src // unit, size)
        in_dim = getattr(param, "in_dim", None)
        if self.row_parallel and in_dim is not None:
            unit, start = getattr(param, "in_unit", 1), self.tp_rank * self.in_per_rank
            if start % unit:
                raise ValueError(f"this rank's input features start at {start}, inside a pack/group/block of {unit}")
            loaded = _narrow(loaded, in_dim, start // unit, dst.shape[in_dim])
        if loaded.shape != dst.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(dst.shape)}")
        if out_dim is None and getattr(param, "loaded_once", False) and not torch.equal(dst, loaded.to(dst.device, dst.dtype)):
            # g_idx: one per fused layer. q/k/v (gate/up) share their input, so GPTQ's act order is the same.
            raise ValueError("fused projections (q/k/v or gate/up) carry different g_idx; they must share one act order")
        dst.copy_(loaded)
        param.loaded_once = True  # type: ignore[attr-defined]



class ColumnParallelLinear(_TPLinear):
    """Output features split over TP ranks: weight [out/tp, in]. Output stays sharded unless gather_output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False, group: Group | None = None,
                 quant_config: QuantConfig | None = None):
        super().__init__()
        self.group = group or tp_group()
        self.input_size = input_size
        self.output_size_per_rank = _divide(output_size, self.group.size, "output size")
        self.gather_output = gather_output
        self._create_weights(input_size, self._out_shards(), input_size, quant_config)
        self.bias = (
            set_weight_loader(nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False), self.weight_loader)
            if bias
            else None
        )

    def _out_shards(self) -> list[int]:
        return [self.output_size_per_rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Unquantized: the plain matmul inline, as before quantization existed (no extra call per linear).
        y = self.quant_method.apply(self, x, self.bias) if self.quantized else linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.group) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate_proj + up_proj).

    Each rank's weight is [gate shard; up shard], so the split after the matmul is local.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, group: Group | None = None,
                 quant_config: QuantConfig | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias=bias, group=group, quant_config=quant_config)

    def _out_shards(self) -> list[int]:
        return [_divide(s, self.group.size, f"merged output {i}") for i, s in enumerate(self.output_sizes)]

    def out_slice(self, shard_id) -> tuple[int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"unknown merged shard {shard_id!r}")
        return shard_id, self.group.rank * self.out_shards[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split over TP ranks.

    With tp > num_kv_heads each KV head is replicated on tp / num_kv_heads ranks (its query heads
    live there), so every rank holds max(1, num_kv_heads / tp) KV heads.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, group: Group | None = None,
                 quant_config: QuantConfig | None = None):
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
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, bias=bias, group=group, quant_config=quant_config)

    def _out_shards(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def out_slice(self, shard_id) -> tuple[int, int]:
        if shard_id == "q":
            return 0, self.group.rank * self.q_size
        if shard_id in ("k", "v"):
            return (1 if shard_id == "k" else 2), self.kv_head_start * self.head_dim
        raise ValueError(f"unknown qkv shard {shard_id!r}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_TPLinear):
    """Input features split over TP ranks: weight [out, in/tp]; partial outputs summed across ranks.

    The bias is added after the reduction, so it counts exactly once whatever the TP size.
    """

    row_parallel = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, group: Group | None = None,
                 quant_config: QuantConfig | None = None):
        super().__init__()
        self.group = group or tp_group()
        self.input_size_per_rank = _divide(input_size, self.group.size, "input size")
        self._create_weights(self.input_size_per_rank, [output_size], input_size, quant_config)
        self.bias = set_weight_loader(nn.Parameter(torch.empty(output_size), requires_grad=False), default_weight_loader) if bias else None

    def out_slice(self, shard_id) -> tuple[int, int]:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no fused shards (got {shard_id!r})")
        return 0, 0  # output features are not split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # prefill-sized calls in TANDEM_TP_ROW_REDUCE's mode (parallel/row_reduce.py), else the GEMM, then the sum
        y = None if self.quantized else row_reduce.try_linear_reduce(x, self.weight, self.group)
        if y is None:
            y = self.quant_method.apply(self, x, None) if self.quantized else linear(x, self.weight)
            y = reduce_partial_sums(y, self.group)
        return y + self.bias if self.bias is not None else y
