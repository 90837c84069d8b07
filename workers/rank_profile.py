"""Where one rank's steps spend their time, per step kind: idle (waiting for the next step), host
dispatch (rebuilding the step from its message), execute (host wall time of `ModelRunner.execute`; for
eager steps split into input building, forward launches and sampling with the wait for the device,
`ms_host_phases`), and, for every N-th step under torch.profiler, GPU kernel time and communication time.

Communication is what the collectives take: NCCL's and the P2P all-reduce's kernels on GPUs, gloo's own
events on the CPU (waiting for the peer included, so a rank that arrives early shows it as communication).
Kinds: `decode-graph` (a CUDA-graph replay), `decode` (one token per sequence, eager), `mixed`
(prefill chunks). Every rank keeps its own profile; `Executor.profile` collects them.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import time
from collections import defaultdict
from typing import Callable, TypeVar

import torch
from torch.autograd import DeviceType

from workers.gc_freeze import GcPauses
from workers.scheduler_output import SchedulerOutput

T = TypeVar("T")
log = logging.getLogger(__name__)


def step_kind(out: SchedulerOutput, cuda_graphs) -> str:
    if cuda_graphs is not None and cuda_graphs.can_run(out):
        return "decode-graph"
    return "decode" if all(s.num_tokens == 1 for s in out.seqs) else "mixed"


TOP = 8  # kernels (GPU) or ops (CPU) named per step kind: what a slow step spends its time on
MAX_UNREAD = 16  # sampled steps' profilers kept unread (`RankProfile.step`) before they are read in one go
TRACES_PER_KIND = 2  # chrome traces written per rank and step kind where TANDEM_PROFILE_TRACE_DIR is set


def _is_kernel(e) -> bool:
    """A GPU-side event of its own (kernel, memcpy, memset), not a CPU op that launched one nor a
    GPU-timeline annotation (record_param_comms, nccl:all_reduce): summing those counts a kernel twice."""
    return e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def _is_comm(name: str) -> bool:
    """NCCL's kernels and the P2P all-reduce's (parallel/p2p_allreduce.py: one_shot_all_reduce_kernel)."""
    name = name.lower()
    return "nccl" in name or "all_reduce" in name


def _top(events, attr: str) -> dict[str, float]:
    """The TOP of averaged events (one per key) by `attr` (microseconds), as {name: seconds}."""
    return _ranked({e.key: getattr(e, attr) for e in events})


def _top_host_ops(prof) -> dict[str, float]:
    """The TOP host ops by self CPU time, as {name: seconds}. Python frames are left out: a step that writes a
    trace records them (`with_stack`, for the trace's gaps), and a frame's self time is its wait and interpreter
    time (the rank's event loop, `wait`), which would crowd the ops out of the table."""
    self_us: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if not _is_python_frame(e):
            self_us[e.key] += e.self_cpu_time_total
    return _ranked(self_us)


def _is_python_frame(event) -> bool:
    """torch 2.13 marks Python frames (`is_python_function`); 2.11, on the GPU hosts, has no such field, and its
    frames are named "file.py(line): function" or "<built-in ...>"."""
    marked = getattr(event, "is_python_function", None)
    if marked is not None:
        return bool(marked)
    return ".py(" in event.key or event.key.startswith("<built-in")


def _ranked(microseconds: dict[str, float]) -> dict[str, float]:
    ranked = sorted(microseconds.items(), key=lambda kv: kv[1], reverse=True)[:TOP]
    return {name[:80]: us / 1e6 for name, us in ranked if us > 0}


def _kernel_and_comm_seconds(events, cuda: bool) -> tuple[float, float]:
    if cuda:
        kernels = [e for e in events if _is_kernel(e)]
        total = sum(e.self_device_time_total for e in kernels) / 1e6
        comm = sum(e.self_device_time_total for e in kernels if _is_comm(e.key)) / 1e6
        return total, comm
    # gloo runs a collective on its own thread as a "gloo:<op>" event (waiting included); the c10d op only enqueues it.
    return 0.0, sum(e.cpu_time_total for e in events if e.key.startswith("gloo:")) / 1e6


class RankProfile:
    def __init__(self, rank: int, gpu_every: int = 0):
        self.rank, self.gpu_every = rank, gpu_every
        self.rows: list[dict] = []
        self.trace_dir = os.environ.get("TANDEM_PROFILE_TRACE_DIR") or None
        self.traces: dict[str, int] = defaultdict(int)  # written per step kind
        self.unread: list[dict] = []  # sampled steps' rows whose profiler `summary` has not read yet
        # This process's collector pauses since the profile started (`summary`'s "gc"): a rank's stall is its peers' wait.
        self.gc = GcPauses().install()

    def step(self, kind: str, idle_s: float, decode_s: float, run: Callable[[], T], tokens: int = 0, seqs: int = 0,
             phases: Callable[[], dict[str, float]] | None = None) -> T:
        """Run one step (`run`) and record it. phases: after the run, the step's host seconds by phase where the
        runner timed them (`ModelRunner.step_phases`: an eager step's input building, forward launches, sampling
        with the wait for the device's tokens; empty for a graph replay)."""
        row = {"kind": kind, "idle": idle_s, "decode": decode_s, "tokens": tokens, "seqs": seqs}
        # Every gpu_every-th step, from the middle of the first period: the very first step (the largest
        # prefill, allocator growth) would otherwise be in every sample.
        sampled = self.samples_next()
        t = time.perf_counter()
        # When execute began, on the host's monotonic clock (CLOCK_MONOTONIC on Linux: comparable between the
        # ranks' processes on one host): a rank that starts a step later than its peers makes them wait in the
        # step's first collective (`start_lags`).
        row["start"], row["n"] = t, len(self.rows)  # n: the step's order number since the profile started
        if sampled:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            trace = self.trace_dir is not None and self.traces[kind] < TRACES_PER_KIND
            self.traces[kind] += trace  # counted now: the traces are written later (`_read_profiler`)
            with profile(activities=activities, with_stack=trace) as prof:  # Python frames show the host's gaps
                result = run()
                if cuda:
                    torch.cuda.synchronize()
            row["sampled_wall"] = time.perf_counter() - t
            # Read at `summary`, not now: parsing a step's events takes far longer than the step (a CPU step of 36,000
            # events: 28 ms, its key_averages 1.7 s), which would land in this step's time and hold up the next (its
            # peers' too, under TP). On 2 x H200 (2026-11-29, 1 step in 40 sampled) a TP=2 rank's mean mixed step
            # ran ~5 ms past its timed phases.
            row["profiler"] = (prof, cuda, trace)
            self.unread.append(row)
        else:
            result = run()
        row["execute"] = time.perf_counter() - t
        timed = phases() if phases is not None else None
        if timed:
            row["phases"] = dict(timed)
        self._add(row)
        if len(self.unread) > MAX_UNREAD:  # a profiler holds its step's events: bound the memory (a served rank's
            self._read_unread()  # window of 500 steps at gpu_every 1), at the cost of this once in a while
        return result

    def samples_next(self, ahead: int = 0) -> bool:
        """Whether the next step (`ahead`: the one that many after it) runs under torch.profiler (`step` must run
        it, not `record`)."""
        return self.gpu_every > 0 and (len(self.rows) + ahead) % self.gpu_every == self.gpu_every // 2

    def record(self, kind: str, idle_s: float, decode_s: float, started: float, execute_s: float, tokens: int = 0,
               seqs: int = 0) -> None:
        """A step timed by its caller: launched at `started` (perf_counter) and finished `execute_s` later (a rank's
        launched decode steps, cluster/rank_worker.py; never one that `samples_next`)."""
        self._add({"kind": kind, "idle": idle_s, "decode": decode_s, "tokens": tokens, "seqs": seqs, "start": started,
                   "n": len(self.rows), "execute": execute_s})

    def _add(self, row: dict) -> None:
        self.rows.append(row)

    def _read_unread(self) -> None:
        for row in self.unread:
            self._read_profiler(row)
        self.unread = []

    def _read_profiler(self, row: dict) -> None:
        """A sampled step's kernel, communication and top-op times from its profiler (and its trace, if asked)."""
        prof, cuda, trace = row.pop("profiler")
        events = prof.key_averages()
        row["kernels"], row["comm"] = _kernel_and_comm_seconds(events, cuda)
        row["top_host"] = _top_host_ops(prof)
        if cuda:
            row["top_gpu"] = _top([e for e in events if _is_kernel(e)], "self_device_time_total")
        if trace:
            self._write_trace(prof, row["kind"], row["tokens"], row["n"])

    def _write_trace(self, prof, kind: str, tokens: int, step: int) -> None:
        """A chrome trace (chrome://tracing, ui.perfetto.dev) of this step, gzipped, into the trace dir."""
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"rank{self.rank}-{kind}-step{step}-{tokens}tok.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)

    def summary(self, starts: bool = False) -> dict[str, dict]:
        """Per step kind; `starts`: with each step's (order number, execute start) in `execute_starts`, for
        `start_lags` across ranks (left out of the logged windows, where they would only bloat the line)."""
        self._read_unread()
        by: dict[str, list[dict]] = defaultdict(list)
        for r in self.rows:
            by[r["kind"]].append(r)
        out = {}
        for kind, rows in by.items():
            n = len(rows)
            d = {"steps": n, **{f"ms_{k}": 1e3 * sum(r[k] for r in rows) / n for k in ("idle", "decode", "execute")}}
            execute = sorted(r["execute"] for r in rows)
            d["ms_execute_p50"], d["ms_execute_p90"] = 1e3 * execute[n // 2], 1e3 * execute[min(n - 1, (9 * n) // 10)]
            timed = [r["phases"] for r in rows if "phases" in r]
            if timed:  # where an eager step's host time went: input building, launches, sampling (with the wait)
                d["ms_host_phases"] = {k: round(1e3 * sum(p.get(k, 0.0) for p in timed) / len(timed), 3)
                                       for k in sorted(set().union(*timed))}
            d["mean_tokens"] = sum(r["tokens"] for r in rows) / n
            d["mean_seqs"] = sum(r["seqs"] for r in rows) / n
            sampled = [r for r in rows if "sampled_wall" in r]
            if sampled:  # over the sampled steps (run under the profiler, so slightly slowed)
                m = len(sampled)
                d["sampled_steps"] = m
                d["ms_gpu_kernels"] = 1e3 * sum(r["kernels"] for r in sampled) / m
                d["ms_comm"] = 1e3 * sum(r["comm"] for r in sampled) / m
                d["ms_sampled_wall"] = 1e3 * sum(r["sampled_wall"] for r in sampled) / m
                d["sampled_tokens"] = [r.get("tokens", 0) for r in sampled]
                for key in ("top_host", "top_gpu"):
                    if any(key in r for r in sampled):
                        d[f"ms_{key}"] = _mean_top([r.get(key, {}) for r in sampled])
            if starts:
                d["execute_starts"] = [[r["n"], r["start"]] for r in rows]
            out[kind] = d
        if self.rows:
            out["gc"] = self.gc.summary()
        return out


def start_lags(ranks: list[dict[str, dict]]) -> dict[str, dict]:
    """Per step kind, how far each rank's execute start lags the earliest rank's for the same step (steps matched
    by their order number: every rank runs every step, and a profile starts on all at once): {kind: {"ms_mean":
    [per rank], "ms_p50": [per rank], "steps": n}}, over the steps every rank recorded. From the summaries'
    `execute_starts` (`RankProfile.summary(starts=True)`); kinds without them on every rank are left out."""
    out: dict[str, dict] = {}
    kinds = set().union(*(r.keys() for r in ranks)) if ranks else set()
    for kind in sorted(kinds):
        per_rank = [dict(map(tuple, r.get(kind, {}).get("execute_starts") or [])) for r in ranks]
        if len(ranks) < 2 or not all(per_rank):
            continue
        common = sorted(set.intersection(*(set(s) for s in per_rank)))
        if not common:
            continue
        lags = [[] for _ in ranks]  # seconds behind the earliest rank, per rank
        for n in common:
            first = min(s[n] for s in per_rank)
            for lag, s in zip(lags, per_rank):
                lag.append(s[n] - first)
        out[kind] = {"steps": len(common),
                     "ms_mean": [1e3 * sum(v) / len(v) for v in lags],
                     "ms_p50": [1e3 * sorted(v)[len(v) // 2] for v in lags]}
    return out


def _mean_top(tops: list[dict[str, float]]) -> dict[str, float]:
    """Per-name milliseconds per sampled step, the TOP largest over all sampled steps."""
    total: dict[str, float] = defaultdict(float)
    for top in tops:
        for name, s in top.items():
            total[name] += s
    ranked = sorted(total.items(), key=lambda kv: kv[1], reverse=True)[:TOP]
    return {name: round(1e3 * s / len(tops), 3) for name, s in ranked}


# TANDEM_RANK_PROFILE="<gpu_every>[:<log_every>]": a served rank (a rank actor, or in the replica's process) profiles its own steps from
# the start, as `Executor.profile` would, and every log_every steps (default 500) logs the summary of those steps
# at WARNING ("rank profile {...}", one JSON line, in the Serve log) and starts a new window. gpu_every 0: host
# times only. A diagnostic of a served replica, which nothing else can ask for its profile.
RANK_PROFILE_ENV = "TANDEM_RANK_PROFILE"


class LoggedRankProfile(RankProfile):
    def __init__(self, rank: int, gpu_every: int, log_every: int):
        super().__init__(rank, gpu_every)
        self.log_every = max(1, log_every)
        self.windows = 0

    def _add(self, row: dict) -> None:
        super()._add(row)
        if len(self.rows) >= self.log_every:
            self.windows += 1
            log.warning("rank profile %s", json.dumps(
                {"rank": self.rank, "window": self.windows, "steps": len(self.rows), "by_kind": self.summary()}))
            self.rows = []


def logged_profile(rank: int, environ: dict[str, str] | None = None) -> LoggedRankProfile | None:
    """The profile TANDEM_RANK_PROFILE asks for (None when unset); a malformed value is refused by name."""
    value = (os.environ if environ is None else environ).get(RANK_PROFILE_ENV, "").strip()
    if not value:
        return None
    try:
        parts = [int(p) for p in value.split(":")]
        if len(parts) > 2 or min(parts) < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{RANK_PROFILE_ENV}={value!r}: expected '<gpu_every>' or '<gpu_every>:<log_every>', "
                         "non-negative integers") from None
    return LoggedRankProfile(rank, parts[0], parts[1] if len(parts) > 1 else 500)


class ProfiledRunner:
    """Times `execute` on a runner as a rank loop does, for the in-process executor (no message, no idle
    measured by the channel: idle is the time between two steps of this process), and the steps that executor
    launches (`launched`): every step but those sampled under torch.profiler, so a profiled one-GPU engine keeps
    its launch-ahead (before, a profile stopped it and slowed the baseline that profiled runs compared against)."""

    def __init__(self, runner, gpu_every: int, profile: RankProfile | None = None):
        self.runner, self.profile = runner, profile if profile is not None else RankProfile(0, gpu_every)
        self._last_end = time.perf_counter()

    def may_launch(self, ahead: int = 0) -> bool:
        """Whether the in-process executor may launch the next step (`ahead`: the one that many after it) instead of
        running it here: any step but one the profile samples under torch.profiler, as a rank loop does."""
        return not self.profile.samples_next(ahead)

    def launched(self, out: SchedulerOutput, launched_at: float, finish: Callable[[], T]) -> Callable[[], T]:
        """`finish` of a step launched at `launched_at` (perf_counter), recording the step once its tokens are in."""
        kind = step_kind(out, getattr(self.runner, "cuda_graphs", None))
        idle = max(0.0, launched_at - self._last_end)  # 0 for a step launched behind one still running

        def finished() -> T:
            result = finish()
            self._last_end = time.perf_counter()
            self.profile.record(kind, idle, 0.0, launched_at, self._last_end - launched_at, out.num_tokens,
                                len(out.seqs))
            return result
        return finished

    def execute(self, out: SchedulerOutput):
        idle = time.perf_counter() - self._last_end
        kind = step_kind(out, getattr(self.runner, "cuda_graphs", None))
        result = self.profile.step(kind, idle, 0.0, lambda: self.runner.execute(out), out.num_tokens, len(out.seqs),
                                   phases=lambda: getattr(self.runner, "step_phases", {}))
        self._last_end = time.perf_counter()
        return result
