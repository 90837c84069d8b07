#!/usr/bin/env python3
"""Where one SP rank's ring call spends its time when each call is timed alone (scripts/bench_sp_rank.py's "timed"):
the host's time to its first launch, each launch's host call, each kernel on the GPU and the GPU's idle gaps between
kernels, with whether the host or the GPU was behind at each gap. From a torch.profiler (Kineto) trace: host API
calls and GPU kernels on one clock, matched by their correlation ids.

    python scripts/ring_timeline.py --tokens 16384 --sp 4 --configs "default;128,128,8,3,pack,fuse,batchcopy"

Per config: the median over --reps calls (each after the GPU is idle, as bench_sp_rank's timed runs) of
  first_launch_us   call start -> the first kernel launch's host call begins (the host's set-up)
  first_kernel_us   call start -> the first kernel starts on the GPU
  kernels           per kernel in launch order: its GPU us, the gap before it (GPU idle since the previous kernel
                    ended) and `host_late_us`: how long after the previous kernel ended its launch call returned
                    (> 0: the GPU waited for the host)
  end_us            call start -> the last kernel ends
and the same config's median wall time per call without the profiler (sync, call, sync), for scale, and the ring
kernels it compiled (`compiled`: registers and spills per thread, shared memory bytes, warps, per specialisation:
two CTAs share an SM only where both fit). The profiler adds a few us to each host API call: compare configs within
one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parallel.kernels import ring_attention_triton as rt  # noqa: E402
from parallel.ring_attention import ring_rank_attention, split_for_ranks  # noqa: E402
from workers.sp_plan import owned_positions  # noqa: E402

LAUNCH_CALLS = ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sp", type=int, default=4)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--configs", default="default", help="';'-separated kernel configs ('default': the default)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="bench_results/ring_timeline.json")
    return p.parse_args(argv)


def wall_us(fn, reps: int) -> float:
    """Median us per call, each after the GPU is idle (bench_sp_rank's `timed`)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def trace_calls(fn, reps: int) -> list[dict]:
    """Kineto trace events of `reps` calls, each in its own "ring_call" annotation after the GPU is idle."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.cuda.synchronize()
            with record_function("ring_call"):
                fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text())["traceEvents"]


def per_call(events: list[dict]) -> list[dict]:
    """Each annotated call's timeline (see the module docstring), from the trace's events."""
    calls = sorted((e for e in events if e.get("name") == "ring_call" and e.get("ph") == "X"
                    and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    launches = sorted((e for e in events if e.get("name") in LAUNCH_CALLS and e.get("ph") == "X"),
                      key=lambda e: e["ts"])
    kernels = {e["args"].get("correlation"): e for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X" and "args" in e}
    out = []
    for c in calls:
        t0, t1 = c["ts"], c["ts"] + c["dur"]
        mine = [launch for launch in launches if t0 <= launch["ts"] <= t1]
        pairs = [(launch, kernels.get(launch["args"].get("correlation"))) for launch in mine]
        pairs = [(launch, k) for launch, k in pairs if k is not None]
        if not pairs:
            continue
        rows, prev_end = [], None
        for launch, k in pairs:
            row = {"name": k["name"][:40], "gpu_us": k["dur"], "launch_call_us": launch["dur"]}
            if prev_end is not None:
                row["gap_us"] = k["ts"] - prev_end
                row["host_late_us"] = launch["ts"] + launch["dur"] - prev_end
            rows.append(row)
            prev_end = k["ts"] + k["dur"]
        out.append({"first_launch_us": pairs[0][0]["ts"] - t0, "first_kernel_us": pairs[0][1]["ts"] - t0,
                    "end_us": prev_end - t0, "host_call_us": c["dur"], "kernels": rows})
    return out


def summary(calls: list[dict]) -> dict:
    """Medians over the calls (kernels by position in the call)."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    n = min(len(c["kernels"]) for c in calls)
    kernels = []
    for i in range(n):
        rows = [c["kernels"][i] for c in calls]
        kernels.append({"name": rows[0]["name"], **{key: med([r[key] for r in rows if key in r])
                                                    for key in ("gpu_us", "launch_call_us", "gap_us", "host_late_us")}})
    return {**{key: med([c[key] for c in calls]) for key in ("first_launch_us", "first_kernel_us", "end_us",
                                                             "host_call_us")}, "kernels": kernels}


def compiled_kernels() -> list[dict]:
    """The ring kernels kept for direct launches (`rt._HANDLES`, one per specialisation): their registers and spills
    per thread, shared memory and warps, as Triton's compiled kernel reports them."""
    out = []
    for kernel in rt._HANDLES.values():
        meta = getattr(kernel, "metadata", None)
        out.append({"regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None),
                    "shared_bytes": getattr(meta, "shared", None), "warps": getattr(meta, "num_warps", None)})
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    g = torch.Generator(device="cuda").manual_seed(a.tokens)
    q = torch.randn(a.tokens, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(a.tokens, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    positions = [owned_positions(0, a.tokens, r, a.sp, 16) for r in range(a.sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    report = {"device": torch.cuda.get_device_name(), "tokens": a.tokens, "sp": a.sp, "rank": a.rank, "configs": {}}
    for cfg in [c.strip() for c in a.configs.split(";") if c.strip()]:
        config = None if cfg == "default" else cfg
        rt._HANDLES.clear()  # this config's kernels only (`compiled_kernels`); a launch after it compiles nothing new
        fn = lambda: ring_rank_attention(qs[a.rank], blocks, shards, a.rank, 128 ** -0.5, "triton",  # noqa: E731
                                         kernel_config=config)
        for _ in range(3):
            fn()
        wall = wall_us(fn, a.reps)
        res = summary(per_call(trace_calls(fn, a.reps)))
        res["wall_us"] = wall
        res["compiled"] = compiled_kernels()
        report["configs"][cfg] = res
        print(f"{cfg}: wall {wall:.0f} us; first launch call at {res['first_launch_us']:.0f} us, first kernel at "
              f"{res['first_kernel_us']:.0f} us, last kernel ends at {res['end_us']:.0f} us (host call "
              f"{res['host_call_us']:.0f} us)")
        for row in res["kernels"]:
            extra = "" if row["gap_us"] is None else f"  gap {row['gap_us']:.1f}  host late {row['host_late_us']:.1f}"
            print(f"    {row['name']:<40} gpu {row['gpu_us']:7.1f}  launch call {row['launch_call_us']:6.1f}{extra}")
        for c in res["compiled"]:
            print(f"    compiled: {c['regs']} regs, {c['spills']} spills, {c['shared_bytes']} B shared, {c['warps']} warps")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
