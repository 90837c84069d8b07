#!/usr/bin/env python3
"""Decode attention (parallel/kernels/paged_attention.py) as a batch-1 decode graph runs it: `--layers` calls chained
in one CUDA graph (programmatic dependent launch between them, as in the decode step), Llama-3.1-8B heads (32 query,
8 KV, D = 128), for each context length and each split count: "auto" is the count the graph is captured with
(`num_decode_splits` at --max-seq-len); fewer splits give each more 64-token tiles in a row and the merge fewer
partials. A short context fills only the first splits either way (the others write nothing, the merge skips them).

    python scripts/bench_decode_attention.py --contexts 128,256,1024,4096 --splits auto,16,8,4
    python scripts/bench_decode_attention.py --batch 64,256 --tp 1,2 --contexts 512 --splits auto,1,2,4 --layers 8
        # a batched decode step: contexts spread over [c/2, 3c/2), one TP rank's heads (32/tp query, 8/tp KV)
    python scripts/bench_decode_attention.py --batch 250 --contexts 512 --splits auto --tiles 64/4/3,128/8/2 --layers 8
        # the split kernel's tile (BLOCK_N keys a step / warps / stages) beside the default 64/4/2
Prints microseconds per layer; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.kernels.paged_attention import decode_attention, num_decode_splits  # noqa: E402


def parse_tiles(spec: str) -> list[tuple[int, int, int]]:
    """"64/4/3,128/8/2" -> [(64, 4, 3), (128, 8, 2)]: BLOCK_N (a power of two, at least 16), warps, stages."""
    tiles = []
    for item in filter(None, spec.split(",")):
        try:
            n, w, st = (int(v) for v in item.split("/"))
        except ValueError:
            sys.exit(f"--tiles {item!r}: expected BLOCK_N/warps/stages, e.g. 64/4/3")
        if n < 16 or n & (n - 1) or w not in (1, 2, 4, 8, 16) or st < 1:
            sys.exit(f"--tiles {item!r}: BLOCK_N a power of two >= 16, warps 1-16 (a power of two), stages >= 1")
        tiles.append((n, w, st))
    return tiles


def seq_lens_for(context: int, batch: int) -> list[int]:
    """One sequence: `context`; a batch: contexts spread evenly over [context / 2, 3 * context / 2), shuffled."""
    if batch == 1:
        return [context]
    lens = [max(1, context // 2 + (i * context) // batch) for i in range(batch)]
    random.Random(0).shuffle(lens)
    return lens


def time_chain(context: int, splits: int, a, batch: int = 1, tp: int = 1,
               tile: tuple[int, int, int] | None = None) -> float:
    hq, hkv, d, page = 32 // tp, 8 // tp, 128, 16
    lens = seq_lens_for(context, batch)
    blocks = -(-max(a.max_seq_len, max(lens)) // page)  # a sequence's block-table width
    # Batch 1: each layer its own blocks. A batch: one pool (batch x blocks) that every layer reads in its own order:
    # a layer's reads are far larger than L2 either way, and 32 layers' own caches would not fit in memory.
    pool = blocks * (a.layers if batch == 1 else batch)
    cache = torch.randn(2, pool, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    if batch == 1:
        tables = [torch.randperm(blocks, device="cuda", dtype=torch.int32)[None] + i * blocks for i in range(a.layers)]
    else:
        tables = [torch.randperm(pool, device="cuda", dtype=torch.int32).view(batch, blocks) for _ in range(a.layers)]
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    def chain():
        x = q
        for table in tables:  # each layer's query is the one before's output: a dependent chain
            x = decode_attention(x, cache, table, seq_lens, d ** -0.5, a.max_seq_len, num_splits=splits, tile=tile)
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
    p.add_argument("--batch", default="1", help="sequences a step (comma list); above 1 their contexts spread around each --contexts value")
    p.add_argument("--tiles", default="", help="split-kernel tiles timed beside the default, BLOCK_N/warps/stages "
                   "(comma list, e.g. 64/4/3,128/8/2; the default is 64/4/2)")
    p.add_argument("--tp", default="1", help="TP sizes (comma list): one rank's heads, 32/tp query and 8/tp KV")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="bench_results/bench_decode_attention.json")
    a = p.parse_args()
    if any(8 % int(t) for t in a.tp.split(",")):
        sys.exit(f"--tp {a.tp}: each size must divide the 8 KV heads")
    tiles = parse_tiles(a.tiles)
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention needs a CUDA GPU")
    rows = []
    for batch, tp, context in itertools.product([int(b) for b in a.batch.split(",")], [int(t) for t in a.tp.split(",")],
                                                [int(c) for c in a.contexts.split(",")]):
        line = {"batch": batch, "tp": tp, "context": context}
        max_len = max(a.max_seq_len, max(seq_lens_for(context, batch)))
        for name in a.splits.split(","):
            splits = num_decode_splits(batch, 8 // tp, max_len) if name == "auto" else int(name)
            line[f"splits={name}"] = time_chain(context, splits, a, batch, tp)
            if name == "auto":
                line["auto_splits"] = splits
            for tile in tiles:
                line[f"splits={name},tile={'/'.join(map(str, tile))}"] = time_chain(context, splits, a, batch, tp, tile)
        rows.append(line)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in line.items()}))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "max_seq_len": a.max_seq_len, "us_per_layer": rows}, f, indent=1)


if __name__ == "__main__":
    main()
