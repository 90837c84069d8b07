#!/usr/bin/env python3
"""Tile sweep of the Triton causal prefill kernel (parallel/kernels/paged_attention.py) on one sequence.

One layer's attention, bf16, Llama-3.1-8B heads (32 query, 8 KV, D=128), two cases:
* `fresh`: a T-token prompt with nothing cached (keys are the step's own k/v);
* `chunk`: the last `--chunk` tokens of a T-token prompt, the first T - chunk read from a paged cache
  (16-token blocks in random order), as in chunked prefill or a prefix-cache hit.
FLOPs are the causal count (fresh: 2 * T^2 * D * Hq). Each (BLOCK_M, BLOCK_N, warps, stages) runs with
plain loads and, on Hopper, with TMA loads of the new keys. For scale, the same run times PyTorch's own
SDPA kernels (flash, cuDNN) on the fresh case; Tandem does not use them.

    python scripts/bench_prefill_attention.py                 # T = 8192
    python scripts/bench_prefill_attention.py --tokens 2048
Prints ms per layer and TFLOP/s; writes JSON (--out).
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

CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4),
           (128, 32, 4, 4)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="query tokens of the `chunk` case")
    p.add_argument("--out", default="bench_results/bench_prefill_attention.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention needs a CUDA GPU")
    import triton

    from parallel.kernels import paged_attention as pa

    t, hq, hkv, d, page = a.tokens, 32, 8, 128, 16
    nb = t // page + 8
    kv = torch.randn(2, nb, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(nb, device="cuda")[: -(-t // page)][None].int()
    seq_lens = torch.tensor([t], device="cuda", dtype=torch.int32)
    report = {"benchmark": "prefill_attention", "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "tokens": t, "chunk": a.chunk, "results": [], "reference": []}
    print(f"{report['gpu']}: causal prefill attention, {t} tokens, Hq={hq}, Hkv={hkv}, D={d}")
    tma_modes = [False, True] if pa._tma_supported(kv) else [False]
    for case, q_len in (("fresh", t), ("chunk", a.chunk)):
        ctx = t - q_len
        flops = 2 * d * hq * (q_len * q_len + 2 * q_len * ctx)  # causal block + full context rows
        qkv = torch.randn(q_len, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        q = qkv[:, : hq * d].view(q_len, hq, d)
        k = qkv[:, hq * d: (hq + hkv) * d].reshape(q_len, hkv, d)  # RoPE makes k a new tensor; v stays a view
        v = qkv[:, (hq + hkv) * d:].view(q_len, hkv, d)
        qsl = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        print(f"{case}: {q_len} queries after {ctx} cached keys")
        for tiles in CONFIGS:
            for tma in tma_modes:
                def run():
                    pa.prefill_attention(q, k, v, kv, bt, seq_lens, qsl, q_len, d ** -0.5, out=out, tiles=tiles, tma=tma)
                try:
                    ms = triton.testing.do_bench(run, warmup=5, rep=50)
                except Exception as e:  # a tile that does not fit in shared memory
                    print(f"  {tiles} tma={tma}: {type(e).__name__}")
                    continue
                row = dict(case=case, block_m=tiles[0], block_n=tiles[1], num_warps=tiles[2], num_stages=tiles[3],
                           tma=tma, ms=ms, tflops=flops / ms / 1e9)
                report["results"].append(row)
                print(f"  {tiles} tma={tma}: {ms:.3f} ms  {row['tflops']:.0f} TFLOP/s", flush=True)
        if case == "fresh":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            qh = q.transpose(0, 1)[None]
            kh = k.transpose(0, 1).repeat_interleave(hq // hkv, 0)[None]
            vh = v.transpose(0, 1).repeat_interleave(hq // hkv, 0)[None]
            for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
                def run():
                    with sdpa_kernel(backend):
                        torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
                try:
                    ms = triton.testing.do_bench(run, warmup=5, rep=50)
                except Exception as e:
                    print(f"  {name} (reference): {type(e).__name__}: {str(e)[:120]}")
                    continue
                report["reference"].append(dict(kernel=name, ms=ms, tflops=flops / ms / 1e9))
                print(f"  {name} (reference, KV heads expanded): {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
