#!/usr/bin/env python3
"""What a waiting thread pays to get the GIL back from a thread that computes in Python (workers/gil.py).

A thread makes 20 GIL-releasing calls (50 µs sleeps: the sends, receives and polls of one KV transfer, or a
Ray call's hops), alone and beside a thread busy in Python (an engine's step loop), at several switch
intervals; median of 15 rounds each, in ms.

    python scripts/bench_gil_switch.py [--out bench_results/gil_switch.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

INTERVALS_S = (5e-3, 1e-3, 5e-4, 1e-4)  # 5e-3 is CPython's default


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1


def releases_ms(interval_s: float, busy: bool, calls: int = 20, rounds: int = 15) -> float:
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if busy:
        worker.start()
    try:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                time.sleep(5e-5)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    finally:
        stop.set()
        if busy:
            worker.join()
        sys.setswitchinterval(before)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_results/gil_switch.json")
    a = p.parse_args()
    rows = []
    for busy in (False, True):
        for interval in INTERVALS_S:
            ms = releases_ms(interval, busy)
            rows.append({"busy_thread": busy, "switch_interval_ms": interval * 1e3, "ms_for_20_releases": ms})
            print(f"busy thread {'yes' if busy else 'no ':3}  switch interval {interval * 1e3:4.1f} ms  "
                  f"20 GIL releases {ms:7.2f} ms", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "gil_switch", "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
                               "machine": platform.processor() or platform.machine(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
