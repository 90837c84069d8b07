"""The one weight layout the GPU kernels read (parallel/kernels/quant_gemm.py), built at load from any
checkpoint format, and the kernel each layer runs, chosen by device.

GPTQ and AWQ codes, zeros and scales (and FP8 weights with their scales) become
    codes  int32 [N, K / (32 / bits)] (row n's codes along K, low bits first) or e4m3 [N, K]
    scales [N, G], zeros [N, G] (none for FP8), G groups of `group_size` consecutive input features
    perm   [K] or None: GPTQ act order sorts the input features by group, so groups are contiguous;
           the activations are permuted the same way (x[:, perm]) before the GEMM.
`dequantize()` unpacks this layout with plain torch: the CPU tests check it against each method's
reference dequantization, and the GPU tests check the kernels against it.
On CUDA, `apply` runs the Triton GEMV (1-4 rows) or GEMM (W4A16, W8A16), or, for FP8 per-channel /
per-tensor weights, bf16 activations and more than 4 rows, FP8 activations and torch._scaled_mm (W8A8,
compute capability >= 8.9; cuBLASLt's row-wise scaling wants bf16 output): quantized per token, or with
the checkpoint's static `input_scale` (`act_scale`) when it has one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from parallel.kernels import quant_tiles
from parallel.quant import fp8_act

try:
    from parallel.kernels import quant_gemm as _kernels
except ImportError:  # no Triton (CPU machines): layers keep the reference dequantize path
    _kernels = None


@dataclass
class PackedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    bits: int | None  # None: FP8 codes
    perm: torch.Tensor | None = None
    w8a8_scale: torch.Tensor | None = None  # [1, N] float32: FP8 per-channel weights go through _scaled_mm
    act_scale: torch.Tensor | None = None  # [1] float32: FP8 static activation scale (None: dynamic per token)
    plan: dict | None = None  # measured kernel choices (quant_gemm.tune), set on CUDA before serving
    # W8A8 options, read from the environment at load (scripts/bench_quant.py's variants set them per model):
    # the producer of x emits its FP8 codes (fp8_act.py; TANDEM_FP8_FUSED_ACT=0: off), and cuBLAS's fast FP8
    # accumulation (TANDEM_FP8_FAST_ACCUM=1: on)
    act_from_producer: bool = True
    fast_accum: bool = False

    def tune(self, dtype: torch.dtype) -> None:
        if os.environ.get("TANDEM_QUANT_TUNE", "1") != "0":
            k = self.codes.shape[1] * (1 if self.bits is None else 32 // self.bits)
            self.plan = _kernels.tune(self.codes, self.scales, self.zeros, self.group_size, self.bits, k, dtype,
                                      gemm=self.w8a8_scale is None or dtype != torch.bfloat16)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 in the layer's original input order."""
        if self.bits is None:
            w = self.codes.float()
        else:
            shifts = torch.arange(0, 32, self.bits, dtype=torch.int32, device=self.codes.device)
            w = ((self.codes.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)).reshape(self.out_features, -1).float()
        g = torch.arange(w.shape[1], device=w.device) // self.group_size
        if self.zeros is not None:
            w = w - self.zeros.float()[:, g]
        w = w * self.scales.float()[:, g]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def fp8_input_rows(self, x: torch.Tensor) -> int | None:
        """The rows (padded) of the FP8 activations `apply` would quantize x to, if it runs the dynamic W8A8 GEMM on
        x; else None. The kernel that produces x can then emit them itself (fp8_act.py)."""
        m = x.numel() // x.shape[-1] if x.dim() else 0
        if (self.w8a8_scale is None or self.act_scale is not None or not x.is_cuda or x.dtype != torch.bfloat16
                or m <= quant_tiles.GEMV_MAX_ROWS or not self.act_from_producer):
            return None
        return quant_tiles.fp8_padded_rows(m)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.contiguous()  # the same tensor object when contiguous (as every producer's output is)
        if self.w8a8_scale is not None and x.shape[0] > quant_tiles.GEMV_MAX_ROWS and x.dtype == torch.bfloat16:
            pre = fp8_act.take(x, quant_tiles.fp8_padded_rows(x.shape[0])) if self.act_scale is None else None
            extra = dict(pre=pre) if pre is not None else {}
            if self.fast_accum:
                extra["fast_accum"] = True
            return _kernels.scaled_mm_fp8(x, self.codes, self.w8a8_scale, bias, self.act_scale, **extra)
        return _kernels.matmul_q(x, self.codes, self.scales, self.zeros, self.group_size, self.bits, bias, self.plan)


def kernels_available(device: torch.device) -> bool:
    return _kernels is not None and device.type == "cuda"


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (0 <= c < 2**bits) -> int32 [N, K / pack], code k of a row in word k // pack, bits (k % pack) * bits."""
    pack = 32 // bits
    c = codes.to(torch.int64).view(codes.shape[0], -1, pack)
    shifts = torch.arange(pack, dtype=torch.int64, device=codes.device) * bits
    words = (c << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def from_int_codes(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: torch.Tensor, bits: int,
                   group_size: int, scale_dtype: torch.dtype = torch.float16) -> PackedWeight | None:
    """q [K, N] codes, zeros/scales [G, N] per this layer's groups, group [K] (local group of each input
    feature) -> the kernel layout; None if the groups cannot be made contiguous runs of `group_size`."""
    k = q.shape[0]
    if k % group_size or not _kernels_fit(k, group_size, bits):
        return None
    order = torch.argsort(group, stable=True)
    sorted_groups = group[order]
    runs = torch.arange(k, device=q.device) // group_size
    # After sorting, input features k*gs .. (k+1)*gs - 1 must all belong to one group.
    first = sorted_groups.view(-1, group_size)[:, 0]
    if not torch.equal(sorted_groups, first[runs]):
        return None
    perm = None if torch.equal(order, torch.arange(k, device=q.device)) else order
    codes = q.index_select(0, order).t().contiguous() if perm is not None else q.t().contiguous()
    return PackedWeight(pack_codes(codes, bits), scales[first].t().contiguous().to(scale_dtype),
                        zeros[first].t().contiguous().to(scale_dtype), group_size, bits, perm)


def from_fp8(weight: torch.Tensor, scales: torch.Tensor, group_size: int, per_channel: bool,
             input_scale: torch.Tensor | None = None) -> PackedWeight | None:
    """weight e4m3 [N, K], scales [N, G] float32 (one per row and group of input features); input_scale:
    the static activation scale [1] float32 of a checkpoint with activation_scheme "static"."""
    k = weight.shape[1]
    if not _kernels_fit(k, group_size, None):
        return None
    w8a8 = None
    if per_channel and _kernels is not None and weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (8, 9):
        w8a8 = scales.reshape(1, -1).float().contiguous()
    act = input_scale.reshape(1).float().contiguous() if input_scale is not None else None
    return PackedWeight(weight.contiguous(), scales.float().contiguous(), None, group_size, None, None, w8a8, act_scale=act,
                        act_from_producer=fp8_act.enabled(), fast_accum=os.environ.get("TANDEM_FP8_FAST_ACCUM", "0") == "1")


def _kernels_fit(k: int, group_size: int, bits: int | None) -> bool:
    return quant_tiles.supported(k, group_size, bits)
