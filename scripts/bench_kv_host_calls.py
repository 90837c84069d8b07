#!/usr/bin/env python3
"""Host time of each call a KV handoff's sender makes, alone and beside other Python threads (issue 27's 1K handoff).

On the 2 x H100 host the sender's phases before its one message is on the wire cost ~0.4 ms of host time, 50-150 us
per torch-level call, with thread CPU time equal to wall time (TANDEM_KV_PHASES logs), and `time.sleep(0)` ~60 us.
This times, in the sender's own process (rank 0 of scripts/bench_kv_transfer.py's pair, one GPU each), each such
call one at a time: wall and this thread's CPU microseconds, median and p90 of --reps calls:

  py_call             an empty Python call (the clocks' own cost: subtract it)
  sleep0              time.sleep(0): the NCCL wait loop's yield (`_wait_nccl`); Linux's timer slack (50 us) applies
  sleep0_slack1us     the same after prctl(PR_SET_TIMERSLACK, 1 us) on this thread
  empty_64, empty_msg torch.empty of 64 words / of the 1K message (134 MB, from the caching allocator)
  index_tensor        torch.tensor(ids, device=cuda): the ordinary path's block index (waits for its copy)
  index_lane          Lane.index_of(ids): the lane's pinned buffer and one asynchronous copy
  current_stream      torch.cuda.current_stream()
  stream_ctx          entering and leaving `with torch.cuda.stream(s)` (the agent's own stream, every transfer)
  gather_ordinary     CacheBlocks.gather: the buffer's empty, the row copy's checks, its handle launch
  gather_lane         the lane's planned launch (block_copy.prepare_copy) into a kept buffer
  nccl_send_1B        ProcessGroupNCCL.send of 1 byte (rank 1 has posted the matching receives)
  nccl_send_msg       ProcessGroupNCCL.send of the 1K message (134 MB): posting only
  is_completed        Work.is_completed() of a finished send
  stream_sync_idle    torch.cuda.current_stream().synchronize() with nothing queued

under each condition (--conditions):
  bare          nothing else runs in the process (as in bench_kv_transfer.py's sender)
  poller        a second Python thread loops on time.sleep(0), as `_wait_nccl` does while another transfer waits
  poller_slack  the same with its timer slack at 1 us (it asks for the GIL every few us)
  busy          a second Python thread runs pure Python (an engine thread): the GIL's 5 ms switch interval
  cold          nothing else, but each call comes right after a wait in the CUDA driver (as after the bench's barrier),
                not after the same call (the phase logs see 2-3x the warm calls' times: are the calls cold?)

If bare is as slow as the phase logs, the host is (CPU, CUDA driver), not GIL hand-offs; if poller is much slower
than bare, it is the GIL. The process's facts come too: CPU model and MHz, clocksource, a pure-Python loop's speed,
Python / torch / Triton versions, the NCCL / CUDA environment variables set, threads in the process.

    python scripts/bench_kv_host_calls.py --out /tmp/r/host_calls.json
    TORCH_NCCL_TRACE_BUFFER_SIZE=0 python scripts/bench_kv_host_calls.py --conditions bare   # NCCL's flight recorder off
Needs 2 CUDA GPUs.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kv_transfer as bench  # noqa: E402
from workers.kv_transfer.blocks import CacheBlocks  # noqa: E402
from workers.kv_transfer.lanes import Lane  # noqa: E402

PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30
CONDITIONS = ("bare", "poller", "poller_slack", "busy", "cold")
SEND_CALLS = ("nccl_send_1B", "nccl_send_msg")  # each needs a receive posted by rank 1


def set_timer_slack(ns: int) -> int:
    """This thread's timer slack (Linux), returning the old one (-1 where prctl is missing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = libc.prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
        libc.prctl(PR_SET_TIMERSLACK, ns, 0, 0, 0)
        return old
    except (OSError, AttributeError):
        return -1


def time_call(fn: Callable[[], object], reps: int, warmup: int = 10, cold: bool = False) -> dict:
    """fn's wall and thread-CPU microseconds per call: median and p90 over reps single calls. cold: each call right
    after this thread waited in the CUDA driver for a GPU sleep (as a transfer starts after the bench's barrier)."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        if cold:
            torch.cuda._sleep(200_000)  # ~0.1 ms of GPU time, waited for by spinning in the driver
            torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        c1, w1 = time.thread_time(), time.perf_counter()
        wall.append((w1 - w0) * 1e6)
        cpu.append((c1 - c0) * 1e6)
    wall.sort()
    cpu.sort()
    return {"wall_us": round(statistics.median(wall), 1), "wall_p90_us": round(wall[int(0.9 * (reps - 1))], 1),
            "cpu_us": round(statistics.median(cpu), 1)}


class Background:
    """The condition's second Python thread, running until stopped."""

    def __init__(self, condition: str):
        self.condition, self._stop = condition, threading.Event()
        self._thread = None if condition in ("bare", "cold") else threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self.condition == "poller_slack":
            set_timer_slack(1000)
        if self.condition == "busy":
            while not self._stop.is_set():
                sum(range(1000))  # pure Python, holds the GIL but for the interpreter's switch interval
            return
        while not self._stop.is_set():
            time.sleep(0)

    def __enter__(self) -> "Background":
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _calls(device: torch.device, cache: torch.Tensor, ids: list[int], msg_bytes: int) -> dict[str, Callable[[], object]]:
    """The single-process calls, on the 1K message's shapes."""
    blocks, everything = CacheBlocks(cache), slice(None)
    lane = Lane(device, 4096)
    index = lane.index_of(ids)
    buf = lane.buffer("diag", (cache.shape[0], 2, len(ids), *cache.shape[3:]), cache.dtype)
    launch = blocks.prepare(everything, buf, index, True, None)
    stream, side = torch.cuda.current_stream(), torch.cuda.Stream(device)

    def stream_ctx() -> None:
        with torch.cuda.stream(side):  # KVTransferAgent._own_stream, entered and left around every transfer
            pass

    def slack_sleep() -> None:
        time.sleep(0)

    return {
        "py_call": lambda: None,
        "sleep0": lambda: time.sleep(0),
        "sleep0_slack1us": slack_sleep,  # run with this thread's slack at 1 us (`_condition`)
        "empty_64": lambda: torch.empty(64, dtype=torch.long, device=device),
        "empty_msg": lambda: torch.empty(msg_bytes, dtype=torch.uint8, device=device),
        "index_tensor": lambda: torch.tensor(ids, dtype=torch.long, device=device),
        "index_lane": lambda: lane.index_of(ids),
        "current_stream": torch.cuda.current_stream,
        "stream_ctx": stream_ctx,
        "gather_ordinary": lambda: blocks.gather(ids, everything, everything, index),
        "gather_lane": launch,
        "stream_sync_idle": stream.synchronize,
    }


def _condition(rank: int, condition: str, calls: dict, sends: dict, reps: int) -> dict:
    """Every call under one condition; rank 1 only posts the receives for rank 0's sends."""
    pg = dist.distributed_c10d._get_default_group()
    bench.sync_start(rank)
    if rank == 1:
        works = [pg.recv([buf], 0, 0) for name in SEND_CALLS for buf in [sends[name]] * (reps + 10)]
        for w in works:
            w.wait()
        bench.sync_start(rank)
        return {}
    out = {}
    with Background(condition):
        for name, fn in calls.items():
            if name == "sleep0_slack1us":
                old = set_timer_slack(1000)
                out[name] = time_call(fn, reps, cold=condition == "cold")
                set_timer_slack(old if old > 0 else 50_000)
            else:
                out[name] = time_call(fn, reps, cold=condition == "cold")
            torch.cuda.synchronize()  # the GPU work the calls queued, out of the next call's way
        works = []
        for name in SEND_CALLS:
            out[name] = time_call(lambda name=name: works.append(pg.send([sends[name]], 1, 0)), reps, cold=condition == "cold")
        done = works[-1]
        done.wait()
        torch.cuda.synchronize()
        out["is_completed"] = time_call(done.is_completed, reps)
    bench.sync_start(rank)
    return out


def _facts() -> dict:
    """The host and process facts that bear on per-call host time."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""

    cpuinfo = read("/proc/cpuinfo").splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    mhz = [float(ln.split(":", 1)[1]) for ln in cpuinfo if ln.startswith("cpu MHz")]
    t0 = time.perf_counter()
    for _ in range(100_000):
        pass
    loop_us = (time.perf_counter() - t0) * 1e6 / 100_000
    import triton

    return {"cpu_model": model, "cpu_mhz_median": statistics.median(mhz) if mhz else None, "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "clocksource": read("/sys/devices/system/clocksource/clocksource0/current_clocksource"),
            "py_loop_iter_ns": round(loop_us * 1e3, 1), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "threads": len(os.listdir("/proc/self/task")),
            "timer_slack_ns": set_timer_slack(50_000), "loadavg": read("/proc/loadavg"),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "CUDA_", "TANDEM_KV"))}}


def _diag_rank(rank: int, cfg: dict) -> dict:
    device = bench.rank_device(rank, "cuda")
    shape = bench.Shape()
    n = -(-cfg["tokens"] // shape.block_size)
    cache = shape.cache(2 * n, device)
    msg_bytes = n * shape.bytes_per_block
    sends = {"nccl_send_1B": torch.ones(1, dtype=torch.uint8, device=device),
             "nccl_send_msg": torch.empty(msg_bytes, dtype=torch.uint8, device=device)}
    ids = list(range(0, 2 * n, 2))
    calls = _calls(device, cache, ids, msg_bytes) if rank == 0 else {}
    results = {c: _condition(rank, c, calls, sends, cfg["reps"]) for c in cfg["conditions"]}
    return {"facts": _facts(), "results": results} if rank == 0 else {}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="the message's prompt length (Llama-3.1-8B KV shapes)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--conditions", default=",".join(CONDITIONS))
    p.add_argument("--out", default="bench_results/kv_host_calls.json")
    args = p.parse_args(argv)
    cfg = {"tokens": args.tokens, "reps": args.reps, "conditions": [c for c in args.conditions.split(",") if c]}
    unknown = set(cfg["conditions"]) - set(CONDITIONS)
    if unknown:
        raise SystemExit(f"unknown conditions {sorted(unknown)}; known: {CONDITIONS}")
    report = bench.run_pair(_diag_rank, cfg, "cuda", timeout_s=600.0)[0]
    report.update(cfg=cfg, devices=[torch.cuda.get_device_name(i) for i in range(2)], host=platform.node())
    print(json.dumps(report["facts"], indent=1))
    names = list(next(iter(report["results"].values())))
    print(f"{'call':>18} " + " ".join(f"{c + ' wall/cpu us':>24}" for c in cfg["conditions"]))
    for name in names:
        cells = [report["results"][c][name] for c in cfg["conditions"]]
        print(f"{name:>18} " + " ".join(f"{r['wall_us']:>10.1f} (p90 {r['wall_p90_us']:>7.1f}) {r['cpu_us']:>6.1f}"
                                        for r in cells))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
