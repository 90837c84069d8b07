#!/usr/bin/env python3
"""Top-k/top-p sampling step: the partial-selection path (workers/sampler.py `_top_k_top_p`) vs
the full-vocabulary sort (`_top_k_top_p_sorted`), and the whole sampler call, on one device.

    python scripts/bench_sampler.py --device cuda                 # Llama-3 vocabulary, 1..256 rows
    python scripts/bench_sampler.py --device cpu --batch-sizes 1,16
Logits are N(0, scale^2) per row (peaked like an LLM's); every row asks for top_p=0.95 (plus top_k=50
on odd rows). Prints a table; writes JSON (--out).
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

from workers import sampler as S  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.scheduler_output import ScheduledSeq  # noqa: E402


def _time(fn, device: str, iters: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--scale", type=float, default=6.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="bench_results/bench_sampler.json")
    a = p.parse_args()
    dev = a.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    report = {"benchmark": "sampler", "device": name, "date": time.strftime("%Y-%m-%d"), "vocab": a.vocab, "results": []}
    print(f"{name}: milliseconds per call, vocab {a.vocab}")
    print(f"{'rows':>5} {'sorted cut':>11} {'partial cut':>12} {'speed-up':>9} {'sampler call':>13}")
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        torch.manual_seed(b)
        logits = torch.randn(b, a.vocab, device=dev) * a.scale
        params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50 if i % 2 else 0, seed=i) for i in range(b)]
        seqs = [ScheduledSeq(seq_id=str(i), token_ids=[0], start_pos=0, block_table=[], sample=True,
                             sampling_params=q, num_output_tokens=0) for i, q in enumerate(params)]
        sampler = S.Sampler([2], seed=0)
        t_sorted = _time(lambda: S._top_k_top_p_sorted(logits.clone(), params), dev, a.iters)
        t_partial = _time(lambda: S._top_k_top_p(logits.clone(), params), dev, a.iters)
        t_call = _time(lambda: sampler(logits, seqs), dev, a.iters)
        row = dict(rows=b, sorted_ms=t_sorted * 1e3, partial_ms=t_partial * 1e3, sampler_call_ms=t_call * 1e3)
        report["results"].append(row)
        print(f"{b:>5} {row['sorted_ms']:>11.3f} {row['partial_ms']:>12.3f} {t_sorted / t_partial:>8.1f}x {row['sampler_call_ms']:>13.3f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
