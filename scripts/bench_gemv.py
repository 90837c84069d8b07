#!/usr/bin/env python3
"""Batch-1 decode linear layers: cuBLAS (F.linear) vs our Triton GEMV, in weight bytes per second.

Each measurement replays a CUDA graph that runs the layer over ROTATE distinct weight copies
(more bytes than L2 holds, as consecutive layers of a real forward), so the figure is HBM streaming
bandwidth. Shapes are the linear layers of the models in scripts/model_shapes.py.

    python scripts/bench_gemv.py                       # the default tile choice vs cuBLAS
    python scripts/bench_gemv.py --sweep               # also every tile config (what parallel/kernels/gemv.py's table came from)
    python scripts/bench_gemv.py --tp 2 --fused --sweep --shapes "llama-3.1-8b qkv,llama-3.1-8b o,llama-3.1-8b gate_up,llama-3.1-8b down"
                                                       # a TP=2 rank's layers as its batch-1 decode step runs them
    python scripts/bench_gemv.py --rows 2,4,8,9,16 [--sweep]   # M rows (verification steps, small batches): the rows kernel
    python scripts/bench_gemv.py --fp8 [--sweep]       # FP8 e4m3 weights through the fused quantized GEMV (gemv_quant.py)
                                                       # beside the bf16 GEMV, each with the decoder's fused ops
    python scripts/bench_gemv.py --fp8 --sweep --shapes "llama-3.1-8b gate_up,llama-3.1-8b down" --fp8-chunks 8 --jobs 12
    python scripts/bench_gemv.py --int4 [--sweep --jobs 12]   # 4-bit codes (tinygemm's layout) through gemv_int4.py,
                                                       # beside tinygemm's kernel and the bf16 GEMV
Prints a table; writes JSON (--out). `--fp8 --sweep` also prints the `FP8_TABLE` lines of gemv_quant.py for the
fastest tiles it found.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (N, K) of the weight [out, in]
    "llama-3.1-8b qkv": (6144, 4096), "llama-3.1-8b o": (4096, 4096), "llama-3.1-8b gate_up": (28672, 4096),
    "llama-3.1-8b down": (4096, 14336), "llama-3.1-8b lm_head": (128256, 4096),
    "qwen3-8b gate_up": (24576, 4096), "qwen3-8b down": (4096, 12288), "qwen3-8b lm_head": (151936, 4096),
    "qwen3-30b-a3b qkv": (5120, 2048), "qwen3-30b-a3b o": (2048, 4096),
}
ROTATE_BYTES = 400 << 20  # weight copies per measurement: several times the 50-60 MB L2 of an H100/H200
ROW_PARALLEL = ("o", "down")  # layers whose input (K) a TP rank holds a share of; the others split N


def rank_shape(name: str, n: int, k: int, tp: int) -> tuple[int, int]:
    """The weight [N, K] one of `tp` TP ranks holds for layer `name`: row-parallel layers split K, the
    column-parallel ones (qkv, gate_up) and the vocab-parallel head split N."""
    if name.split()[-1] in ROW_PARALLEL:
        return n, k // tp
    return n // tp, k


def decoder_fused(name: str, n: int, k: int) -> dict:
    """The fused decoder's arguments for layer `name` (workers/models/fused_decode.py): qkv RMSNorm in, RoPE out
    (Llama's 40 of 48 heads rotated; other models' qkv the norm only), gate_up RMSNorm and SiLU-and-mul, o and
    down the residual add; {} for the head."""
    kind, dev = name.split()[-1], "cuda"
    norm = dict(norm_weight=torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5, eps=1e-5)
    if kind == "qkv":
        if not name.startswith("llama"):
            return norm
        from parallel.kernels.gemv import Rope

        rope = Rope(torch.tensor([5], device=dev), torch.randn(8, 2, 128, device=dev), 128, n * 40 // 48)
        return dict(norm, rope=rope)
    if kind == "gate_up":
        return dict(norm, silu=True)
    if kind in ROW_PARALLEL:
        return dict(residual=torch.randn(1, n, device=dev, dtype=torch.bfloat16))
    return {}


def bench(fn, iters: int = 20) -> float:
    """Seconds per call of fn, replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    p.add_argument("--sweep", action="store_true", help="time every tile config too")
    p.add_argument("--tp", type=int, default=1, help="time each layer as one of this many TP ranks holds it")
    p.add_argument("--fused", action="store_true", help="bf16: each layer with the fused batch-1 decoder's prologue "
                   "and epilogue (RMSNorm + RoPE, RMSNorm + SiLU-and-mul, residual add), as a decode step runs it")
    p.add_argument("--rows", default="", help="comma-separated row counts > 1: time the rows kernel instead")
    p.add_argument("--fp8", action="store_true", help="FP8 weights through gemv_quant.qgemv beside bf16 (Llama-3.1-8B "
                   "decoder shapes unless --shapes)")
    p.add_argument("--int4", action="store_true", help="4-bit weights through gemv_int4.py beside tinygemm and bf16 "
                   "(Llama-3.1-8B decoder shapes unless --shapes)")
    p.add_argument("--fp8-chunks", default="8,16", help="--fp8 --sweep: BLOCK_C of the RED tiles to time (8, 16; 64 "
                   "adds the 64-byte tiles)")
    p.add_argument("--jobs", type=int, default=8, help="--fp8 / --int4 --sweep: processes compiling the tiles before timing")
    p.add_argument("--out", default="bench_results/bench_gemv.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA GPU")
    if a.rows:
        return bench_rows(a)
    if a.int4:
        from scripts.bench_gemv_int4 import bench_int4

        return bench_int4(a, SHAPES, ROTATE_BYTES, bench)
    if a.fp8:
        from scripts.bench_gemv_fp8 import bench_fp8

        a.fp8_chunks = tuple(int(c) for c in a.fp8_chunks.split(","))

        return bench_fp8(a, SHAPES, ROTATE_BYTES, bench)
    from parallel.kernels.gemv import gemv, tile_config

    sweep = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
             for bn, bk, nw, ns in itertools.product([8, 16, 32], [256, 512, 1024], [4, 8], [3, 4, 5])
             if bn * bk <= 16384] if a.sweep else []
    report = {"benchmark": "gemv", "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "results": []}
    print(f"{report['gpu']}: weight GB/s (higher is better)")
    report["tp"], report["fused"] = a.tp, a.fused
    for name in a.shapes.split(","):
        n, k = rank_shape(name, *SHAPES[name], a.tp)
        fused = decoder_fused(name, n, k) if a.fused else {}
        copies = max(2, ROTATE_BYTES // (2 * n * k))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        nbytes = copies * 2 * n * k
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        got = gemv(x, ws[0])
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        t_cublas = bench(lambda: [F.linear(x, w) for w in ws])
        t_ours = bench(lambda: [gemv(x, w, **fused) for w in ws])
        row = {"shape": name, "n": n, "k": k, "cublas_GBps": nbytes / t_cublas / 1e9,
               "ours_GBps": nbytes / t_ours / 1e9, "ours_config": tile_config(n // 2 if fused.get("silu") else n, k, bool(fused.get("silu"))),
               "max_rel_err": err}
        best = None
        for cfg in sweep:
            try:
                t = bench(lambda: [gemv(x, w, config=cfg, **fused) for w in ws])
            except Exception as e:  # a config the compiler rejects (shared memory, registers)
                print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        if best:
            row["best_GBps"], row["best_config"] = nbytes / best[0] / 1e9, best[1]
        report["results"].append(row)
        extra = f"  best {row['best_GBps']:7.0f} {best[1]}" if best else ""
        print(f"{name:22}  cuBLAS {row['cublas_GBps']:7.0f}  ours {row['ours_GBps']:7.0f}  err {err:.1e}{extra}",
              flush=True)
        del ws
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


def rows_sweep(m: int) -> list[dict]:
    """Tile candidates of `_gemv_rows_kernel` for m rows: FMA tiles whose accumulator stays at 32-64
    registers a thread, and tensor-core tiles (rows padded to 16)."""
    bm = 1 << (m - 1).bit_length()
    out = []
    if bm <= 8:
        for bn, nw in ((4, 4), (8, 4), (8, 8), (16, 8)):
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=max(32, 64 * 32 * nw // (bm * bn)), DOT=False, num_warps=nw,
                            num_stages=4))
    for bn, bk, nw, ns in ((16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (16, 128, 2, 6), (16, 64, 2, 8),
                           (16, 128, 2, 8), (16, 128, 1, 6), (32, 128, 2, 6), (32, 128, 4, 6), (64, 64, 4, 8),
                           (64, 128, 4, 5), (128, 64, 4, 6)):
        out.append(dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, DOT=True, num_warps=nw, num_stages=ns))
    return out


def bench_rows(a) -> None:
    """cuBLAS vs `gemv_rows` at each row count of --rows, weight bytes per second (the rows are a few KB)."""
    from parallel.kernels.gemv import gemv_rows, rows_tile_config

    report = {"benchmark": "gemv_rows", "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "results": []}
    print(f"{report['gpu']}: weight GB/s (higher is better), M rows")
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, ROTATE_BYTES // (2 * n * k))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        nbytes = copies * 2 * n * k
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            err = ((gemv_rows(x, ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
            t_cublas = bench(lambda: [F.linear(x, w) for w in ws])
            t_ours = bench(lambda: [gemv_rows(x, w) for w in ws])
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_GBps": nbytes / t_cublas / 1e9,
                   "ours_GBps": nbytes / t_ours / 1e9, "ours_config": rows_tile_config(m, n, k), "max_rel_err": err,
                   "us_cublas": 1e6 * t_cublas / copies, "us_ours": 1e6 * t_ours / copies}
            best, tried = None, []
            for cfg in (rows_sweep(m) if a.sweep else []):
                try:
                    t = bench(lambda: [gemv_rows(x, w, config=cfg) for w in ws])
                except Exception as e:  # a config the compiler rejects (shared memory, registers)
                    print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                tried.append({"config": cfg, "GBps": nbytes / t / 1e9})
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best:
                row["best_GBps"], row["best_config"], row["sweep"] = nbytes / best[0] / 1e9, best[1], tried
            report["results"].append(row)
            extra = f"  best {row['best_GBps']:6.0f} {best[1]}" if best else ""
            print(f"{name:22} m={m:2}  cuBLAS {row['cublas_GBps']:6.0f}  ours {row['ours_GBps']:6.0f}  err {err:.1e}{extra}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
