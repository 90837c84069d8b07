"""Run a function on N CPU processes joined by torch.distributed (gloo), for tests of collectives.

`run_ranks(fn, world_size, *args)` spawns the ranks, initialises the default process group and the
Tandem groups for `parallel_config`, calls fn(rank, *args) on each, and re-raises the first failure.
fn must be a module-level function (it is pickled into the children).
"""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.config import ParallelConfig
from parallel.net import free_port
from parallel.state import init_groups


def _child(rank: int, world_size: int, port: int, error_dir: str, parallel: dict | None, fn, args) -> None:
    torch.set_num_threads(1)  # the ranks share a couple of cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        init_groups(ParallelConfig(**(parallel or {"sequence_parallel_size": world_size})))
        fn(rank, *args)
        dist.barrier()
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What the fork server imports before it forks any rank. It starts at the first call in a process and serves
# every later one (its preload list is never read again), so the list covers the callers of every test module,
# not only the first one's: besides torch, `engine` (any `engine.*` import loads `engine.llm` and with it
# transformers: 2+ s per rank otherwise, e.g. tests/test_kv_transfer.py's ranks) and `workers.model_runner`
# (tests/test_sp_startup_memory.py's ranks build one). fn's own module is added too, but the server (Python
# 3.11) imports it only where its name resolves from the working directory: test modules are not on its path.
PRELOAD = ("torch", "torch.distributed", "parallel.state", "engine", "workers.model_runner")


def run_ranks(fn, world_size: int, *args, parallel: dict | None = None) -> None:
    """parallel: ParallelConfig fields for the rank grid (default: one SP group of world_size ranks)."""
    # A fork server that has imported torch once forks the ranks of every later call in milliseconds,
    # where "spawn" re-imports torch in each rank (seconds on a shared 2-core machine). Forking this
    # process instead would copy its OpenMP state, which is not fork-safe.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, fn.__module__])
    with tempfile.TemporaryDirectory() as error_dir:
        try:
            mp.start_processes(_child, args=(world_size, free_port(), error_dir, parallel, fn, args),
                               nprocs=world_size, join=True, start_method="forkserver")
        except Exception as e:
            reports = [open(os.path.join(error_dir, f)).read() for f in sorted(os.listdir(error_dir))]
            raise AssertionError("\n".join(reports) or str(e)) from None
