"""Where one rank's steps spend their time, per step kind: idle (waiting for the next step), host
dispatch (rebuilding the step from its message), execute (host wall time of `ModelRunner.execute`),
and, for every N-th step under torch.profiler, GPU kernel time and communication time.

Communication is what the collectives take: NCCL kernels on GPUs, gloo's own events on the CPU
(waiting for the peer included, so a rank that arrives early shows it as communication).
Kinds: `decode-graph` (a CUDA-graph replay), `decode` (one token per sequence, eager), `mixed`
(prefill chunks). Every rank keeps its own profile; `Executor.profile` collects them.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, TypeVar

import torch

from workers.scheduler_output import SchedulerOutput

T = TypeVar("T")


def step_kind(out: SchedulerOutput, cuda_graphs) -> str:
    if cuda_graphs is not None and cuda_graphs.can_run(out):
        return "decode-graph"
    return "decode" if all(s.num_tokens == 1 for s in out.seqs) else "mixed"


def _kernel_and_comm_seconds(prof, cuda: bool) -> tuple[float, float]:
    events = prof.key_averages()
    if cuda:
        kernels = sum(e.device_time_total for e in events) / 1e6
        comm = sum(e.device_time_total for e in events if "nccl" in e.key.lower()) / 1e6
        return kernels, comm
    # gloo runs a collective on its own thread as a "gloo:<op>" event (waiting included); the c10d op only enqueues it.
    return 0.0, sum(e.cpu_time_total for e in events if e.key.startswith("gloo:")) / 1e6


class RankProfile:
    def __init__(self, rank: int, gpu_every: int = 0):
        self.rank, self.gpu_every = rank, gpu_every
        self.rows: list[dict] = []

    def step(self, kind: str, idle_s: float, decode_s: float, run: Callable[[], T]) -> T:
        row = {"kind": kind, "idle": idle_s, "decode": decode_s}
        sampled = self.gpu_every > 0 and len(self.rows) % self.gpu_every == 0
        t = time.perf_counter()
        if sampled:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                result = run()
                if cuda:
                    torch.cuda.synchronize()
            row["kernels"], row["comm"] = _kernel_and_comm_seconds(prof, cuda)
            row["sampled_wall"] = time.perf_counter() - t
        else:
            result = run()
        row["execute"] = time.perf_counter() - t
        self.rows.append(row)
        return result

    def summary(self) -> dict[str, dict]:
        by: dict[str, list[dict]] = defaultdict(list)
        for r in self.rows:
            by[r["kind"]].append(r)
        out = {}
        for kind, rows in by.items():
            n = len(rows)
            d = {"steps": n, **{f"ms_{k}": 1e3 * sum(r[k] for r in rows) / n for k in ("idle", "decode", "execute")}}
            sampled = [r for r in rows if "sampled_wall" in r]
            if sampled:  # over the sampled steps (run under the profiler, so slightly slowed)
                m = len(sampled)
                d["sampled_steps"] = m
                d["ms_gpu_kernels"] = 1e3 * sum(r["kernels"] for r in sampled) / m
                d["ms_comm"] = 1e3 * sum(r["comm"] for r in sampled) / m
                d["ms_sampled_wall"] = 1e3 * sum(r["sampled_wall"] for r in sampled) / m
            out[kind] = d
        return out


class ProfiledRunner:
    """Times `execute` on a runner as a rank loop does, for the in-process executor (no message, no idle
    measured by the channel: idle is the time between two steps of this process)."""

    def __init__(self, runner, gpu_every: int):
        self.runner, self.profile = runner, RankProfile(0, gpu_every)
        self._last_end = time.perf_counter()

    def execute(self, out: SchedulerOutput):
        idle = time.perf_counter() - self._last_end
        kind = step_kind(out, getattr(self.runner, "cuda_graphs", None))
        result = self.profile.step(kind, idle, 0.0, lambda: self.runner.execute(out))
        self._last_end = time.perf_counter()
        return result
