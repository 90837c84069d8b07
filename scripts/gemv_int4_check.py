#!/usr/bin/env python3
"""On a GPU: the 4-bit GEMV (parallel/kernels/gemv_int4.py) against gemv_quant's older integer kernel on the same
tinygemm-layout weight, and both against the references, per fused op; and tinygemm's own batch-1 time per
inner_k_tiles. Prints one line per check, writes JSON (--out).

Why: tests/gpu/test_gemv_quant.py's fused-op cases failed for the 4-bit kernel on an H100 (2026-11-27) while the same
cases pass under Triton's interpreter (tests/test_gemv_int4_interpreted.py) and the plain product passed on the GPU;
this separates the prologue (RMSNorm, with x read as pairs or per element), the epilogues and the paired rows.

    python scripts/gemv_int4_check.py --out bench_results/gemv_int4_check.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TANDEM_QUANT_TUNE", "0")


def _weight(n: int, k: int, gs: int, perm: bool, seed: int = 0):
    """A random 4-bit weight in tinygemm's layout (fused GEMV view) and its dequantized fp32 weight in layout order."""
    from parallel.quant import fused_gemv, tinygemm

    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).cuda()
    scales = (torch.rand(n, k // gs, generator=g) * 2e-3 + 1e-3).cuda()
    zeros = torch.randint(0, 16, (n, k // gs), generator=g).float().cuda()
    order = torch.randperm(k, generator=g).cuda() if perm else None
    w = tinygemm.build(codes, scales, zeros, gs, order)
    deq = w.dense(torch.float32)  # layout order
    return fused_gemv.view(w), deq, order


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-9)).item()


def _ops(k: int, n: int) -> dict:
    from parallel.kernels.gemv import Rope

    ang = torch.rand(64, 1, 64, device="cuda") * 6
    cs = torch.cat([torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)], 1).contiguous()
    nw = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    return {"plain": {}, "plain_ptile": {}, "norm": dict(norm_weight=nw, eps=1e-6), "norm_f32w": dict(norm_weight=nw.float(), eps=1e-6),
            "silu": dict(norm_weight=nw, eps=1e-6, silu=True), "silu_nonorm": dict(silu=True),
            "rope": dict(norm_weight=nw, eps=1e-6, rope=Rope(torch.tensor([7], device="cuda"), cs, 128, n // 2)),
            "residual": dict(residual=torch.randn(1, n, device="cuda", dtype=torch.bfloat16) * 4)}


def check_case(n: int, k: int, gs: int, perm: bool) -> list[dict]:
    """Every fused op: Q4 (default paired / plain tile) and the older kernel vs the bf16 fused GEMV on the weight
    rounded to bf16 (x permuted as the layout is), and Q4 vs the older kernel."""
    from parallel.kernels import gemv_quant as gq
    from parallel.kernels.gemv import gemv

    qw, deq, order = _weight(n, k, gs, perm)
    w16 = deq.to(torch.bfloat16)
    h = (torch.randn(1, k, device="cuda") * 3).to(torch.bfloat16)
    out = []
    for name, fused in _ops(k, n).items():
        paired = "silu" in name or name in ("rope", "plain_ptile")
        q4 = gq.candidates(qw, paired)[0]
        old = dict(BLOCK_N=4 if paired else 8, KS=8, num_warps=2, num_stages=1)  # gemv_quant INT4PACK
        xl = h if order is None else h[:, order]  # the layout's input order (deq is in it)
        f = dict(fused)
        if "norm_weight" in f and order is not None:
            f["norm_weight"] = f["norm_weight"][order]
        row = {"n": n, "k": k, "gs": gs, "perm": perm, "op": name, "q4_tile": q4}
        try:
            if name == "norm_f32w":
                ref = gemv(xl, w16, norm_weight=f["norm_weight"].to(torch.bfloat16), eps=1e-6)
            else:
                ref = gemv(xl, w16, **f)
            y4 = gq.qgemv(h, qw, None, q4, **fused)
            yo = gq.qgemv(h, qw, None, old, **fused)
            row.update(q4_vs_bf16=_rel(y4, ref), old_vs_bf16=_rel(yo, ref), q4_vs_old=_rel(y4, yo))
            if name.startswith("plain"):
                row["q4_vs_fp32"] = _rel(y4, xl.float() @ deq.t())
        except Exception as e:  # reported, the other ops still run
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def tinygemm_tiles(shapes: dict) -> list[dict]:
    """tinygemm's batch-1 time per inner_k_tiles (2, 4, 8) on each shape, CUDA graph over weight copies past L2."""
    from parallel.quant import tinygemm
    from scripts.bench_gemv import ROTATE_BYTES, bench

    out = []
    for name, (n, k) in shapes.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        sz = tinygemm.scales_and_zeros(torch.rand(n, k // 128, device="cuda") * 1e-3 + 1e-3,
                                       torch.randint(0, 16, (n, k // 128), device="cuda").float(), 128, 128)
        copies = max(2, ROTATE_BYTES // (n * k // 2))
        row = {"shape": name, "n": n, "k": k}
        for ikt in (2, 4, 8):
            ws = [torch.ops.aten._convert_weight_to_int4pack(tinygemm.to_uint8_pairs(codes), ikt) for _ in range(copies)]
            t = bench(lambda: [torch.ops.aten._weight_int4pack_mm(x, w, 128, sz) for w in ws])
            row[f"ikt{ikt}_us"] = 1e6 * t / copies
            del ws
        print(json.dumps(row), flush=True)
        out.append(row)
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_results/gemv_int4_check.json")
    a = p.parse_args()
    rows = []
    for n, k, gs, perm in ((1536, 1024, 128, False), (1536, 1024, 32, True)):
        rows += check_case(n, k, gs, perm)
    from scripts.bench_gemv_fp8 import DECODER
    from scripts.bench_gemv import SHAPES

    tiles = tinygemm_tiles({s: SHAPES[s] for s in DECODER})
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    # per decoder layer of Llama-3.1-8B (one of each linear), which inner_k_tiles makes tinygemm fastest
    per_layer = {ikt: sum(r[f"ikt{ikt}_us"] for r in tiles) for ikt in (2, 4, 8)}
    best = min(per_layer, key=per_layer.get)
    best = best if per_layer[best] < 0.95 * per_layer[8] else 8  # another inner_k_tiles only if >= 5% faster
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "checks": rows, "tinygemm_inner_k_tiles": tiles,
                   "tinygemm_us_per_layer": per_layer, "best_inner_k_tiles": best}, f, indent=2)
    print(f"tinygemm us per decoder layer by inner_k_tiles: {per_layer}; best {best}")
    print(f"BEST_IKT={best}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
