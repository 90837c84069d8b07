#!/usr/bin/env python3
"""Where a KV handoff's host time goes: `KVTransferAgent.send` / `recv` under cProfile on both ranks.

A short handoff (1K tokens of Llama-3.1-8B: 128 MiB, ~0.45 ms over NVLink) is bound by what the two threads do
before the NCCL kernels can start: build the block index, launch the gather, post the message, then queue the
scatter. bench_kv_transfer.py times the whole; this script runs the same pair (its `run_pair`, same cache and
block lists) `--iters` times under cProfile, with a barrier and a synchronise around each transfer as there, and
prints each rank's functions by own time and by cumulative time, plus the median wall time per transfer.

    python scripts/profile_kv_transfer.py --tokens 1024 --iters 200 --out bench_results/kv_profile.txt
    python scripts/profile_kv_transfer.py --device cpu --tokens 64 --layers 2 --iters 5   # gloo, a check
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_kv_transfer import Shape, block_ids, connect_agents, rank_device, run_pair, sync_start, synchronize  # noqa: E402
from workers.kv_transfer.plan import RankShard, plan_transfers  # noqa: E402


def _profile_rank(rank: int, cfg: dict) -> dict:
    shape = Shape(**cfg["shape"])
    device = rank_device(rank, cfg["device"])
    cache_blocks = 2 * -(-cfg["tokens"] // shape.block_size)
    cache = shape.cache(cache_blocks, device)
    shard = RankShard(0, range(shape.layers), range(shape.kv_heads))
    agent, spec = connect_agents(rank, cache, shard)
    src, dst = block_ids(cfg["tokens"], shape, cache_blocks, 0)
    plan = plan_transfers([shard], [shard], range(len(src)))
    if rank == 0:
        move = lambda i: agent.send(spec, plan, {0: shard}, src, f"p{i}")
    else:
        move = lambda i: agent.recv(spec, plan, {0: shard}, dst, src)
    for i in range(cfg["warmup"]):
        sync_start(rank)
        move(-1 - i)
        synchronize()
    prof, walls = cProfile.Profile(), []
    for i in range(cfg["iters"]):
        sync_start(rank)
        t0 = time.perf_counter()
        prof.enable()
        move(i)
        synchronize()
        prof.disable()
        walls.append(time.perf_counter() - t0)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(cfg["top"])
    stats.sort_stats("cumulative").print_stats(cfg["top"])
    return {"median_ms": statistics.median(walls) * 1e3, "stats": text.getvalue()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=30, help="functions listed per sort")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default="", help="also write the report here")
    args = p.parse_args(argv)
    cfg = {"shape": asdict(Shape(layers=args.layers)), "tokens": args.tokens, "iters": args.iters,
           "warmup": args.warmup, "top": args.top, "device": args.device}
    ranks = run_pair(_profile_rank, cfg, args.device)
    report = "".join(f"=== rank {r} ({'send' if r == 0 else 'recv'}): median {v['median_ms']:.3f} ms per transfer, "
                     f"{args.iters} transfers of {args.tokens} tokens under cProfile\n{v['stats']}\n"
                     for r, v in enumerate(ranks))
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
