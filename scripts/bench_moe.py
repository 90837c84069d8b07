#!/usr/bin/env python3
"""Fused MoE (Triton grouped GEMM) vs the expert loop, one MoE layer of real shapes, bf16, CUDA.

    python scripts/bench_moe.py --shape qwen3-30b-a3b --tokens 1,8,64,512,2048,8192
Times each with CUDA events (median of repeats, after warm-up); the loop includes its host sync,
as it runs in the engine. Also reports the fused kernel's weight-read bandwidth at small batches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qwen3-30b-a3b": dict(e=128, k=8, h=2048, i=768), "mixtral-8x7b": dict(e=8, k=2, h=4096, i=14336)}


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,8,64,512,2048,8192")
    p.add_argument("--out", default="bench_results/bench_moe.json")
    a = p.parse_args()
    from parallel.kernels.fused_moe import fused_moe
    from workers.models.moe import Experts

    sh = SHAPES[a.shape]
    torch.manual_seed(0)
    ex = Experts(sh["e"], sh["h"], sh["i"]).to("cuda").to(torch.bfloat16)
    ex.w13.data.normal_(0, sh["h"] ** -0.5)
    ex.w2.data.normal_(0, sh["i"] ** -0.5)
    wbytes = (ex.w13.numel() + ex.w2.numel()) * 2
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        x = torch.randn(t, sh["h"], device="cuda", dtype=torch.bfloat16)
        w, ids = torch.topk(torch.softmax(torch.randn(t, sh["e"], device="cuda"), -1), sh["k"], -1)
        ex.use_fused = False
        ref = ex(x, ids, w)
        loop_ms = bench(lambda: ex(x, ids, w))
        out = fused_moe(x, ex.w13, ex.w2, ids, w)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        fused_ms = bench(lambda: fused_moe(x, ex.w13, ex.w2, ids, w))
        g = torch.cuda.CUDAGraph()  # as it runs inside a decode graph: no launch overhead
        with torch.cuda.graph(g):
            fused_moe(x, ex.w13, ex.w2, ids, w)
        graph_ms = bench(g.replay)
        active = min(sh["e"], t * sh["k"])  # upper bound on experts touched
        touched = len(torch.unique(ids))
        flops = 2 * t * sh["k"] * 3 * sh["h"] * sh["i"]
        rows.append(dict(tokens=t, loop_ms=loop_ms, fused_ms=fused_ms, fused_graph_ms=graph_ms, speedup=loop_ms / fused_ms,
                         rel_err=err, weight_bytes_touched=wbytes * touched / sh["e"],
                         experts_touched=touched, fused_tflops=flops / fused_ms / 1e9,
                         fused_weight_GBps=wbytes * touched / sh["e"] / graph_ms / 1e6, max_experts=active))
        r = rows[-1]
        print(f"T={t:5d}  loop {loop_ms:8.3f} ms  fused {fused_ms:8.3f} ms (graph {graph_ms:7.3f})  x{r['speedup']:5.1f}  err {err:.1e}  "
              f"{r['fused_tflops']:6.1f} TFLOP/s  weights {r['fused_weight_GBps']:7.0f} GB/s", flush=True)
    rep = {"benchmark": "moe_layer", "shape": a.shape, **sh, "gpu": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    del g
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=2)


if __name__ == "__main__":
    main()
