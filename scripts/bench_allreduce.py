"""All-reduce time and bus bandwidth per message size, NCCL on GPUs (gloo on CPU), eager and in a graph.

The baseline that a small-message all-reduce (one-shot / two-shot over NVLink P2P) must beat: TP decode
runs 2 per layer on [batch, hidden] messages (8 KB at batch 1 on Llama-3.1-8B).

    python scripts/bench_allreduce.py --world-size 2 --device cuda      # 8 KB ... 16 MB, bf16
    python scripts/bench_allreduce.py --world-size 2 --device cpu --sizes 8K,64K --iters 5   # a check

One process per rank (forked here, before CUDA is touched, so `tandem bench allreduce` works too). On CUDA each size is timed eagerly (CUDA events around `iters`
back-to-back calls) and replayed from a CUDA graph (as decode steps run it), since the graph removes
the launch cost that dominates small messages. Prints a table, writes JSON: per size the mean time of
one all-reduce and the bus bandwidth 2 (n-1)/n x bytes / time (NCCL's convention).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parallel.net import free_port  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def _time_eager(x: torch.Tensor, iters: int) -> float:
    """Mean seconds per all-reduce over `iters` back-to-back calls."""
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / iters


def _time_graph(x: torch.Tensor, iters: int) -> float:
    """Mean seconds per all-reduce replayed from one CUDA graph holding `iters` of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dist.all_reduce(x)  # warm the communicator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            dist.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    rows = []
    try:
        for size in args.sizes:
            x = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device="cuda" if cuda else "cpu")
            for _ in range(3):
                dist.all_reduce(x)
            eager = _time_eager(x, args.iters)
            graph = _time_graph(x, args.iters) if cuda else None
            bus = 2 * (world - 1) / world * x.numel() * x.element_size()
            rows.append({"bytes": x.numel() * x.element_size(), "eager_us": eager * 1e6, "graph_us": graph and graph * 1e6,
                         "eager_bus_gbps": bus / eager / 1e9, "graph_bus_gbps": graph and bus / graph / 1e9})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def table(rows: list[dict]) -> str:
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    lines = [f"{'bytes':>10} {'eager us':>9} {'graph us':>9} {'eager GB/s':>11} {'graph GB/s':>11}"]
    for r in rows:
        lines.append(f"{r['bytes']:10d} {r['eager_us']:9.1f} {fmt(r['graph_us'], '9.1f')} {r['eager_bus_gbps']:11.1f} "
                     f"{fmt(r['graph_bus_gbps'], '11.1f')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sizes", default="8K,32K,128K,512K,2M,8M,16M", help="message sizes in bytes (K, M suffixes)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="bench_results/bench_allreduce.json")
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; {torch.cuda.device_count()} visible")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".rank0.json")
    mp.start_processes(_rank, args=(args.world_size, free_port(), args, str(raw)), nprocs=args.world_size, join=True,
                       start_method="fork")
    rows = json.loads(raw.read_text())
    raw.unlink()
    meta = {"world_size": args.world_size, "device": args.device, "dtype": args.dtype, "iters": args.iters,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "date": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
