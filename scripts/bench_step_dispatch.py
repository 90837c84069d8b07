#!/usr/bin/env python3
"""What a multi-rank step pays to reach its Ray rank actors, on any machine (no GPU needed).

1. Ray alone: a step's SchedulerOutput-sized payload to N idle actors and back, through `ray.put`
   (one object-store copy every rank reads) and passed by value (Ray inlines small arguments in the
   task), side by side.
2. The engine: median decode-step time of `LLM(tensor_parallel_size=N)` on the CPU over gloo with a
   tiny model, where the model's own compute is small and the dispatch shows.

    python scripts/bench_step_dispatch.py                # N = 2
Prints a table; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ray_round_trips(ranks: int, iters: int) -> dict:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=16)
    class Rank:
        def execute(self, out):
            return None

    actors = [Rank.remote() for _ in range(ranks)]
    payload = {"seqs": [list(range(40)) for _ in range(64)]}  # ~5 KB pickled, like a 64-sequence decode step

    def collect(refs):  # the executor's fail-fast wait: one result at a time
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=30)
            ray.get(ready)

    def through_store():
        ref = ray.put(payload)
        collect([a.execute.remote(ref) for a in actors])

    variants = {
        "ray.put then refs": through_store,
        "by value (inlined)": lambda: collect([a.execute.remote(payload) for a in actors]),
    }
    out = {"payload_bytes": len(pickle.dumps(payload))}
    for name, fn in variants.items():
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - t0) / iters * 1e3
    for a in actors:
        ray.kill(a)
    return out


def engine_decode_step(ranks: int, tokens: int) -> float:
    from tests.models import tiny_model
    from tandem import LLM, SamplingParams

    llm = LLM(tiny_model("llama", num_hidden_layers=2), tensor_parallel_size=ranks, max_model_len=256, num_gpu_blocks_override=64,
              block_size=16, show_progress=False)
    try:
        eng = llm.llm_engine
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        eng.add_request("bench", [5, 6, 7, 8], SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
        eng.step()  # prefill
        steps = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        return 1e3 * statistics.median(steps)
    finally:
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--out", default="bench_results/bench_step_dispatch.json")
    a = p.parse_args()
    import ray

    ray.init(num_cpus=max(a.ranks, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        trips = ray_round_trips(a.ranks, a.iters)
        step_ms = engine_decode_step(a.ranks, a.tokens)
    finally:
        ray.shutdown()
    report = {"benchmark": "step_dispatch", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "ranks": a.ranks, "ray_round_trip_ms": trips, "engine_decode_step_ms": step_ms}
    print(f"{a.ranks} rank actors, payload {trips['payload_bytes']} bytes pickled, {os.cpu_count()} CPUs")
    for name in ("ray.put then refs", "by value (inlined)"):
        print(f"  Ray round trip, {name:20s} {trips[name]:6.2f} ms")
    print(f"  engine decode step, TP={a.ranks} on CPU (tiny Llama): {step_ms:.2f} ms (median)")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
