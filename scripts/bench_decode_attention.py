#!/usr/bin/env python3
"""Decode attention (parallel/kernels/paged_attention.py) as a batch-1 decode graph runs it: `--layers` calls chained
in one CUDA graph (programmatic dependent launch between them, as in the decode step), Llama-3.1-8B heads (32 query,
8 KV, D = 128), for each context length and each split count: "auto" is the count the graph is captured with
(`num_decode_splits` at --max-seq-len); fewer splits give each more 64-token tiles in a row and the merge fewer
partials. A short context fills only the first splits either way (the others write nothing, the merge skips them).

    python scripts/bench_decode_attention.py --contexts 128,256,1024,4096 --splits auto,16,8,4
Prints microseconds per layer; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.kernels.paged_attention import decode_attention, num_decode_splits  # noqa: E402


def time_chain(context: int, splits: int, a) -> float:
    hq, hkv, d, page = 32, 8, 128, 16
    blocks = -(-a.max_seq_len // page)
    cache = torch.randn(2, a.layers * blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    tables = [torch.randperm(blocks, device="cuda", dtype=torch.int32)[None] + i * blocks for i in range(a.layers)]
    seq_lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    def chain():
        x = q
        for table in tables:  # each layer's query is the one before's output: a dependent chain
            x = decode_attention(x, cache, table, seq_lens, d ** -0.5, a.max_seq_len, num_splits=splits)
        return x

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / a.iters / a.layers * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="128,256,1024,4096")
    p.add_argument("--splits", default="auto,16,8,4", help="split counts; auto: num_decode_splits at --max-seq-len")
    p.add_argument("--max-seq-len", type=int, default=4096, help="the context the graph was captured for")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="bench_results/bench_decode_attention.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention needs a CUDA GPU")
    rows = []
    for context in [int(c) for c in a.contexts.split(",")]:
        line = {"context": context}
        for name in a.splits.split(","):
            splits = num_decode_splits(1, 8, a.max_seq_len) if name == "auto" else int(name)
            line[f"splits={name}"] = time_chain(context, splits, a)
        rows.append(line)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in line.items()}))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "max_seq_len": a.max_seq_len, "us_per_layer": rows}, f, indent=1)


if __name__ == "__main__":
    main()
