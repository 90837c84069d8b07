"""The quantization-method interface and the unquantized method (today's F.linear path).

Parameters carry their sharding as attributes, read by the layer's generic `weight_loader`
(parallel/linear.py):
    out_dim / out_unit   which tensor dim indexes output features, and how many features one element
                         there covers (1; the pack factor of int32-packed codes; the block of a block scale)
    in_dim / in_unit     the same for input features (pack factor, group size, block); in_dim None:
                         every row-parallel rank holds the whole dim (one group, act-order scales)
    ceil                 element counts round up (block scales cover a ragged last block)
    scalar_ok            a one-element checkpoint tensor is broadcast (per-tensor FP8 scale)
"""
from __future__ import annotations

import torch
from torch import nn

from parallel.matmul import linear
from parallel.quant.packed import PackedWeight, kernels_available


def quant_param(shape: tuple[int, ...], dtype: torch.dtype, loader, *, out_dim: int | None = None, out_unit: int = 1,
                in_dim: int | None = None, in_unit: int = 1, ceil: bool = False, scalar_ok: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.out_dim, p.out_unit, p.in_dim, p.in_unit = out_dim, out_unit, in_dim, in_unit  # type: ignore[attr-defined]
    p.ceil, p.scalar_ok = ceil, scalar_ok  # type: ignore[attr-defined]
    return p


def units(n: int, unit: int, ceil: bool, what: str) -> int:
    """Elements covering n features. Packed codes and groups must divide exactly: a pack or a group
    straddling two TP ranks (or two fused projections) cannot be split."""
    if ceil:
        return -(-n // unit)
    if n % unit:
        raise ValueError(f"{what}: {n} features are not a multiple of {unit} (pack factor / group size)")
    return n // unit


class LinearMethod:
    """How one linear layer stores and applies its weight.

    create_weights(layer, in_per_rank, out_per_rank, in_full): registers the parameters on `layer`
    (layer.out_shards lists the per-rank output sizes of the fused projections, layer.row_parallel
    says whether input features are split over TP ranks).
    process_weights(layer): after loading (online quantization; on CUDA, the kernels' layout).
    apply(layer, x, bias): x [T, in_per_rank] -> [T, out_per_rank], bias added (row-parallel layers
    pass None and add theirs after the all-reduce).
    """

    quantized = True

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int, in_full: int) -> None:
        raise NotImplementedError

    def init_buffers(self, layer: nn.Module) -> None:
        """Index tables on the layer's device, after the model is materialised from meta."""

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """This rank's weight [out_per_rank, in_per_rank], float32."""
        raise NotImplementedError

    def pack(self, layer: nn.Module) -> PackedWeight | None:
        """This rank's weight in the GPU kernels' layout (packed.py), None where the kernels cannot take it."""
        return None

    def packed_params(self) -> tuple[str, ...]:
        """Parameters the packed layout replaces (freed once it is built)."""
        return ()

    def process_weights(self, layer: nn.Module) -> None:
        """After loading: on CUDA (with Triton) repack into the kernels' layout, and free what it replaces.
        4-bit GPTQ / AWQ layers then move to PyTorch's tinygemm int4 kernel where it takes them (tinygemm.py).
        `layer.linear_kernel` says which kernel serves the layer (the loader logs it)."""
        device = next(p.device for p in layer.parameters())
        if not kernels_available(device):
            layer.linear_kernel = "reference dequantize" + ("" if device.type == "cpu" else " (no Triton)")
            return
        packed = self.pack(layer)
        if packed is None:
            layer.linear_kernel = "reference dequantize (the kernels' layout does not fit)"
            return
        dtype = torch.get_default_dtype()  # the activations' dtype: the loader sets the model's
        if packed.bits == 4:
            from parallel.quant import tinygemm

            fast = tinygemm.convert(packed, dtype)
            if not isinstance(fast, str):
                layer.packed, layer.linear_kernel = fast, fast.describe()
                for name in self.packed_params():
                    delattr(layer, name)
                _fused_gemv(layer, dtype)
                return
            layer.tinygemm_skipped = fast  # why the Triton kernels serve this 4-bit layer
        layer.packed = packed
        for name in self.packed_params():
            delattr(layer, name)
        packed.tune(dtype)
        layer.linear_kernel = ("w8a8 _scaled_mm + fp8 gemv" if packed.w8a8_scale is not None else
                               f"triton {'fp8' if packed.bits is None else f'int{packed.bits}'} gemv/gemm")
        _fused_gemv(layer, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = getattr(layer, "packed", None)
        if packed is not None:  # CUDA: the Triton GEMV/GEMM or _scaled_mm (packed.py)
            return packed.apply(x, bias)
        # Dequantize-then-matmul (CPU, and shapes the kernels do not take): exact w.r.t. the dequantized
        # model on any device; only one layer's weight is ever materialised at a time.
        return linear(x, self.dequantize(layer).to(x.dtype), bias)


def _fused_gemv(layer: nn.Module, dtype: torch.dtype) -> None:
    """The batch-1 fused decoder's view of the packed weight (fused_gemv.py); its kernel joins the layer's name."""
    from parallel.quant import fused_gemv

    fused_gemv.prepare(layer, dtype)
    if getattr(layer, "gemv_weight", None) is not None:
        layer.linear_kernel += "; batch 1: fused quantized GEMV"


class UnquantizedLinearMethod(LinearMethod):
    """weight [out, in] in the model dtype; apply is the plain `linear` (layers inline it, see linear.py)."""

    quantized = False

    def create_weights(self, layer, in_per_rank, out_per_rank, in_full):
        layer.weight = quant_param((out_per_rank, in_per_rank), torch.get_default_dtype(), layer.weight_loader,
                                   out_dim=0, in_dim=1)

    def process_weights(self, layer):
        pass

    def apply(self, layer, x, bias):
        return linear(x, layer.weight, bias)


class QuantConfig:
    """A parsed `quantization_config`: its method name and the linear method it gives."""

    name: str = ""
    lm_head: bool = False  # the LM head is stored quantized too (GPTQ `lm_head: true`)

    def linear_method(self) -> LinearMethod:
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """The name a checkpoint tensor loads under (a format that names a tensor differently maps it here)."""
        return name
