#!/usr/bin/env python3
"""How long a side thread's CUDA calls take while another thread of the process fetches a GPU step's result.

The served decode replica runs its KV receive on a thread beside the engine's: on 2 x H100 each of that
thread's few CUDA calls (a small host-to-device copy, an NCCL post, an `index_copy_` launch) took 1-8 ms of
wall time for under 0.6 ms of CPU (TANDEM_KV_PHASES), about the length of a decode step. This isolates it:
an "engine" thread loops over a ~`--step-ms` GPU step (matmuls on the default stream), then fetches its
result to the host, either as the engine fetches sampled tokens (`.tolist()`: a copy into pageable memory,
which blocks inside the CUDA driver until the step is done) or through a pinned buffer (a non-blocking copy,
then an event wait). Meanwhile the side thread times the calls a KV receive makes, on its own stream.

    python scripts/bench_cuda_stall.py [--out bench_results/cuda_stall.json]

Prints, per fetch mode, each call's wall time (p50, p90, max, in ms); writes them to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

FETCHES = ("none", "tolist", "pinned")  # none: the engine thread launches steps but never fetches


def _engine(stop: threading.Event, fetch: str, step_ms: float, device: torch.device) -> None:
    """Steps of ~step_ms on the default stream, each followed by its result's fetch."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty(256, dtype=torch.int64, device=device)
    host = torch.empty(256, dtype=torch.int64, pin_memory=True)
    done = torch.cuda.Event()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    reps = max(1, round(step_ms / ((time.perf_counter() - t) * 1e3 / 10)))
    while not stop.is_set():
        x = a
        for _ in range(reps):
            x = a @ a
        out.copy_(x[0, :256].to(torch.int64))
        if fetch == "tolist":
            out.tolist()
        elif fetch == "pinned":
            host.copy_(out, non_blocking=True)
            done.record()
            done.synchronize()
            host.tolist()
        else:
            torch.cuda.current_stream().synchronize()


def _side_calls(device: torch.device, rounds: int) -> dict[str, list[float]]:
    """The KV receive's kinds of CUDA call, on a stream of this thread's own, timed (ms each)."""
    stream = torch.cuda.Stream(device)
    cache = torch.zeros(64, 4096, dtype=torch.int64, device=device)
    buf = torch.ones(32, 4096, dtype=torch.int64, device=device)
    times: dict[str, list[float]] = {"index_h2d_pinned": [], "index_h2d_pageable": [], "empty": [], "index_copy_": [],
                                     "stream_sync": []}
    ids = list(range(0, 64, 2))
    with torch.cuda.stream(stream):
        for _ in range(rounds):
            t0 = time.perf_counter()
            index = torch.tensor(ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)
            t1 = time.perf_counter()
            torch.tensor(ids, dtype=torch.long, device=device)
            t2 = time.perf_counter()
            torch.empty(8 << 20, dtype=torch.uint8, device=device)
            t3 = time.perf_counter()
            cache.index_copy_(0, index, buf)
            t4 = time.perf_counter()
            stream.synchronize()
            t5 = time.perf_counter()
            for name, a, b in (("index_h2d_pinned", t0, t1), ("index_h2d_pageable", t1, t2), ("empty", t2, t3),
                               ("index_copy_", t3, t4), ("stream_sync", t4, t5)):
                times[name].append((b - a) * 1e3)
            time.sleep(0.003)  # land at different points of the engine's step
    return times


def _summary(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {"p50": round(statistics.median(s), 3), "p90": round(s[int(0.9 * (len(s) - 1))], 3), "max": round(s[-1], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=10.0, help="the engine thread's GPU step (default 10 ms)")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--out", default="bench_results/cuda_stall.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_stall.py needs a CUDA device")
    device = torch.device("cuda", 0)
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "step_ms": args.step_ms,
              "fetches": {}}
    for fetch in FETCHES:
        stop = threading.Event()
        engine = threading.Thread(target=_engine, args=(stop, fetch, args.step_ms, device), daemon=True)
        engine.start()
        time.sleep(0.5)
        try:
            times = _side_calls(device, args.rounds)
        finally:
            stop.set()
            engine.join(10)
        result["fetches"][fetch] = {name: _summary(v) for name, v in times.items()}
        print(f"engine fetch: {fetch}")
        for name, s in result["fetches"][fetch].items():
            print(f"  {name:20s} p50 {s['p50']:8.3f}  p90 {s['p90']:8.3f}  max {s['max']:8.3f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
