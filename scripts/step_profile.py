"""Where an engine's steps spend their time: host phases (schedule, execute, output processing) by
wall clock, and, for a sample of steps, the GPU's kernel time under torch.profiler.

    prof = StepProfile(llm.llm_engine, gpu_every=25); ...run...; print(prof.summary())
Used by `scripts/bench_offline.py --profile-steps`. Steps are grouped by kind: `decode-graph` (a
CUDA-graph replay), `decode` (one token per sequence, eager) and `mixed` (prefill chunks).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class StepProfile:
    def __init__(self, engine, gpu_every: int = 0):
        self.engine, self.gpu_every = engine, gpu_every
        self.rows: list[dict] = []
        self._cur: dict = {}
        sched, execute, step = engine.scheduler.schedule, engine.executor.execute, engine.step
        runner = getattr(engine.executor, "runner", None)

        def timed_schedule():
            t = time.perf_counter()
            out = sched()
            self._cur["schedule"] = time.perf_counter() - t
            return out

        def timed_execute(out):
            graphs = getattr(runner, "cuda_graphs", None)
            kind = ("decode-graph" if graphs is not None and graphs.can_run(out)
                    else "decode" if all(s.num_tokens == 1 for s in out.seqs) else "mixed")
            self._cur.update(kind=kind, seqs=len(out.seqs), tokens=out.num_tokens)
            sample_gpu = self.gpu_every and len(self.rows) % self.gpu_every == 0 and torch.cuda.is_available()
            t = time.perf_counter()
            if sample_gpu:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    res = execute(out)
                    torch.cuda.synchronize()
                self._cur["gpu"] = sum(e.device_time_total for e in prof.key_averages()) / 1e6
                self._cur["gpu_wall"] = time.perf_counter() - t
            else:
                res = execute(out)
            self._cur["execute"] = time.perf_counter() - t
            return res

        def timed_step():
            self._cur = {}
            t = time.perf_counter()
            outs = step()
            if "kind" in self._cur:
                self._cur["step"] = time.perf_counter() - t
                self.rows.append(self._cur)
            return outs

        engine.scheduler.schedule, engine.executor.execute, engine.step = timed_schedule, timed_execute, timed_step

    def summary(self) -> dict:
        by = defaultdict(list)
        for r in self.rows:
            by[r["kind"]].append(r)
        out = {}
        for kind, rs in by.items():
            n = len(rs)
            tot = sum(r["step"] for r in rs)
            d = {"steps": n, "seconds": tot, "mean_seqs": sum(r["seqs"] for r in rs) / n,
                 "mean_tokens": sum(r["tokens"] for r in rs) / n,
                 "ms_step": 1e3 * tot / n, "ms_schedule": 1e3 * sum(r["schedule"] for r in rs) / n,
                 "ms_execute": 1e3 * sum(r["execute"] for r in rs) / n,
                 "ms_after_execute": 1e3 * sum(r["step"] - r["schedule"] - r["execute"] for r in rs) / n}
            g = [r for r in rs if "gpu" in r]
            if g:  # kernel time of sampled steps over their execute wall time (profiled, so slightly slowed)
                d["gpu_busy_in_execute"] = sum(r["gpu"] for r in g) / sum(r["gpu_wall"] for r in g)
                d["ms_gpu_kernels"] = 1e3 * sum(r["gpu"] for r in g) / len(g)
            out[kind] = d
        return out

    def table(self) -> str:
        lines = [f"{'kind':13} {'steps':>6} {'sec':>7} {'seqs':>6} {'tokens':>7} {'ms/step':>8} {'sched':>6} {'exec':>7} "
                 f"{'after':>6} {'gpu ms':>7} {'busy':>5}"]
        for kind, d in sorted(self.summary().items()):
            lines.append(f"{kind:13} {d['steps']:6d} {d['seconds']:7.2f} {d['mean_seqs']:6.1f} {d['mean_tokens']:7.1f} "
                         f"{d['ms_step']:8.2f} {d['ms_schedule']:6.2f} {d['ms_execute']:7.2f} {d['ms_after_execute']:6.2f} "
                         f"{d.get('ms_gpu_kernels', float('nan')):7.2f} {d.get('gpu_busy_in_execute', float('nan')):5.2f}")
        return "\n".join(lines)
