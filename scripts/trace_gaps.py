"""What one profiled step's chrome trace says about where its time went: the span, how long the GPU was
busy (the union of kernel, copy and memset intervals), the gaps where it waited for the host, the share
of communication, and the host's largest Python functions and ops by self time.

    TANDEM_PROFILE_TRACE_DIR=/tmp/tr python scripts/bench_offline.py ... --profile-steps 40
    python scripts/trace_gaps.py /tmp/tr/rank0-mixed-step100-444tok.json.gz [more traces...]

A step whose GPU is busy for a small part of its span is bound by the host (on 2 H200s, 2026-11-26,
mixed steps before piecewise CUDA graphs: 12 of 88 ms). Traces come from workers/rank_profile.py.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter, defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gpu_busy(kernels: list[dict]) -> tuple[float, list[tuple[float, float, str]]]:
    """(busy microseconds, gaps as (length, start, next kernel's name)) over kernels sorted by start."""
    busy, end, gaps = 0.0, None, []
    for e in kernels:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, end, e["name"]))
            busy += stop - start
            end = stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy, gaps


def host_self_times(events: list[dict]) -> Counter:
    """Self time (microseconds) per host event name, nesting resolved per thread."""
    by_thread: dict = defaultdict(list)
    for e in events:
        by_thread[e.get("tid")].append(e)
    self_t: Counter = Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_t[stack[-1]["name"]] -= e["dur"]
            self_t[e["name"]] += e["dur"]
            stack.append(e)
    return self_t


def analyze(path: str, top: int = 8) -> dict:
    events = [e for e in load(path) if e.get("ph") == "X" and "ts" in e and "dur" in e]
    # Events at time zero with no duration were recorded but never timed: every device event of the CUDA-graph decode
    # steps traced on 2 x H200 ranks (torch 2.11, 2026-11-30; the rank logged kineto's "External init callback must
    # run in same thread as registerClient"), which made the span absurd and the GPU look idle. Counted, left out.
    untimed = [e for e in events if e["ts"] == 0 and e["dur"] == 0]
    timed = [e for e in events if not (e["ts"] == 0 and e["dur"] == 0)]
    if not timed:
        raise ValueError(f"{path}: no timed events")
    t0 = min(e["ts"] for e in timed)
    span = max(e["ts"] + e["dur"] for e in timed) - t0
    kernels = sorted((e for e in timed if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    busy, gaps = gpu_busy(kernels)
    comm = sum(e["dur"] for e in kernels if "nccl" in e["name"].lower() or "all_reduce" in e["name"].lower())
    host = host_self_times([e for e in timed if e.get("cat") in HOST_CATS])
    host.pop("ray/_private/worker.py(1069): main_loop", None)  # an actor's idle main thread, not this step's work
    # Where no device events are found, the categories present and where each begins say what the trace holds.
    starts: dict = {}
    for e in timed:
        c = starts.setdefault(e.get("cat", "?"), [0, e["ts"]])
        c[0], c[1] = c[0] + 1, min(c[1], e["ts"])
    categories = {cat: {"events": n, "first_at_ms": (ts - t0) / 1e3} for cat, (n, ts) in sorted(starts.items())}
    return {"trace": path, "span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "comm_ms": comm / 1e3,
            "categories": categories,
            "untimed": dict(Counter(e.get("cat", "?") for e in untimed)),
            "gaps_over_50us_ms": sum(g for g, _, _ in gaps if g > 50) / 1e3,
            "largest_gaps": [{"ms": g / 1e3, "at_ms": (at - t0) / 1e3, "before": name[:60]}
                             for g, at, name in sorted(gaps, reverse=True)[:top]],
            "host_self_ms": {name[:90]: t / 1e3 for name, t in host.most_common(top)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    results = [analyze(t, args.top) for t in args.traces]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(f"{r['trace']}: span {r['span_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms "
              f"(communication {r['comm_ms']:.1f}), gaps over 50 us {r['gaps_over_50us_ms']:.1f} ms")
        if r["untimed"]:
            print("    untimed (at time zero, no duration; left out): " + ", ".join(
                f"{c} {n}" for c, n in sorted(r["untimed"].items())))
        if not r["gpu_busy_ms"]:
            print("    no device events; categories: " + ", ".join(
                f"{c} {v['events']} (from {v['first_at_ms']:.1f} ms)" for c, v in r["categories"].items()))
        for g in r["largest_gaps"][:3]:
            print(f"    gap {g['ms']:.2f} ms at {g['at_ms']:.1f} ms, before {g['before']}")
        for name, ms in r["host_self_ms"].items():
            print(f"    host {ms:8.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
