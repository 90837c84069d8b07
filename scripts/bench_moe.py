#!/usr/bin/env python3
"""Fused MoE (Triton grouped GEMM) vs the expert loop, one MoE layer of real shapes, bf16, CUDA.

    python scripts/bench_moe.py --shape qwen3-30b-a3b --tokens 1,8,64,512,2048,8192
    python scripts/bench_moe.py --fp8 block      # also e4m3 experts (128 x 128 block scales; or `channel`) beside bf16
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


def _fp8_copy(ex, scheme: str, sh: dict):
    """The same experts in e4m3 (scripts/quantize.py's round-to-nearest), with 128 x 128 block or per-row scales."""
    from parallel.quant.rtn import Options, quantize_fp8
    from workers.models.moe import Experts

    block = (128, 128) if scheme == "block" else None
    o = Options("fp8", block=(128, 128)) if block else Options("fp8", fp8_scale="channel")
    q = Experts(sh["e"], sh["h"], sh["i"], fp8_block=block).to("cuda")
    for name in ("w13", "w2"):
        for e in range(sh["e"]):
            tensors, _ = quantize_fp8(getattr(ex, name)[e].float(), o)
            getattr(q, name).data[e].copy_(tensors["weight"])
            getattr(q, name + "_scale").data[e].copy_(tensors["weight_scale_inv" if block else "weight_scale"].reshape(
                getattr(q, name + "_scale").shape[1:]))
    return q


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,8,64,512,2048,8192")
    p.add_argument("--fp8", choices=["block", "channel"], help="also time the same experts in e4m3 (weight-only FP8)")
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
    fp8 = _fp8_copy(ex, a.fp8, sh) if a.fp8 else None
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
        extra = {}
        if fp8 is not None:
            scales = (fp8.w13_scale, fp8.w13_block, fp8.w2_scale, fp8.w2_block)
            fp8_out = fused_moe(x, fp8.w13, fp8.w2, ids, w, fp8_scales=scales)
            g8 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g8):
                fused_moe(x, fp8.w13, fp8.w2, ids, w, fp8_scales=scales)
            extra = dict(fp8_graph_ms=bench(g8.replay),
                         fp8_rel_err=((fp8_out.float() - ref.float()).norm() / ref.float().norm()).item())
            extra["fp8_speedup"] = graph_ms / extra["fp8_graph_ms"]
        rows.append(dict(tokens=t, loop_ms=loop_ms, fused_ms=fused_ms, fused_graph_ms=graph_ms, speedup=loop_ms / fused_ms, **extra,
                         rel_err=err, weight_bytes_touched=wbytes * touched / sh["e"],
                         experts_touched=touched, fused_tflops=flops / fused_ms / 1e9,
                         fused_weight_GBps=wbytes * touched / sh["e"] / graph_ms / 1e6, max_experts=active))
        r = rows[-1]
        print(f"T={t:5d}  loop {loop_ms:8.3f} ms  fused {fused_ms:8.3f} ms (graph {graph_ms:7.3f})  x{r['speedup']:5.1f}  err {err:.1e}  "
              f"{r['fused_tflops']:6.1f} TFLOP/s  weights {r['fused_weight_GBps']:7.0f} GB/s"
              + (f"  fp8 graph {r['fp8_graph_ms']:7.3f} ms (x{r['fp8_speedup']:4.2f}, err {r['fp8_rel_err']:.1e})" if fp8 else ""),
              flush=True)
    rep = {"benchmark": "moe_layer", "shape": a.shape, **sh, "gpu": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    del g
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=2)


if __name__ == "__main__":
    main()
