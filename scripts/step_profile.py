"""Where an engine's steps spend their time: on the host that drives them (schedule, execute, output
processing, by wall clock) and on every rank (idle, host dispatch, execute, and for every N-th step
GPU kernel and communication time: workers/rank_profile.py), whatever the executor and world size.

    prof = StepProfile(llm.llm_engine, gpu_every=25); ...run...; print(prof.table())
Used by `scripts/bench_offline.py --profile-steps N`. Steps are grouped by kind: `decode-graph` (a
CUDA-graph replay), `decode` (one token per sequence, eager) and `mixed` (prefill chunks). Where the
executor overlaps (Ray ranks), one engine step collects one step and sends the next: its `exec` is the
time spent sending and waiting for the ranks, `sched` the next step's scheduling.

`ranks=False` times the steps at the driver only and leaves the executor as it runs unprofiled (no rank
profile, no torch.profiler). With a rank profile, the steps it samples under torch.profiler run whole on every
executor; the others are launched where the executor launches (the in-process one too, since 2026-11-30: before,
its profile stopped its launch-ahead and slowed the one-GPU baseline of every profiled comparison).
"""
from __future__ import annotations

import time
from collections import defaultdict

from workers.gc_freeze import GcPauses
from workers.rank_profile import start_lags, step_kind


class StepProfile:
    def __init__(self, engine, gpu_every: int = 0, ranks: bool = True):
        self.engine, self.gpu_every, self.with_ranks = engine, gpu_every, ranks
        self.rows: list[dict] = []
        self._cur: dict = {}
        sched, submit, step = engine.scheduler.schedule, engine.executor.submit, engine.step
        self.gc = GcPauses().install()  # the driver's collector pauses (the ranks report theirs)
        if ranks:
            engine.executor.profile("start", gpu_every)
        runner = getattr(engine.executor, "runner", None)
        kinds: list[tuple] = []  # (kind, seqs, tokens) of the steps sent and not yet collected

        def timed_schedule(*args, **kwargs):
            t = time.perf_counter()
            out = sched(*args, **kwargs)
            self._cur["schedule"] = self._cur.get("schedule", 0.0) + time.perf_counter() - t
            return out

        def timed_submit(out, **kwargs):
            # The driver cannot see remote ranks' CUDA graphs; their own profiles tell graph replays apart.
            kinds.append((step_kind(out, getattr(runner, "cuda_graphs", None)), len(out.seqs), out.num_tokens))
            t = time.perf_counter()
            pending = submit(out, **kwargs)
            self._cur["execute"] = self._cur.get("execute", 0.0) + time.perf_counter() - t
            collect = pending.result
            first = [True]  # a step sent ahead collects this one again (answered: no wait, no new row)

            def timed_result():
                if first[0] and "kind" not in self._cur and kinds:  # the step this engine.step() call collects
                    kind, seqs, tokens = kinds.pop(0)
                    self._cur.update(kind=kind, seqs=seqs, tokens=tokens)
                first[0] = False
                t = time.perf_counter()
                res = collect()
                self._cur["execute"] = self._cur.get("execute", 0.0) + time.perf_counter() - t
                return res

            pending.result = timed_result
            return pending

        def timed_step():
            self._cur = {}
            t = time.perf_counter()
            outs = step()
            if "kind" in self._cur:
                self._cur["step"] = time.perf_counter() - t
                self._cur.setdefault("schedule", 0.0)
                self.rows.append(self._cur)
            return outs

        engine.scheduler.schedule, engine.executor.submit, engine.step = timed_schedule, timed_submit, timed_step

    def summary(self) -> dict:
        by = defaultdict(list)
        for r in self.rows:
            by[r["kind"]].append(r)
        host = {}
        for kind, rs in by.items():
            n = len(rs)
            tot = sum(r["step"] for r in rs)
            # The median too: a mean over steps of very different sizes (a few 8K-token prefills among ~800-token
            # mixed steps) and over the sampled ones, which the profiler slows, says less about a typical step.
            p50 = sorted(r["step"] for r in rs)[n // 2]
            host[kind] = {"steps": n, "seconds": tot, "mean_seqs": sum(r["seqs"] for r in rs) / n,
                          "mean_tokens": sum(r["tokens"] for r in rs) / n, "ms_step": 1e3 * tot / n,
                          "ms_step_p50": 1e3 * p50,
                          "ms_schedule": 1e3 * sum(r["schedule"] for r in rs) / n,
                          "ms_execute": 1e3 * sum(r["execute"] for r in rs) / n,
                          "ms_after_execute": 1e3 * sum(r["step"] - r["schedule"] - r["execute"] for r in rs) / n}
        ranks = self.engine.executor.profile("report") if self.with_ranks else []
        gc = {"driver": self.gc.summary(), "ranks": [r.pop("gc", None) for r in ranks]}
        lags = start_lags(ranks)  # before the raw start times are dropped: only the lags go into the JSON
        for by_kind in ranks:
            for d in by_kind.values():
                d.pop("execute_starts", None)
        return {"host": host, "ranks": ranks, "start_lag": lags, "gc": gc}

    def table(self) -> str:
        summary = self.summary()
        nan = float("nan")
        lines = ["driver (ms per step)",
                 f"{'kind':13} {'steps':>6} {'sec':>7} {'seqs':>6} {'tokens':>7} {'step':>8} {'p50':>7} {'sched':>6} {'exec':>7} {'after':>6}"]
        for kind, d in sorted(summary["host"].items()):
            lines.append(f"{kind:13} {d['steps']:6d} {d['seconds']:7.2f} {d['mean_seqs']:6.1f} {d['mean_tokens']:7.1f} "
                         f"{d['ms_step']:8.2f} {d['ms_step_p50']:7.2f} {d['ms_schedule']:6.2f} {d['ms_execute']:7.2f} "
                         f"{d['ms_after_execute']:6.2f}")
        if summary["ranks"]:
            lines += ["ranks (ms per step; kernels and comm over the profiled steps)",
                      f"{'rank':>4} {'kind':13} {'steps':>6} {'idle':>7} {'dispatch':>8} {'execute':>8} {'kernels':>8} {'comm':>7}"]
        for rank, by_kind in enumerate(summary["ranks"]):
            for kind, d in sorted(by_kind.items()):
                lines.append(f"{rank:4d} {kind:13} {d['steps']:6d} {d['ms_idle']:7.3f} {d['ms_decode']:8.3f} "
                             f"{d['ms_execute']:8.3f} {d.get('ms_gpu_kernels', nan):8.3f} {d.get('ms_comm', nan):7.3f}")
        lines += phase_lines(summary["ranks"])
        lines += lag_lines(summary["start_lag"])
        lines += gc_lines(summary["gc"])
        lines += top_lines(summary["ranks"])
        return "\n".join(lines)


def phase_lines(ranks: list[dict]) -> list[str]:
    """An eager step's host time on each rank by phase: building its inputs, launching its forward, sampling (which
    waits for the device's tokens). On a GPU, launches far above the step's kernels mean a host-bound step."""
    rows = [(rank, kind, d["ms_host_phases"]) for rank, by_kind in enumerate(ranks) for kind, d in sorted(by_kind.items())
            if isinstance(d, dict) and d.get("ms_host_phases")]
    if not rows:
        return []
    lines = ["eager steps' host time by phase (ms per step)", f"{'rank':>4} {'kind':13} {'prepare':>8} {'forward':>8} {'sample':>8}"]
    for rank, kind, ph in rows:
        lines.append(f"{rank:4d} {kind:13} {ph.get('prepare', 0.0):8.3f} {ph.get('forward', 0.0):8.3f} {ph.get('sample', 0.0):8.3f}")
    return lines


def lag_lines(lags: dict[str, dict]) -> list[str]:
    """Each rank's execute start behind the earliest rank's for the same step: a rank that starts late makes the
    others wait in the step's first collective (their comm time grows by it)."""
    if not lags:
        return []
    lines = ["execute start behind the earliest rank, same step (ms; mean / p50 per rank)",
             f"{'kind':13} {'steps':>6}  per rank"]
    for kind, d in sorted(lags.items()):
        per_rank = "  ".join(f"r{r} {m:6.3f}/{p:6.3f}" for r, (m, p) in enumerate(zip(d["ms_mean"], d["ms_p50"])))
        lines.append(f"{kind:13} {d['steps']:6d}  {per_rank}")
    return lines


def gc_lines(gc: dict) -> list[str]:
    """The collector's pauses over the profile, in the driver and each rank (a rank's stall is its peers' wait)."""
    who = [("driver", gc["driver"])] + [(f"rank {r}", d) for r, d in enumerate(gc["ranks"]) if d]
    return ["garbage collector pauses (collections, full ones, ms total, ms longest)"] + [
        f"{name:8} {d['collections']:6d} {d['full']:4d} {d['ms_total']:9.1f} {d['ms_max']:8.2f}" for name, d in who]


def top_lines(ranks: list[dict]) -> list[str]:
    """The largest GPU kernels and host ops of each rank's profiled steps, per step kind (ms per step)."""
    lines = []
    for rank, by_kind in enumerate(ranks):
        for kind, d in sorted(by_kind.items()):
            for key, what in (("ms_top_gpu", "GPU kernels"), ("ms_top_host", "host ops (self)")):
                if d.get(key):
                    lines.append(f"rank {rank} {kind}, top {what}, tokens of the profiled steps {d.get('sampled_tokens')}:")
                    lines += [f"    {ms:9.3f}  {name}" for name, ms in d[key].items()]
    return lines
