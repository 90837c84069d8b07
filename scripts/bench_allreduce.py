"""All-reduce time and bus bandwidth per message size: NCCL on GPUs (gloo on CPU) and the one-shot
and two-shot all-reduces over NVLink P2P (parallel/p2p_allreduce.py), eager and in a graph, each result checked.

TP decode runs 2 all-reduces per layer on [batch, hidden] messages (8 KB at batch 1 on Llama-3.1-8B), a
prefill chunk of T tokens T x 8 KB: the table says which method wins at which size (the P2P thresholds).

    python scripts/bench_allreduce.py --world-size 2 --device cuda      # 8 KB ... 16 MB, bf16, nccl and p2p
    python scripts/bench_allreduce.py --world-size 2 --device cuda --methods nccl,oneshot,twoshot --sizes 8K,1M,8M,64M
    python scripts/bench_allreduce.py --world-size 2 --device cuda --visible one   # each rank sees one GPU (Ray)
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


def _nccl(x: torch.Tensor) -> None:
    dist.all_reduce(x)


def _time_eager(x: torch.Tensor, iters: int, reduce=_nccl) -> float:
    """Mean seconds per all-reduce over `iters` back-to-back calls."""
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        reduce(x)
    return (time.perf_counter() - t0) / iters


def _time_graph(x: torch.Tensor, iters: int, reduce=_nccl) -> float:
    """Mean seconds per all-reduce replayed from one CUDA graph holding `iters` of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        reduce(x)  # warm the communicator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _check(x: torch.Tensor, reduce, rank: int, world: int) -> bool:
    """One reduction of distinct values per rank against their exact sum (small integers: exact in bf16)."""
    x.copy_(torch.arange(x.numel(), device=x.device).remainder(7).to(x.dtype) + rank)
    want = torch.arange(x.numel(), device=x.device).remainder(7).to(torch.float32) * world + world * (world - 1) / 2
    reduce(x)
    return bool(torch.equal(x.float(), want))


def _methods(args, rank: int, world: int, cuda: bool) -> dict:
    methods = {"nccl": _nccl}
    if cuda and any(m in args.methods for m in ("p2p", "oneshot", "twoshot", "pushed")):
        from parallel.p2p_allreduce import P2PAllReduce, enable_p2p_all_reduce
        from parallel.state import Group

        group = Group(ranks=list(range(world)), rank=rank, device_group=dist.group.WORLD,
                      cpu_group=dist.new_group(list(range(world)), backend="gloo"))
        device, dtype = torch.device("cuda", torch.cuda.current_device()), getattr(torch, args.dtype)
        if enable_p2p_all_reduce(group, device, dtype):
            p2p = group.fast_all_reduce
            methods["p2p"] = lambda x: p2p(x) or dist.all_reduce(x)  # above its limit: NCCL, as in the engine
            methods["p2p_limit_bytes"] = {"one_shot": p2p.one_shot_max, "two_shot": p2p.two_shot_max}
            # each kernel alone at every size, to place the engine's limits
            largest = max(args.sizes)
            for name, limits in (("oneshot", (largest, 0)), ("twoshot", (0, largest))):
                if name in args.methods:
                    forced = P2PAllReduce(group, device, dtype, *limits)
                    methods[name] = lambda x, forced=forced: forced(x) or dist.all_reduce(x)
            if "pushed" in args.methods:  # the pushed kernel (TANDEM_P2P_PUSHED) at every size up to its slots
                from parallel.p2p_allreduce import PUSHED_ENV, enable_pushed_all_reduce

                os.environ[PUSHED_ENV] = "from:0"
                alone = Group(ranks=group.ranks, rank=rank, device_group=group.device_group, cpu_group=group.cpu_group,
                              fast_all_reduce=P2PAllReduce(group, device, dtype))
                if enable_pushed_all_reduce(alone, device, dtype, max(args.sizes) // dtype.itemsize):
                    pushed = alone.fast_all_reduce.pushed
                    methods["pushed"] = lambda x: pushed(x) or dist.all_reduce(x)
        else:
            methods["p2p_error"] = "unavailable (see the log)"
    return {k: v for k, v in methods.items() if k in args.methods or not callable(v)}


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = args.device == "cuda"
    if cuda:
        if args.visible == "one":  # as Ray places ranks: each process sees its own GPU only
            os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        torch.cuda.set_device(0 if args.visible == "one" else rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    rows, info = [], {}
    try:
        methods = _methods(args, rank, world, cuda)
        info = {k: v for k, v in methods.items() if not callable(v)}
        for size in args.sizes:
            x = torch.ones(max(8, size // dtype.itemsize), dtype=dtype, device="cuda" if cuda else "cpu")
            for name, reduce in methods.items():
                if not callable(reduce):
                    continue
                correct = _check(x, reduce, rank, world)
                for _ in range(3):
                    reduce(x)
                eager = _time_eager(x, args.iters, reduce)
                graph = _time_graph(x, args.iters, reduce) if cuda else None
                correct = correct and _check(x, reduce, rank, world)
                bus = 2 * (world - 1) / world * x.numel() * x.element_size()
                rows.append({"method": name, "bytes": x.numel() * x.element_size(), "correct": correct,
                             "eager_us": eager * 1e6, "graph_us": graph and graph * 1e6,
                             "eager_bus_gbps": bus / eager / 1e9, "graph_bus_gbps": graph and bus / graph / 1e9})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"rows": rows, "info": info}))


def spawn_ranks(rank_fn, args: argparse.Namespace, out: Path):
    """Run rank_fn(rank, world, port, args, raw_path) on args.world_size spawned processes and return what rank 0
    wrote to raw_path (JSON, next to `out`, removed after); refused where CUDA has fewer GPUs than ranks."""
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; {torch.cuda.device_count()} visible")
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".rank0.json")
    # spawn, not fork: a caller that has touched CUDA (pytest's skip checks count devices) cannot fork CUDA users.
    mp.start_processes(rank_fn, args=(args.world_size, free_port(), args, str(raw)), nprocs=args.world_size,
                       join=True, start_method="spawn")
    result = json.loads(raw.read_text())
    raw.unlink()
    return result


def table(rows: list[dict]) -> str:
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    lines = [f"{'method':>6} {'bytes':>10} {'eager us':>9} {'graph us':>9} {'eager GB/s':>11} {'graph GB/s':>11} correct"]
    for r in rows:
        lines.append(f"{r['method']:>6} {r['bytes']:10d} {r['eager_us']:9.1f} {fmt(r['graph_us'], '9.1f')} "
                     f"{r['eager_bus_gbps']:11.1f} {fmt(r['graph_bus_gbps'], '11.1f')} {r['correct']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sizes", default="8K,32K,128K,512K,2M,8M,16M", help="message sizes in bytes (K, M suffixes)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--methods", default="nccl,p2p", help="nccl (gloo on CPU), p2p (CUDA: parallel/p2p_allreduce.py as the "
                   "engine uses it), oneshot / twoshot / pushed (CUDA: that P2P kernel alone at every size; pushed: "
                   "parallel/kernels/pushed_reduce.py, TANDEM_P2P_PUSHED)")
    p.add_argument("--visible", default="all", choices=["all", "one"],
                   help="CUDA: every rank sees all GPUs, or only its own (how Ray starts rank actors)")
    p.add_argument("--out", default="bench_results/bench_allreduce.json")
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    out = Path(args.out)
    result = spawn_ranks(_rank, args, out)
    rows = result["rows"]
    meta = {"world_size": args.world_size, "device": args.device, "dtype": args.dtype, "iters": args.iters,
            "visible": args.visible, **result["info"],
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "date": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
