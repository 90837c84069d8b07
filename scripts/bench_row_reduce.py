"""A row-parallel linear's GEMM and all-reduce at prefill sizes under TP, by TANDEM_TP_ROW_REDUCE mode
(parallel/row_reduce.py): `staged` (the GEMM, then the all-reduce, which copies its input into the P2P buffer),
`direct` (the GEMM writes into that buffer), `overlap:N` (N chunks, each chunk's all-reduce on a side stream beside
the next chunk's GEMM); beside them the GEMM alone and the all-reduce alone, so the table shows how much of the
all-reduce each mode hides. Llama-3.1-8B's two row-parallel shapes (o: 4096 x 4096 / tp, down: 4096 x 14336 / tp).

    python scripts/bench_row_reduce.py --world-size 2 --device cuda                 # rows 776, 2048, 4096
    python scripts/bench_row_reduce.py --world-size 2 --device cpu --rows 520 --hidden 64 --iters 2   # a check

One process per rank (spawned). On CUDA each cell is a CUDA graph of `iters` calls replayed once and timed with events
(mixed steps replay piecewise graphs), after a check that the mode's output equals the staged one's within bf16
rounding. Writes JSON (per shape, rows and mode: microseconds a call).
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))
from bench_allreduce import _time_eager, _time_graph, spawn_ranks  # noqa: E402

SHAPES = {"o": (4096, 4096), "down": (4096, 14336)}  # (N outputs, K inputs) of the whole layer


def _timed(fn, iters: int, cuda: bool) -> float:
    """Microseconds per call: a CUDA graph of `iters` calls replayed once (bench_allreduce's), CPU: wall clock."""
    timer = _time_graph if cuda else _time_eager
    return timer(torch.empty(0), iters, lambda _: fn()) * 1e6


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from parallel import row_reduce
    from parallel.comm import reduce_partial_sums
    from parallel.state import Group

    group = Group(ranks=list(range(world)), rank=rank, device_group=dist.group.WORLD,
                  cpu_group=dist.new_group(list(range(world)), backend="gloo") if cuda else dist.group.WORLD)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        from parallel.p2p_allreduce import enable_p2p_all_reduce

        enable_p2p_all_reduce(group, device, dtype)
    rows_out = []
    try:
        for shape, (n, k) in SHAPES.items():
            n, k = (n, k) if cuda else (args.hidden, args.hidden * k // n)
            w = torch.randn(n, k // world, device=device, dtype=dtype) / k**0.5
            for m in args.rows:
                x = torch.randn(m, k // world, device=device, dtype=dtype)
                staged = lambda: reduce_partial_sums(torch.mm(x, w.t()), group)  # noqa: E731
                want = staged().float()
                cells = {"gemm": lambda: torch.mm(x, w.t()), "all_reduce": None, "staged": staged}
                y0 = torch.mm(x, w.t())
                cells["all_reduce"] = lambda: reduce_partial_sums(y0, group)
                for spec in args.modes:
                    mode, _, count = spec.partition(":")
                    if not row_reduce.takes(x, w, group, mode):
                        continue
                    run = lambda mode=mode, chunks=int(count or 1): row_reduce.linear_reduce(  # noqa: E731
                        x, w, group, mode, chunks)
                    got = run().float()
                    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                    if err > 2e-2:
                        raise AssertionError(f"{shape} {m} rows {spec}: relative error {err:.3g} against staged")
                    cells[spec] = run
                for name, fn in cells.items():
                    us = _timed(fn, args.iters, cuda)
                    rows_out.append({"shape": shape, "rows": m, "mode": name, "us": us})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows_out))


def table(rows: list[dict]) -> str:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    keys = list(dict.fromkeys((r["shape"], r["rows"]) for r in rows))
    by = {(r["shape"], r["rows"], r["mode"]): r["us"] for r in rows}
    lines = [f"{'shape':>6} {'rows':>6} " + " ".join(f"{m:>11}" for m in modes)]
    for shape, m in keys:
        lines.append(f"{shape:>6} {m:6d} " + " ".join(
            f"{by[shape, m, mode]:11.1f}" if (shape, m, mode) in by else f"{'-':>11}" for mode in modes))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rows", default="776,2048,4096", help="tokens of the step (at least 512: row_reduce's minimum)")
    p.add_argument("--modes", default="direct,overlap:2,overlap:4")
    p.add_argument("--hidden", type=int, default=64, help="CPU: the layer's output size (GPUs: Llama-3.1-8B's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="bench_results/bench_row_reduce.json")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out = Path(args.out)
    rows = spawn_ranks(_rank, args, out)
    meta = {"world_size": args.world_size, "device": args.device, "iters": args.iters, "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
