"""Round-to-nearest quantizers: one float weight [out, in] -> the tensors of a published checkpoint
layout (GPTQ, AWQ GEMM packing, FP8) and the dequantized float32 weight they stand for.

Used by scripts/quantize.py (which writes checkpoints) and by the loader (dummy weights quantized at
load, for benchmarks). Everything runs on the weight's device. The dequantized result is computed from
the integer codes before they are packed, so a packing bug here or an unpacking bug in the loader
shows up as a mismatch in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble k of a word holds output 8c + AWQ_ORDER[k]
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Options:
    method: str  # gptq | awq | fp8
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    block: tuple[int, int] | None = (128, 128)
    fp8_scale: str = "block"  # block | tensor | channel
    activation_scheme: str = "dynamic"  # FP8: dynamic | static (an input_scale per linear, from calibration data)
    lm_head: bool = False  # GPTQ: the LM head quantized too (GPTQModel's `lm_head: true`)

    def check(self) -> None:
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"activation scheme {self.activation_scheme!r}: 'dynamic' or 'static'")
        if self.activation_scheme == "static" and (self.method != "fp8" or self.fp8_scale == "block"):
            raise ValueError("a static activation scheme is FP8 with per-tensor or per-channel weight scales only")
        if self.method == "gptq" and self.bits not in (4, 8):
            raise ValueError(f"GPTQ bits {self.bits}: 4 or 8")
        if self.method == "awq" and self.bits != 4:
            raise ValueError("AWQ is 4 bit")
        if self.method not in ("gptq", "awq", "fp8"):
            raise ValueError(f"unknown method {self.method!r}")
        if self.lm_head and self.method != "gptq":
            raise ValueError(f"a quantized LM head is written in the GPTQ format only (lm_head: true), not {self.method}")
        if self.group_size <= 0 and self.group_size != -1:
            raise ValueError(f"group size {self.group_size}: positive or -1")

    def quantization_config(self, quantizer: str = "tandem RTN") -> dict:
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                    "desc_act": self.desc_act, "checkpoint_format": "gptq", "static_groups": False,
                    "true_sequential": True, "damp_percent": 0.0, "pack_dtype": "int32", "lm_head": self.lm_head,
                    "meta": {"quantizer": [quantizer]}}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        qc = {"quant_method": "fp8", "activation_scheme": self.activation_scheme, "fmt": "e4m3"}
        if self.fp8_scale == "block":
            qc["weight_block_size"] = list(self.block)
        return qc


# ---------------------------------------------------------------- packing


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [n, m] (0 <= c < 2**bits) -> int32 [n / pack, m], code of row pack*r + k in bits k*bits.. (GPTQ qweight)."""
    pack = 32 // bits
    c = codes.to(torch.int64).view(codes.shape[0] // pack, pack, codes.shape[1])
    shifts = (torch.arange(pack, dtype=torch.int64, device=codes.device) * bits).view(1, pack, 1)
    return _to_int32((c << shifts).sum(1))


def pack_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """codes [n, m] -> int32 [n, m / pack]; nibble k of word c holds column pack*c + order[k] (GPTQ qzeros: order = identity)."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    c = codes.to(torch.int64).view(codes.shape[0], codes.shape[1] // pack, pack)[:, :, list(order)]
    shifts = (torch.arange(pack, dtype=torch.int64, device=codes.device) * bits).view(1, 1, pack)
    return _to_int32((c << shifts).sum(2))


# ---------------------------------------------------------------- quantizers: weight [out, in] -> (tensors, dequantized)


def gptq_group_params(cols: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cols [out, n] (one group's input features) -> (fp16-representable scale [out], integer zero [out])."""
    maxq = 2**bits - 1
    lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale = ((hi - lo) / maxq).clamp(min=1e-6).half().float()  # the format stores fp16: quantize against it
    # Symmetric: the mid code. Asymmetric: at least 1, since the format stores zero - 1 in `bits` bits.
    zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64) if sym else \
        torch.round(-lo / scale).clamp(1, maxq).to(torch.int64)
    return scale, zero


def gptq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """codes q [out, in], scales/zeros [G, out], g_idx [in] -> the GPTQ checkpoint tensors."""
    return {"qweight": pack_rows(q.t().contiguous(), bits), "qzeros": pack_cols(zeros - 1, bits),
            "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}


def quantize_gptq(w: torch.Tensor, o: Options, perm: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, n_in = w.shape
    dev = w.device
    gs = n_in if o.group_size == -1 else o.group_size
    maxq = 2**o.bits - 1
    order = perm.to(dev) if perm is not None else torch.arange(n_in, device=dev)
    groups = -(-n_in // gs)
    g_idx = torch.empty(n_in, dtype=torch.int64, device=dev)
    g_idx[order] = torch.arange(n_in, device=dev) // gs  # act order: groups are runs of the permuted order
    scales = torch.empty(groups, out, device=dev)
    zeros = torch.empty(groups, out, dtype=torch.int64, device=dev)
    for g in range(groups):
        scales[g], zeros[g] = gptq_group_params(w[:, order[g * gs:(g + 1) * gs]].float(), o.bits, o.sym)
    s, z = scales[g_idx].t(), zeros[g_idx].t()  # [out, in] per element
    q = torch.clamp(torch.round(w.float() / s) + z, 0, maxq).to(torch.int64)  # [out, in]
    deq = (q - z).float() * s
    return gptq_tensors(q, scales, zeros, g_idx, o.bits), deq


def quantize_awq(w: torch.Tensor, o: Options) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, n_in = w.shape
    gs = n_in if o.group_size == -1 else o.group_size
    if n_in % gs or out % 8:
        raise ValueError(f"AWQ needs in ({n_in}) divisible by the group size ({gs}) and out ({out}) by 8")
    wg = w.float().view(out, n_in // gs, gs)
    lo, hi = wg.amin(2), wg.amax(2)  # [out, G] (AutoAWQ's asymmetric min/max)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = torch.clamp(-torch.round(lo / scales), 0, 15).to(torch.int64)
    q = torch.clamp(torch.round(wg / scales[..., None]) + zeros[..., None], 0, 15).to(torch.int64)  # [out, G, gs]
    deq = ((q - zeros[..., None]).float() * scales[..., None]).view(out, n_in)
    tensors = {"qweight": pack_cols(q.view(out, n_in).t().contiguous(), 4, AWQ_ORDER),
               "qzeros": pack_cols(zeros.t().contiguous(), 4, AWQ_ORDER), "scales": scales.t().contiguous().half()}
    return tensors, deq


def fp8_scale(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """Per-tensor ([]) or per-channel ([out, 1]) float32 scale with w / scale inside e4m3's range."""
    amax = w.abs().amax() if granularity == "tensor" else w.abs().amax(1, keepdim=True)
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


def quantize_fp8(w: torch.Tensor, o: Options) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    w = w.float()
    out, n_in = w.shape
    if o.fp8_scale == "block":
        bn, bk = o.block
        rows, cols = -(-out // bn), -(-n_in // bk)
        padded = torch.zeros(rows * bn, cols * bk, device=w.device)
        padded[:out, :n_in] = w
        amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))  # [rows, cols]
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out, :n_in]
        name = "weight_scale_inv"  # DeepSeek's name; it multiplies: w = weight * weight_scale_inv
    else:
        scale = fp8_scale(w, o.fp8_scale)
        full, name = scale, "weight_scale"
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, name: scale.float()}, q.float() * full


def quantize(w: torch.Tensor, o: Options, perm: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if o.method == "fp8":
        return quantize_fp8(w, o)
    if o.method == "awq":
        return quantize_awq(w, o)
    return quantize_gptq(w, o, perm)
