"""Write a quantized copy of a Hugging Face model folder, in the published checkpoint layouts Tandem
loads from config.json alone (parallel/quant): GPTQ (RTN), AWQ (RTN, GEMM packing) and FP8.

    python scripts/quantize.py SRC DST --method gptq --bits 4 --group-size 128 [--asym] [--desc-act]
    python scripts/quantize.py SRC DST --method awq --group-size 128
    python scripts/quantize.py SRC DST --method fp8 [--block 128 128 | --fp8-scale tensor | --fp8-scale channel]
    ... --dequantized-out REF      also write REF: the same model with every quantized weight replaced by
                                   its dequantized float32 value, as a plain checkpoint (the reference that
                                   Hugging Face transformers runs in the tests)

Only the decoder's linear layers are quantized (q/k/v/o, gate/up/down); embeddings, norms and the LM
head are copied unchanged. The dequantized reference is computed from the integer codes before they
are packed, so a packing bug in this tool or an unpacking bug in the loader shows up as a mismatch.

This is round-to-nearest (RTN): no calibration data. `--desc-act` orders each group of input features
by the column norms of the projections sharing that input (q/k/v; gate/up), a stand-in for GPTQ's
Hessian diagonal, to exercise act order's permutation and g_idx. GPTQ proper (error-compensating
updates with calibration data) and the perplexity report of issue 15 are a later stage.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble k of a word holds output 8c + AWQ_ORDER[k]
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANTIZABLE = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")
# Projections that read the same input share one act-order permutation (GPTQ's Hessian is per input).
_SIBLINGS = {"self_attn.q_proj": ("q", "k", "v"), "self_attn.k_proj": ("q", "k", "v"), "self_attn.v_proj": ("q", "k", "v"),
             "mlp.gate_proj": ("gate", "up"), "mlp.up_proj": ("gate", "up")}


@dataclass
class Options:
    method: str  # gptq | awq | fp8
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    block: tuple[int, int] | None = (128, 128)
    fp8_scale: str = "block"  # block | tensor | channel

    def check(self) -> None:
        if self.method == "gptq" and self.bits not in (4, 8):
            raise ValueError(f"GPTQ bits {self.bits}: 4 or 8")
        if self.method == "awq" and self.bits != 4:
            raise ValueError("AWQ is 4 bit")
        if self.method not in ("gptq", "awq", "fp8"):
            raise ValueError(f"unknown method {self.method!r}")
        if self.group_size <= 0 and self.group_size != -1:
            raise ValueError(f"group size {self.group_size}: positive or -1")

    def quantization_config(self) -> dict:
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                    "desc_act": self.desc_act, "checkpoint_format": "gptq", "static_groups": False,
                    "true_sequential": True, "damp_percent": 0.0, "pack_dtype": "int32",
                    "meta": {"quantizer": ["tandem scripts/quantize.py (RTN)"]}}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
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
    shifts = (torch.arange(pack, dtype=torch.int64) * bits).view(1, pack, 1)
    return _to_int32((c << shifts).sum(1))


def pack_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """codes [n, m] -> int32 [n, m / pack]; nibble k of word c holds column pack*c + order[k] (GPTQ qzeros: order = identity)."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    c = codes.to(torch.int64).view(codes.shape[0], codes.shape[1] // pack, pack)[:, :, list(order)]
    shifts = (torch.arange(pack, dtype=torch.int64) * bits).view(1, 1, pack)
    return _to_int32((c << shifts).sum(2))


# ---------------------------------------------------------------- quantizers: weight [out, in] -> (tensors, dequantized)


def _act_order(siblings: list[torch.Tensor]) -> torch.Tensor:
    """A permutation of the input features, largest column norm first over every projection of this input."""
    norms = torch.cat(siblings, 0).float().norm(dim=0)  # [in]
    return torch.argsort(norms, descending=True, stable=True)


def quantize_gptq(w: torch.Tensor, o: Options, perm: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, n_in = w.shape
    gs = n_in if o.group_size == -1 else o.group_size
    maxq = 2**o.bits - 1
    order = perm if perm is not None else torch.arange(n_in)
    groups = -(-n_in // gs)
    g_idx = torch.empty(n_in, dtype=torch.int32)
    g_idx[order] = (torch.arange(n_in) // gs).to(torch.int32)  # act order: groups are runs of the permuted order
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, order[g * gs:(g + 1) * gs]].float()  # [out, n]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if o.sym:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-6)  # stays a nonzero fp16 (subnormal) scale
        scales[g] = scale.half().float()  # the format stores fp16 scales: quantize against what is stored
        # Symmetric: the mid code. Asymmetric: at least 1, since the format stores zero - 1 in `bits` bits.
        zeros[g] = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64) if o.sym else \
            torch.round(-lo / scales[g]).clamp(1, maxq).to(torch.int64)
    s, z = scales[g_idx.long()].t(), zeros[g_idx.long()].t()  # [out, in] per element
    q = torch.clamp(torch.round(w.float() / s) + z, 0, maxq).to(torch.int64)  # [out, in]
    deq = (q - z).float() * s
    tensors = {"qweight": pack_rows(q.t().contiguous(), o.bits), "qzeros": pack_cols(zeros - 1, o.bits),
               "scales": scales.half(), "g_idx": g_idx}
    return tensors, deq


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


def quantize_fp8(w: torch.Tensor, o: Options) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    w = w.float()
    out, n_in = w.shape
    if o.fp8_scale == "block":
        bn, bk = o.block
        rows, cols = -(-out // bn), -(-n_in // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:out, :n_in] = w
        amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))  # [rows, cols]
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out, :n_in]
        name = "weight_scale_inv"  # DeepSeek's name; it multiplies: w = weight * weight_scale_inv
    else:
        amax = w.abs().amax() if o.fp8_scale == "tensor" else w.abs().amax(1, keepdim=True)  # [] or [out, 1]
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full, name = scale, "weight_scale"
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, name: scale.float()}, q.float() * full


# ---------------------------------------------------------------- the folder


def _tensor_files(src: str) -> dict[str, str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    names: dict[str, str] = {}
    for fname in sorted(os.listdir(src)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(src, fname), framework="pt") as f:
                names.update({k: fname for k in f.keys()})
    return names


def _quantize_one(name: str, w: torch.Tensor, o: Options, get) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if o.method == "fp8":
        return quantize_fp8(w, o)
    if o.method == "awq":
        return quantize_awq(w, o)
    perm = None
    if o.desc_act:
        m = QUANTIZABLE.match(name)
        prefix, module = m.group(1), m.group(2)
        kind = module.split(".")[0]
        sib = _SIBLINGS.get(module)
        names = [f"{prefix}{kind}.{s}_proj.weight" for s in sib] if sib else [name]
        perm = _act_order([get(n) for n in names])
    return quantize_gptq(w, o, perm)


def quantize_folder(src: str, dst: str, o: Options, dequantized_out: str | None = None) -> None:
    o.check()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if any(k in config for k in ("num_experts", "num_local_experts")):
        raise ValueError("MoE models are not supported by this tool yet")
    files = _tensor_files(src)
    handles = {f: safe_open(os.path.join(src, f), framework="pt") for f in sorted(set(files.values()))}
    get = lambda n: handles[files[n]].get_tensor(n)  # noqa: E731
    out_files: dict[str, dict[str, torch.Tensor]] = {f: {} for f in handles}
    ref_files: dict[str, dict[str, torch.Tensor]] = {f: {} for f in handles}
    for name, fname in files.items():
        t = get(name)
        if QUANTIZABLE.match(name):
            tensors, deq = _quantize_one(name, t, o, get)
            base = name[: -len("weight")]
            out_files[fname].update({base + k: v.contiguous() for k, v in tensors.items()})
            ref_files[fname][name] = deq.contiguous()
        else:
            out_files[fname][name] = t
            ref_files[fname][name] = t
    _write(src, dst, {**config, "quantization_config": o.quantization_config()}, out_files)
    if dequantized_out:
        _write(src, dequantized_out, {**config, "dtype": "float32"}, ref_files)


def _write(src: str, dst: str, config: dict, files: dict[str, dict[str, torch.Tensor]]) -> None:
    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):  # tokenizer, generation config, ...
        if not fname.endswith(".safetensors") and fname not in ("config.json", "model.safetensors.index.json") \
                and os.path.isfile(os.path.join(src, fname)):
            shutil.copy(os.path.join(src, fname), os.path.join(dst, fname))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for fname, tensors in files.items():
        save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
    if len(files) > 1:
        weight_map = {name: fname for fname, tensors in files.items() for name in tensors}
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--method", choices=["gptq", "awq", "fp8"], required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128, help="-1: one group per output row (GPTQ/AWQ)")
    p.add_argument("--asym", action="store_true", help="GPTQ: asymmetric (zero points) instead of symmetric")
    p.add_argument("--desc-act", action="store_true", help="GPTQ: act order (a permutation, stored as g_idx)")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], help="FP8 weight_block_size")
    p.add_argument("--fp8-scale", choices=["block", "tensor", "channel"], default="block")
    p.add_argument("--dequantized-out", help="also write the dequantized model here as a plain checkpoint")
    a = p.parse_args(argv)
    o = Options(a.method, a.bits, a.group_size, not a.asym, a.desc_act, tuple(a.block), a.fp8_scale)
    quantize_folder(a.src, a.dst, o, a.dequantized_out)
    print(f"wrote {a.dst} ({o.quantization_config()['quant_method']})" + (f" and {a.dequantized_out}" if a.dequantized_out else ""))


if __name__ == "__main__":
    main()
