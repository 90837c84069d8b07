"""`scripts/bench_gemv.py --int4 [--sweep]`: the batch-1 4-bit GEMV (parallel/kernels/gemv_int4.py) beside tinygemm and bf16.

Per Llama-3.1-8B decoder linear, weights in tinygemm's layout (group 128, random codes, scales and zeros, built by
`tinygemm.build` as load builds them), each timed over weight copies that together exceed L2 from a CUDA graph
(`bench_gemv.bench`), so the figures are HBM streaming rates:
  - q4: our kernel as the fused decoder calls it (qkv: RMSNorm + RoPE, gate/up: RMSNorm + SiLU-and-mul, o / down:
    residual add), with the tile load would pick (`fused_gemv.tune`) and, with --sweep, every tile of `sweep_configs`;
  - q4 plain: the same kernel's bare product (comparable with tinygemm's);
  - tinygemm: `aten._weight_int4pack_mm`, the bare product (what the unfused decoder runs per linear);
  - bf16: `gemv.gemv` with the same fused op on a bf16 weight of the same shape.
GB/s counts the bytes each kernel must read (int4 codes plus bf16 scale/zero pairs; bf16 weights). Every tile is checked
against tinygemm's product (plain) or the engine tile's fused output before it is timed. Prints `Q4_TABLE` lines
(gemv_quant.py) for the fastest tiles with --sweep.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from typing import Callable

import torch

from scripts.bench_gemv_fp8 import DECODER, _fused_args

GROUP = 128


def sweep_configs(k: int, paired: bool) -> list[dict]:
    """Tiles whose threads own whole 16-byte chunks (KS >= 32 x num_warps), a K step dividing K, and 16-64 words of
    codes per thread and step (both halves when paired; fewer leave each x value to too few rows)."""
    out = []
    for bn, ks, w in itertools.product((1, 2, 4, 8, 16), (32, 64, 128, 256), (1, 2, 4, 8)):
        words = bn * (2 if paired else 1) * ks // (32 * w) * 4
        if ks >= 32 * w and k % (32 * ks) == 0 and 16 <= words <= 64:
            out.append(dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, Q4=True))
    return out


def _weights(n: int, k: int, copies: int) -> list:
    """`copies` 4-bit layers in tinygemm's layout as load builds them (Int4PackWeight), on CUDA."""
    from parallel.quant import tinygemm

    out = []
    for _ in range(copies):
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        scales = torch.rand(n, k // GROUP, device="cuda") * 2e-3 + 1e-3
        zeros = torch.randint(0, 16, (n, k // GROUP), device="cuda").float()
        out.append(tinygemm.build(codes, scales, zeros, GROUP))
    return out


def _check(y: torch.Tensor, ref: torch.Tensor, what) -> None:
    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    if not err < 2e-2:
        raise AssertionError(f"{what}: relative error {err:.2e}")


def _warm_worker(job: tuple[str, tuple[int, int], list[dict]]) -> int:
    """In a spawned process: compile `cfgs` for one shape as they are timed (eagerly and under graph capture: PDL)."""
    from parallel.kernels import gemv_quant as gq
    from parallel.quant import fused_gemv
    from scripts.bench_gemv import bench

    name, (n, k), cfgs = job
    op = DECODER[name][1]
    fused = _fused_args(op, n // 2 if op == "silu" else n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    qw = fused_gemv.view(_weights(n, k, 1)[0])
    done = 0
    for cfg in cfgs:
        for f in (fused, {}):
            try:
                bench(lambda: gq.qgemv(x, qw, None, cfg, **f), iters=1)
                done += 1
            except Exception:  # the timing process reports it
                pass
    return done


def _warm(name: str, n_k: tuple[int, int], cfgs: list[dict], jobs: int) -> None:
    import multiprocessing as mp

    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            done = sum(pool.map(_warm_worker, [(name, n_k, cfgs[i::jobs]) for i in range(jobs)]))
        print(f"  {name}: compiled {done} of {2 * len(cfgs)} kernels in {jobs} processes", flush=True)
    except Exception as e:  # the timing loop compiles each tile itself
        print(f"  {name}: compiling in {jobs} processes failed ({type(e).__name__}: {e})", flush=True)


def _time_q4(bench: Callable, x, qws: list, cfg: dict, fused: dict, ref, tiny_ref) -> tuple[float, float]:
    """(seconds per pass over all copies fused, the same plain), after checking both outputs."""
    from parallel.kernels import gemv_quant as gq

    _check(gq.qgemv(x, qws[0], None, cfg), tiny_ref, (cfg, "plain vs tinygemm"))
    _check(gq.qgemv(x, qws[0], None, cfg, **fused), ref, (cfg, "fused vs the engine tile"))
    return (bench(lambda: [gq.qgemv(x, qw, None, cfg, **fused) for qw in qws]),
            bench(lambda: [gq.qgemv(x, qw, None, cfg) for qw in qws]))


def _shape_row(name: str, n_k: tuple[int, int], rotate_bytes: int, bench: Callable, sweep: bool, jobs: int) -> dict:
    from parallel.kernels import gemv_quant as gq
    from parallel.kernels.gemv import gemv
    from parallel.quant import fused_gemv

    kind, op = DECODER[name]
    n, k = n_k
    fused = _fused_args(op, n // 2 if op == "silu" else n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, rotate_bytes // (2 * n * k)))]
    t_bf16 = bench(lambda: [gemv(x, w, **fused) for w in ws])
    bf16_us = 1e6 * t_bf16 / len(ws)
    del ws
    q4_bytes = n * k // 2 + 4 * n * (k // GROUP)
    tws = _weights(n, k, max(2, rotate_bytes // q4_bytes))
    qws = [fused_gemv.view(w) for w in tws]
    t_tiny = bench(lambda: [torch.ops.aten._weight_int4pack_mm(x, w.weight, GROUP, w.scales_and_zeros) for w in tws])
    tiny_ref = torch.ops.aten._weight_int4pack_mm(x, tws[0].weight, GROUP, tws[0].scales_and_zeros)
    engine = fused_gemv.tune(qws[0], torch.bfloat16, kind)
    ref = gq.qgemv(x, qws[0], None, engine, **fused)
    t_q4, t_plain = _time_q4(bench, x, qws, engine, fused, ref, tiny_ref)
    us = lambda t: 1e6 * t / len(qws)  # noqa: E731
    row = {"shape": name, "n": n, "k": k, "kind": kind, "fused": op, "bf16_us": bf16_us,
           "bf16_GBps": 2 * n * k / bf16_us / 1e3, "tinygemm_us": us(t_tiny), "tinygemm_GBps": q4_bytes / us(t_tiny) / 1e3,
           "q4_config": engine, "q4_us": us(t_q4), "q4_GBps": q4_bytes / us(t_q4) / 1e3, "q4_plain_us": us(t_plain),
           "q4_plain_GBps": q4_bytes / us(t_plain) / 1e3}
    if sweep:
        cfgs = sweep_configs(k, kind == "paired")
        if jobs > 1:
            _warm(name, n_k, cfgs, jobs)
        tried = []
        for cfg in cfgs:
            try:
                tf, tp = _time_q4(bench, x, qws, cfg, fused, ref, tiny_ref)
            except Exception as e:  # a tile the compiler rejects, or a wrong result (reported, never picked)
                print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            tried.append({"config": cfg, "us": us(tf), "GBps": q4_bytes / us(tf) / 1e3, "plain_us": us(tp)})
        best = min(tried, key=lambda r: r["us"]) if tried else {"config": engine, "us": row["q4_us"], "GBps": row["q4_GBps"]}
        row.update(sweep=tried, best_config=best["config"], best_us=best["us"], best_GBps=best["GBps"])
    del qws, tws
    torch.cuda.empty_cache()
    return row


def bench_int4(a, shapes: dict, rotate_bytes: int, bench: Callable) -> None:
    """The --int4 mode of scripts/bench_gemv.py (see the module docstring)."""
    names = [s for s in a.shapes.split(",") if s in DECODER] if a.shapes != ",".join(shapes) else list(DECODER)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    report = {"benchmark": "gemv_int4", "gpu": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__, "results": []}
    print(f"{report['gpu']}: batch-1 GEMV, GB/s of the bytes each kernel reads, us per call")
    for name in names:
        r = _shape_row(name, shapes[name], rotate_bytes, bench, a.sweep, getattr(a, "jobs", 0))
        report["results"].append(r)
        with open(a.out, "w") as f:  # after every shape: a run cut short keeps what it measured
            json.dump(report, f, indent=2)
        extra = f"  best {r['best_GBps']:5.0f} GB/s {r['best_us']:6.1f} us {r['best_config']}" if a.sweep else ""
        print(f"{name:22} {r['fused']:8} bf16 {r['bf16_GBps']:5.0f} GB/s {r['bf16_us']:6.1f} us | tinygemm "
              f"{r['tinygemm_GBps']:5.0f} {r['tinygemm_us']:6.1f} us | q4 {r['q4_GBps']:5.0f} {r['q4_us']:6.1f} us "
              f"(plain {r['q4_plain_GBps']:5.0f} {r['q4_plain_us']:6.1f}) {r['q4_config']}{extra}", flush=True)
    if a.sweep:
        print("Q4_TABLE entries (parallel/kernels/gemv_quant.py):")
        for r in report["results"]:
            cfg = ", ".join(f"{k}={v!r}" for k, v in r["best_config"].items())
            print(f"    ({r['n']}, {r['k']}, {r['kind']!r}): dict({cfg}),  # {r['best_GBps']:.0f} GB/s, {r['shape']}")
    print(f"wrote {a.out}")
