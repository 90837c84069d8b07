#!/usr/bin/env python3
"""Decode-batch W4A16 GEMV on tensor cores (parallel/kernels/w4_mma.py) against tinygemm and the bf16 GEMV, per
Llama-3.1-8B decoder shape, on one GPU.

    python scripts/bench_w4_mma.py [--out bench_results/w4_mma.json] [--quick]

First a correctness pass: random 4-bit layers (asymmetric zeros) in tinygemm's layout, built by `tinygemm.build` as
load builds them, for group sizes 32 / 64 / 128 / 256 and 1, 2, 5 and 8 rows, each tile against x @ the dequantized
weight in fp32 (relative error of the max, reported; a tile above 4e-3 is never timed). Then per shape (qkv
6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336; group 128) each kernel is replayed from a CUDA graph over
weight copies that together exceed L2 (`bench_gemv.bench`), at 1 row (and the best tile at 8 rows beside tinygemm):
bf16 `gemv.gemv` on a bf16 weight, tinygemm `aten._weight_int4pack_mm`, and every w4_mma tile of `sweep`. GB/s are of
the bytes each kernel must read (int4 codes + bf16 scale/zero pairs; bf16 weights). Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MAX_ERR = 4e-3
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # the LM head of a GPTQ checkpoint with lm_head: true
GROUP = 128
ROTATE_BYTES = 400 << 20  # weight copies a timed call cycles through: past the 50-60 MB L2


def _weights(n: int, k: int, copies: int) -> list:
    """`copies` random 4-bit layers (asymmetric zeros, group GROUP) in tinygemm's layout, as load builds them."""
    from scripts.bench_gemv_int4 import GROUP as INT4_GROUP, _weights as int4_weights

    assert INT4_GROUP == GROUP
    return int4_weights(n, k, copies)


def shape_state(name: str, n: int, k: int, bench) -> dict:
    """bf16 and tinygemm timings of a shape at one row, and the int4 weight copies the tiles are timed on."""
    from parallel.kernels.gemv import gemv

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, ROTATE_BYTES // (2 * n * k)))]
    bf16_us = 1e6 * bench(lambda: [gemv(x, w) for w in wb]) / len(wb)
    wb.clear()  # free the bf16 copies before the int4 ones are made
    q4_bytes = n * k // 2 + 4 * n * (k // GROUP)
    ws = _weights(n, k, max(2, ROTATE_BYTES // q4_bytes))
    tiny_us = 1e6 * bench(lambda: [torch.ops.aten._weight_int4pack_mm(x, w.weight, GROUP, w.scales_and_zeros)
                                   for w in ws]) / len(ws)
    row = {"shape": name, "n": n, "k": k, "bf16_us": bf16_us, "bf16_GBps": 2 * n * k / bf16_us / 1e3,
           "tinygemm_us": tiny_us, "tinygemm_GBps": q4_bytes / tiny_us / 1e3, "sweep": []}
    return {"row": row, "x": x, "ws": ws, "bytes": q4_bytes}


def sweep(quick: bool, wide: bool = False) -> list[dict]:
    """R 16-row tiles a CTA, KSPLIT warps splitting K, U 128-input steps prefetched, SUB: subtract 8 in bf16.
    wide: more tiles of two and four 16-row tiles a CTA (for tall weights: an LM head)."""
    out = [dict(R=1, KSPLIT=ks, U=u, SUB=0) for ks in (2, 4, 8, 16) for u in (2, 4, 8)]
    if not quick:  # H200, 2026-11-29: R 2 and 4 were slower on the decoder's shapes, SUB = 1 by 3-15%
        out += [dict(R=2, KSPLIT=ks, U=2, SUB=0) for ks in (4, 8)] + [dict(R=1, KSPLIT=8, U=u, SUB=1) for u in (2, 4)]
    if wide:
        out += [dict(R=2, KSPLIT=ks, U=u, SUB=0) for ks, u in ((2, 2), (2, 4), (4, 4), (8, 4))]
        out += [dict(R=4, KSPLIT=ks, U=u, SUB=0) for ks in (2, 4) for u in (2, 4)]
    return out


def check(cfgs: list[dict]) -> dict[str, float]:
    """Max relative error per tile over group sizes and row counts; raises nothing (a bad tile is dropped)."""
    from parallel.kernels.w4_mma import gemv_w4_mma
    from parallel.quant import tinygemm

    errs: dict[str, float] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for gs in (32, 64, 128, 256):
        n, k = 512, 2048
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32, generator=g)
        scales = torch.rand(n, k // gs, device="cuda", generator=g) * 2e-2 + 1e-3
        zeros = torch.randint(0, 16, (n, k // gs), device="cuda", generator=g).float()
        w = tinygemm.build(codes, scales, zeros, gs)
        ref = w.dense(torch.float32)
        for m in (1, 2, 5, 8):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            want = x.float() @ ref.t()
            for cfg in cfgs:
                key = json.dumps(cfg, sort_keys=True)
                try:
                    got = gemv_w4_mma(x, w.weight, w.scales_and_zeros, w.group_size, n, cfg).float()
                    e = ((got - want).abs().max() / want.abs().max()).item()
                except Exception as ex:  # a compile or launch failure
                    print(f"  {cfg} group {gs} rows {m}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    e = float("inf")
                errs[key] = max(errs.get(key, 0.0), e)
    return errs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--wide", action="store_true", help="also sweep more tiles of 2 and 4 16-row tiles a CTA")
    p.add_argument("--out", default="bench_results/w4_mma.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_w4_mma needs a CUDA GPU")
    from parallel.kernels.w4_mma import gemv_w4_mma
    from scripts.bench_gemv import bench

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    report = {"benchmark": "w4_mma", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": []}
    cfgs = sweep(a.quick, a.wide)
    t0 = time.time()
    errs = check(cfgs)
    report["max_rel_err"] = errs
    print(f"{report['gpu']}: correctness of {len(cfgs)} tiles in {time.time() - t0:.0f} s (incl. compiling)", flush=True)
    for key, e in errs.items():
        print(f"  max rel err {e:.2e}  {key}", flush=True)
    good = [c for c in cfgs if errs[json.dumps(c, sort_keys=True)] <= MAX_ERR]
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        st = shape_state(name, n, k, bench)
        row, x, ws = st["row"], st["x"], st["ws"]
        for cfg in good:
            us = 1e6 * bench(lambda: [gemv_w4_mma(x, w.weight, w.scales_and_zeros, GROUP, n, cfg) for w in ws]) / len(ws)
            row["sweep"].append({"config": cfg, "us": us, "GBps": st["bytes"] / us / 1e3})
        best = min(row["sweep"], key=lambda t: t["us"])
        row.update(mma_best_us=best["us"], mma_best_GBps=best["GBps"], mma_best_config=best["config"])
        x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        row["rows8_tinygemm_us"] = 1e6 * bench(lambda: [torch.ops.aten._weight_int4pack_mm(
            x8, w.weight, GROUP, w.scales_and_zeros) for w in ws]) / len(ws)
        row["rows8_mma_us"] = 1e6 * bench(lambda: [gemv_w4_mma(x8, w.weight, w.scales_and_zeros, GROUP, n, best["config"])
                                                   for w in ws]) / len(ws)
        report["results"].append(row)
        print(f"{name:8} bf16 {row['bf16_GBps']:5.0f} GB/s {row['bf16_us']:6.1f} us | tinygemm {row['tinygemm_GBps']:5.0f} "
              f"{row['tinygemm_us']:6.1f} us | w4_mma {best['GBps']:5.0f} {best['us']:6.1f} us {best['config']} | 8 rows: "
              f"tinygemm {row['rows8_tinygemm_us']:.1f} us, w4_mma {row['rows8_mma_us']:.1f} us", flush=True)
        for t in sorted(row["sweep"], key=lambda t: t["us"])[:6]:
            print(f"           {t['GBps']:5.0f} GB/s {t['us']:6.1f} us {t['config']}", flush=True)
        ws.clear()  # free this shape's copies before the next shape's
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    res = report["results"]
    if res:
        tot = {key: sum(r[key] for r in res) for key in ("bf16_us", "tinygemm_us", "mma_best_us")}
        report["per_layer_us"] = tot
        print(f"per decoder layer ({len(res)} shapes): bf16 {tot['bf16_us']:.1f} us, tinygemm {tot['tinygemm_us']:.1f} us, "
              f"w4_mma {tot['mma_best_us']:.1f} us", flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
