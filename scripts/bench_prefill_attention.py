#!/usr/bin/env python3
"""Tile sweep of the Triton causal prefill kernel (workers/kernels/paged_attention.py) on one sequence.

One layer's attention for a T-token prompt over a paged cache (16-token blocks in random order), bf16,
Llama-3.1-8B heads (32 query, 8 KV, D=128). FLOPs are the causal count, 2 * T^2 * D * Hq.

    python scripts/bench_prefill_attention.py                 # T = 8192
    python scripts/bench_prefill_attention.py --tokens 2048
Prints ms per layer and TFLOP/s per (BLOCK_M, BLOCK_N, warps, stages); writes JSON (--out).
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

CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
           (128, 32, 8, 3), (64, 128, 4, 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default="bench_results/bench_prefill_attention.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention needs a CUDA GPU")
    import triton

    from workers.kernels import paged_attention as pa

    t, hq, hkv, d, page = a.tokens, 32, 8, 128, 16
    nb = t // page + 8
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, nb, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(nb, device="cuda")[: -(-t // page)][None].int()
    seq_lens = torch.tensor([t], device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0, t], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    flops = 2 * t * t * d * hq
    report = {"benchmark": "prefill_attention", "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "tokens": t, "results": []}
    print(f"{report['gpu']}: causal prefill attention, {t} tokens, Hq={hq}, Hkv={hkv}, D={d}")
    for bm, bn, warps, stages in CONFIGS:
        grid = (hq, 1, triton.cdiv(t, bm))

        def run():
            pa._prefill_kernel[grid](q, kv[0], kv[1], bt, seq_lens, qsl, out, d**-0.5 * pa._LOG2E,
                                     q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv[0].stride(0),
                                     kv[0].stride(1), kv[0].stride(2), bt.stride(0), GQA=hq // hkv, D=d, PAGE=page,
                                     BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        try:
            ms = triton.testing.do_bench(run, warmup=5, rep=50)
        except Exception as e:  # a tile that does not fit in shared memory
            print(f"  {(bm, bn, warps, stages)}: {type(e).__name__}")
            continue
        row = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, ms=ms, tflops=flops / ms / 1e9)
        report["results"].append(row)
        print(f"  {(bm, bn, warps, stages)}: {ms:.3f} ms  {row['tflops']:.0f} TFLOP/s")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
