"""`scripts/bench_gemv.py --fp8 [--sweep]`: the batch-1 FP8 GEMV (parallel/kernels/gemv_quant.py) beside the bf16 one.

Each decoder linear is timed as the fused decoder calls it (workers/models/fused_decode.py): qkv with the RMSNorm
prologue and RoPE, gate/up with RMSNorm and SiLU-and-mul, o and down with the residual add. The bf16 GEMV
(`gemv.gemv`, its default tiles) runs the same fused op on a bf16 weight of the same shape; both replay a CUDA graph
over weight copies that together exceed L2 (as `bench_gemv.bench`), so the figures are HBM streaming rates. GB/s
counts the bytes each kernel must read: bf16 weights, or e4m3 codes plus their float32 scales.

Without --sweep: the tiles the engine would use (`fused_gemv.tune`: FP8_TABLE's entry, else the fastest candidate
as load measures them). With --sweep: every tile of `sweep_configs` too, each checked
against the first candidate's output, and the fastest per shape, printed as FP8_TABLE lines to paste into
gemv_quant.py.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from typing import Callable

import torch

# name in bench_gemv.SHAPES -> kind (gemv_quant.FP8_TABLE's key) and the fused op the decoder runs with it
DECODER = {"llama-3.1-8b qkv": ("paired", "rope"), "llama-3.1-8b o": ("residual", "residual"),
           "llama-3.1-8b gate_up": ("paired", "silu"), "llama-3.1-8b down": ("residual", "residual")}
HEAD_DIM, Q_HEADS, KV_HEADS = 128, 32, 8  # Llama-3.1-8B: qkv rows = (32 + 2 * 8) * 128
DEVICE = "cuda"  # tests/test_bench_gemv_fp8.py runs the script's logic on CPU under Triton's interpreter


def sweep_configs(k: int, paired: bool, chunks: tuple[int, ...] = (8, 16), prefetch: bool = True) -> list[dict]:
    """FP8 tiles to time: 8- and 16-byte chunks summed in the thread (RED) over rows x chunks x warps, with 16-128
    (paired: 16-64 per half) bytes of codes per thread and step and a step of at most 4096 inputs, and with 64 in
    `chunks` the 64-byte-chunk tiles of gemv_quant.TILES (the kernel before the RED tiles); with `prefetch`, each
    RED tile of 2+ steps and at most 64 bytes a thread also with the next step's codes loaded during the current
    one (PREFETCH). Only tiles whose K step divides K."""
    from parallel.kernels import gemv_quant as gq

    out = []
    # Steps up to 4096 inputs (one step for K = 4096): a 4096 x 4096 layer is ~127 KB per SM, so one step of 64
    # bytes per thread at full occupancy (2048 threads) can have all of it in flight; the kernel has no software
    # pipeline (num_stages changes nothing in its SASS), so fewer, wider steps are the way to keep loads in flight.
    for bn, ks, w, c in itertools.product((1, 2, 4, 8, 16), (16, 32, 64, 128, 256, 512), (2, 4, 8), chunks):
        per_thread = bn * ks // (32 * w) * c  # bytes of codes per thread and step (per weight half when paired)
        if bn * ks >= 32 * w and 16 <= per_thread <= (64 if paired else 128) and k % (c * ks) == 0 and c * ks <= 4096:
            out.append(dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, BLOCK_C=c, RED=True))
            if prefetch and k // (c * ks) >= 2 and per_thread <= 64:  # the next step's codes in flight too
                out.append(dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, BLOCK_C=c, RED=True, PREFETCH=True))
    for bn, ks, w in gq.TILES[(True, paired)] if 64 in chunks else ():
        if k % (64 * ks) == 0:
            out.append(dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1))
    return out


def _fused_args(op: str, n: int, k: int) -> dict:
    """The keyword arguments of the decoder's fused call (gemv.gemv and gemv_quant.qgemv take the same)."""
    from parallel.kernels.gemv import Rope

    dev = DEVICE
    if op == "residual":
        return dict(residual=torch.randn(1, n, device=dev, dtype=torch.bfloat16))
    fused = dict(norm_weight=torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5, eps=1e-5)
    if op == "silu":
        return {**fused, "silu": True}
    ang = torch.rand(4096, 1, HEAD_DIM // 2, device=dev) * 6
    cs = torch.cat([torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)], 1).contiguous()
    rope = Rope(torch.tensor([777], device=dev, dtype=torch.int32), cs, HEAD_DIM, (Q_HEADS + KV_HEADS) * HEAD_DIM)
    return {**fused, "rope": rope}


def _fp8_weights(n: int, k: int, copies: int) -> list:
    """`copies` FP8 layers as load leaves them (per-channel scales), as the fused GEMV views them."""
    from parallel.kernels import gemv_quant as gq

    out = []
    for _ in range(copies):
        codes = (torch.randn(n, k, device=DEVICE) * 64).to(torch.float8_e4m3fn)
        scales = torch.rand(n, 1, device=DEVICE) * 1e-3 + 1e-4
        out.append(gq.QuantGemvWeight(gq.FP8, codes, scales, None, k, 8, n, k))
    return out


def _time_fp8(bench: Callable, x: torch.Tensor, qws: list, cfg: dict, fused: dict, ref: torch.Tensor) -> float:
    """Seconds per pass over all copies with tile `cfg`, after checking the first copy's output against `ref`."""
    from parallel.kernels import gemv_quant as gq

    y = gq.qgemv(x, qws[0], None, cfg, **fused).float()
    err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    if not err < 2e-2:
        raise AssertionError(f"tile {cfg}: relative error {err:.2e} against the first candidate")
    return bench(lambda: [gq.qgemv(x, qw, None, cfg, **fused) for qw in qws])


def _warm_worker(job: tuple[str, tuple[int, int], list[dict]]) -> int:
    """In a spawned process: compile `cfgs` for one shape, as `_time_fp8` launches them (eagerly, and under CUDA-graph
    capture, which adds PDL), into Triton's on-disk cache, where the timing process then finds them. Returns how
    many compiled."""
    from scripts.bench_gemv import bench

    name, (n, k), cfgs = job
    kind, op = DECODER[name]
    fused = _fused_args(op, n // 2 if op == "silu" else n, k)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    qws = _fp8_weights(n, k, 1)
    from parallel.kernels import gemv_quant as gq

    done = 0
    for cfg in cfgs:
        try:
            bench(lambda: gq.qgemv(x, qws[0], None, cfg, **fused), iters=1)
            done += 1
        except Exception:  # the timing process reports it
            pass
    return done


def _warm(name: str, n_k: tuple[int, int], cfgs: list[dict], jobs: int) -> None:
    """Compile the sweep's tiles in `jobs` processes at once (one compile is ~1 s of host time, and a shape has ~100
    tiles): the timing loop then loads each kernel from the cache instead of compiling it."""
    import multiprocessing as mp

    parts = [(name, n_k, cfgs[i::jobs]) for i in range(jobs)]
    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            done = sum(pool.map(_warm_worker, parts))
    except Exception as e:  # the timing loop then compiles each tile itself, one after another
        print(f"  {name}: compiling in {jobs} processes failed ({type(e).__name__}: {e}); compiling in turn", flush=True)
        return
    print(f"  {name}: compiled {done} of {len(cfgs)} tiles in {jobs} processes", flush=True)


def _shape_row(name: str, n_k: tuple[int, int], rotate_bytes: int, bench: Callable, sweep: bool,
               chunks: tuple[int, ...] = (8, 16), jobs: int = 0) -> dict:
    """One decoder linear: bf16 and FP8 (the engine's tiles, and with --sweep every tile), GB/s and times."""
    from parallel.kernels import gemv_quant as gq
    from parallel.kernels.gemv import gemv
    from parallel.quant import fused_gemv

    kind, op = DECODER[name]
    n, k = n_k
    rows_out = n // 2 if op == "silu" else n
    fused = _fused_args(op, rows_out, k)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, rotate_bytes // (2 * n * k)))]
    t_bf16 = bench(lambda: [gemv(x, w, **fused) for w in ws])
    bf16_bytes = len(ws) * 2 * n * k
    del ws
    qws = _fp8_weights(n, k, max(2, rotate_bytes // (n * k)))
    fp8_bytes = len(qws) * (n * k + 4 * n)
    first = gq.candidates(qws[0], kind == "paired")[0]
    ref = gq.qgemv(x, qws[0], None, first, **fused).float()
    engine = fused_gemv.tune(qws[0], torch.bfloat16, kind)  # what load picks: FP8_TABLE's entry, else measured
    t_engine = _time_fp8(bench, x, qws, engine, fused, ref)
    row = {"shape": name, "n": n, "k": k, "kind": kind, "fused": op, "bf16_us": 1e6 * t_bf16 * 2 * n * k / bf16_bytes,
           "bf16_GBps": bf16_bytes / t_bf16 / 1e9, "fp8_config": engine, "fp8_GBps": fp8_bytes / t_engine / 1e9,
           "fp8_us": 1e6 * t_engine / len(qws)}
    row["fp8_speedup_vs_bf16"] = row["bf16_us"] / row["fp8_us"]
    if sweep:
        tried = []
        cfgs = sweep_configs(k, kind == "paired", chunks)
        if jobs > 1:
            _warm(name, n_k, cfgs, jobs)
        for cfg in cfgs:
            try:
                t = _time_fp8(bench, x, qws, cfg, fused, ref)
            except Exception as e:  # a tile the compiler rejects, or a wrong result (reported, never picked)
                print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            tried.append({"config": cfg, "GBps": fp8_bytes / t / 1e9, "us": 1e6 * t / len(qws)})
        best = max(tried, key=lambda r: r["GBps"])
        row.update(sweep=tried, best_config=best["config"], best_GBps=best["GBps"], best_us=best["us"],
                   best_speedup_vs_bf16=row["bf16_us"] / best["us"])
    del qws
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_fp8(a, shapes: dict, rotate_bytes: int, bench: Callable) -> None:
    """The --fp8 mode of scripts/bench_gemv.py (see the module docstring)."""
    names = [s for s in a.shapes.split(",") if s in DECODER] if a.shapes != ",".join(shapes) else list(DECODER)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    report = {"benchmark": "gemv_fp8", "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "torch": torch.__version__, "results": []}
    print(f"{report['gpu']}: batch-1 fused GEMV, weight GB/s (bytes each kernel reads) and us per call")
    for name in names:
        row = _shape_row(name, shapes[name], rotate_bytes, bench, a.sweep, tuple(getattr(a, "fp8_chunks", (8, 16))),
                         getattr(a, "jobs", 0))
        report["results"].append(row)
        with open(a.out, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump(report, f, indent=2)
        extra = (f"  best fp8 {row['best_GBps']:6.0f} GB/s {row['best_us']:6.1f} us ({row['best_speedup_vs_bf16']:.2f}x)"
                 f" {row['best_config']}") if a.sweep else ""
        print(f"{name:22} {row['fused']:8}  bf16 {row['bf16_GBps']:6.0f} GB/s {row['bf16_us']:6.1f} us  fp8 "
              f"{row['fp8_GBps']:6.0f} GB/s {row['fp8_us']:6.1f} us ({row['fp8_speedup_vs_bf16']:.2f}x){extra}", flush=True)
        if a.sweep:  # each shape's line as soon as it is measured: a run cut short keeps those it finished
            print(_table_line(row), flush=True)
    if a.sweep:
        print("FP8_TABLE entries (parallel/kernels/gemv_quant.py):")
        for r in report["results"]:
            print(_table_line(r))
    print(f"wrote {a.out}")


def _table_line(r: dict) -> str:
    cfg = ", ".join(f"{k}={v!r}" for k, v in r["best_config"].items())
    return f"    ({r['n']}, {r['k']}, {r['kind']!r}): dict({cfg}),  # {r['best_GBps']:.0f} GB/s, {r['shape']}"
