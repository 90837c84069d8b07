#!/usr/bin/env python3
"""Batch-1 W4A16 GEMV: parallel/kernels/gemv_w4.py against tinygemm and the bf16 GEMV, per Llama-3.1-8B decoder shape.

    python scripts/bench_gemv_w4.py [--out /tmp/r/w4.json] [--jobs 12] [--quick]

Per shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336; group 128; random codes, scales and zeros
in tinygemm's layout, built by `tinygemm.build` as load builds them), each kernel is timed over weight copies that
together exceed L2, replayed from a CUDA graph (`bench_gemv.bench`), so the figures are HBM streaming rates of the bytes
each kernel must read (int4 codes + bf16 scale/zero pairs; bf16 weights for the bf16 GEMV):
  - bf16: `gemv.gemv`, the plain product on a bf16 weight of the same shape;
  - tinygemm: `aten._weight_int4pack_mm` (what 4-bit layers run at batch 1 today);
  - w4: `gemv_w4.gemv_w4` for every tile of `sweep`.
Every tile's output is checked against x @ the dequantized weight (fp32) before it is timed; a wrong one is reported and
never picked. Prints per shape the best tile and the per-layer total against the 2.5x target's ~52 us; writes JSON.
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

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
ROTATE_BYTES = 400 << 20


def sweep(k: int, quick: bool = False) -> list[dict]:
    """The tiles timed per shape. Round 1 (2026-11-27, H100) timed 10 (BLOCK_N, C, num_warps) tiles with one step
    prefetched by hand or Triton's cp.async pipeline (2-6 stages), split K 1-4, and a second load layout: one-warp tiles
    with C = 32 and BLOCK_N 4-8 prefetched by hand won on every shape; BLOCK_N >= 16 spilled (40-470 GB/s) and the cp.async
    pipeline ran at half the hand prefetch's speed or less. So here: those tiles with one or two steps in flight
    (PREFETCH 1, 2), split K, BLOCK_N 16 without prefetch (no spill), two-warp C = 64 tiles, register caps (MAXNREG:
    ptxas gave the prefetching one-warp tiles 164-255 registers, so 8-12 warps an SM), and MEMONLY tiles (the same
    loads without the arithmetic: the access pattern's ceiling, output not checked)."""
    steps = k // 32 // 32
    base = dict(C=32, num_warps=1, NUM_STAGES=1, MEMONLY=False, MAXNREG=None)
    out = []
    for split in (1, 2, 4):
        for bn in (4, 8):
            for pf in (1, 2):
                if steps % split == 0 and not (quick and split == 2):
                    out.append(dict(BLOCK_N=bn, PREFETCH=pf, SPLIT_K=split, **base))
    out.append(dict(BLOCK_N=16, PREFETCH=0, SPLIT_K=1, **base))
    for bn in (4, 8):
        out.append(dict(BLOCK_N=bn, PREFETCH=2, SPLIT_K=1, **{**base, "C": 64, "num_warps": 2}))
    for bn, pf, reg in ((8, 1, 128), (8, 2, 128), (4, 2, 96), (4, 1, 80), (8, 1, 168)):  # ptxas took 164-255 registers
        out.append(dict(BLOCK_N=bn, PREFETCH=pf, SPLIT_K=1, **{**base, "MAXNREG": reg}))
    for bn, pf in ((4, 2), (8, 1), (8, 2)):
        out.append(dict(BLOCK_N=bn, PREFETCH=pf, SPLIT_K=1, **{**base, "MEMONLY": True}))
    return out + mma_sweep(k)


def mma_sweep(k: int) -> list[dict]:
    """Tensor-core tiles (`gemv_w4._mma_kernel`): BLOCK_N rows x G 128-input tiles a step, Triton's cp.async pipeline
    of NUM_STAGES, split K where it divides the steps (64-row tiles leave 64-448 programs for these shapes)."""
    out = []
    for bn, nw, g, ns in ((64, 4, 2, 4), (64, 4, 4, 3), (128, 4, 2, 3), (64, 4, 2, 2), (32, 2, 4, 3)):
        for split in (1, 2, 4):
            if (k // (128 * g)) % split == 0:
                out.append(dict(MMA=True, BLOCK_N=bn, G=g, num_warps=nw, NUM_STAGES=ns, SPLIT_K=split, MEMONLY=False))
    return out


def _weights(n: int, k: int, copies: int) -> list:
    """`copies` random 4-bit layers in tinygemm's layout, group GROUP (bench_gemv_int4's, the same group size)."""
    from scripts.bench_gemv_int4 import GROUP as INT4_GROUP, _weights as int4_weights

    assert INT4_GROUP == GROUP
    return int4_weights(n, k, copies)


def _warm_worker(job: list[tuple[int, int, dict]]) -> int:
    """In a spawned process: compile (n, k, cfg) tiles (the Triton cache on disk then serves the timing process)."""
    from parallel.kernels.gemv_w4 import gemv_w4

    done = 0
    for n, k, cfg in job:
        try:
            w = _weights(n, k, 1)[0]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            gemv_w4(x, w.weight, w.scales_and_zeros, GROUP, n, cfg)
            torch.cuda.synchronize()
            done += 1
        except Exception:  # the timing process reports it
            pass
    return done


def _warm(jobs_list: list[tuple[int, int, dict]], jobs: int) -> None:
    import multiprocessing as mp

    if jobs <= 1 or not jobs_list:
        return
    t0 = time.time()
    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            done = sum(pool.map(_warm_worker, [jobs_list[i::jobs] for i in range(jobs)]))
        print(f"  compiled {done} of {len(jobs_list)} tiles in {jobs} processes, {time.time() - t0:.0f} s", flush=True)
    except Exception as e:  # the timing loop compiles each tile itself
        print(f"  compiling in {jobs} processes failed ({type(e).__name__}: {e})", flush=True)


def _time_tiles(cfgs: list[dict], x, ws: list, want: torch.Tensor, n: int, nbytes: int, bench) -> list[dict]:
    from parallel.kernels.gemv_w4 import gemv_w4

    tried = []
    scale = want.abs().max().item()
    for cfg in cfgs:
        try:
            got = gemv_w4(x, ws[0].weight, ws[0].scales_and_zeros, GROUP, n, cfg).float()
            # bf16 output: within one bf16 rounding (2^-8 relative) of the fp32 product, plus fp32 noise
            err = ((got - want).abs() - want.abs() * 2.0**-8).max().item() / scale
            if not cfg.get("MEMONLY") and not err < 1e-5:
                raise AssertionError(f"wrong output: excess error {err:.2e} of max |y|")
            t = bench(lambda: [gemv_w4(x, w.weight, w.scales_and_zeros, GROUP, n, cfg) for w in ws])
        except Exception as e:  # a tile the compiler rejects, or a wrong result (reported, never picked)
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        us = 1e6 * t / len(ws)
        tried.append({"config": cfg, "us": us, "GBps": nbytes / us / 1e3})
    return tried


def shape_state(name: str, n: int, k: int, bench) -> dict:
    """bf16 and tinygemm timings of a shape, and the int4 weight copies and reference output the tiles are timed on."""
    from parallel.kernels.gemv import gemv

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, ROTATE_BYTES // (2 * n * k)))]
    bf16_us = 1e6 * bench(lambda: [gemv(x, w) for w in wb]) / len(wb)
    wb.clear()  # free the bf16 copies before the int4 ones are made
    q4_bytes = n * k // 2 + 4 * n * (k // GROUP)
    ws = _weights(n, k, max(2, ROTATE_BYTES // q4_bytes))
    tiny_us = 1e6 * bench(lambda: [torch.ops.aten._weight_int4pack_mm(x, w.weight, GROUP, w.scales_and_zeros)
                                   for w in ws]) / len(ws)
    want = x.float() @ ws[0].dense(torch.float32).t()
    row = {"shape": name, "n": n, "k": k, "bf16_us": bf16_us, "bf16_GBps": 2 * n * k / bf16_us / 1e3,
           "tinygemm_us": tiny_us, "tinygemm_GBps": q4_bytes / tiny_us / 1e3, "sweep": []}
    return {"row": row, "x": x, "ws": ws, "want": want, "bytes": q4_bytes}


def _best(st: dict) -> dict:
    """The fastest tile that computes (MEMONLY tiles are the loads' ceiling, reported beside it)."""
    r = st["row"]
    best = min((t for t in r["sweep"] if not t["config"].get("MEMONLY")), key=lambda t: t["us"])
    mem = [t for t in r["sweep"] if t["config"].get("MEMONLY")]
    mma = [t for t in r["sweep"] if t["config"].get("MMA")]
    if mma:
        top = max(mma, key=lambda t: t["GBps"])
        r["mma_best_GBps"], r["mma_best_config"] = top["GBps"], top["config"]
    if mem:
        r["memonly_best_GBps"] = max(t["GBps"] for t in mem)
    r.update(w4_best_us=best["us"], w4_best_GBps=best["GBps"], w4_best_config=best["config"])
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--jobs", type=int, default=12, help="processes compiling the tiles before timing")
    p.add_argument("--quick", action="store_true", help="leave out the split-K-2 CUDA-core tiles")
    p.add_argument("--out", default="bench_results/bench_gemv_w4.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv_w4 needs a CUDA GPU")
    from scripts.bench_gemv import bench

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    report = {"benchmark": "gemv_w4", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": []}
    print(f"{report['gpu']}: batch-1 GEMV, GB/s of the bytes each kernel reads, us per call", flush=True)
    names = a.shapes.split(",")
    _warm([(*SHAPES[nm], cfg) for nm in names for cfg in sweep(SHAPES[nm][1], a.quick)], a.jobs)
    states = {}
    for name in names:
        n, k = SHAPES[name]
        st = states[name] = shape_state(name, n, k, bench)
        st["row"]["sweep"] += _time_tiles(sweep(k, a.quick), st["x"], st["ws"], st["want"], n, st["bytes"], bench)
        report["results"].append(st["row"])
        _save(report, a.out)
    for name in names:
        st = states[name]
        r = _best(st)
        _save(report, a.out)
        print(f"{name:8} bf16 {r['bf16_GBps']:5.0f} GB/s {r['bf16_us']:6.1f} us | tinygemm {r['tinygemm_GBps']:5.0f} "
              f"{r['tinygemm_us']:6.1f} us | w4 best {r['w4_best_GBps']:5.0f} {r['w4_best_us']:6.1f} us "
              f"{r['w4_best_config']} | loads only {r.get('memonly_best_GBps', 0):5.0f} GB/s | best MMA "
              f"{r.get('mma_best_GBps', 0):5.0f} GB/s", flush=True)
        for t in sorted(r["sweep"], key=lambda t: t["us"])[:8]:
            print(f"           {t['GBps']:5.0f} GB/s {t['us']:6.1f} us {t['config']}", flush=True)
        del st["ws"]
    res = report["results"]
    if len(res) == len(SHAPES):
        tot = {key: sum(r[key] for r in res) for key in ("bf16_us", "tinygemm_us", "w4_best_us")}
        print(f"per layer: bf16 {tot['bf16_us']:.1f} us, tinygemm {tot['tinygemm_us']:.1f} us, w4 {tot['w4_best_us']:.1f} us "
              f"(target for 2.5x end to end: <= ~52 us)", flush=True)
        report["per_layer_us"] = tot
        print("TABLE entries (parallel/kernels/gemv_w4.py):")
        for r in res:
            print(f"    ({r['n']}, {r['k']}): {r['w4_best_config']!r},  # {r['w4_best_GBps']:.0f} GB/s, "
                  f"{r['w4_best_us']:.1f} us (tinygemm {r['tinygemm_us']:.1f}), {r['shape']}")
        _save(report, a.out)
    print(f"wrote {a.out}")


def _save(report: dict, path: str) -> None:
    """After every step: a run cut short keeps what it measured."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
