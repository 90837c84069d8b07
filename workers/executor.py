"""Executors run a step's `SchedulerOutput` on every rank of one replica and return its tokens.

The engine only sees this interface: `UniprocExecutor` runs the one `ModelRunner` in-process;
`cluster.ray_executor.RayExecutor` runs one runner per rank in Ray actors (TP/PP/SP layouts).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Callable

from workers.config import EngineConfig
from workers.launched_step import LaunchedStep, launch_ahead_enabled, launch_mixed_enabled
from workers.model_runner import ModelRunner
from workers.rank_profile import ProfiledRunner, logged_profile
from workers.scheduler_output import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput, fill_placeholders


class ExecutorError(RuntimeError):
    """A rank died, raised, or stopped answering; the executor is unusable afterwards."""


class PendingStep:
    """A step sent to the ranks: `result()` waits for its sampled tokens (the first call collects them,
    later calls return the same result or raise the same error)."""

    def __init__(self, collect: Callable[[], ModelRunnerOutput] | None, result: ModelRunnerOutput | None = None):
        self._collect, self._result, self._error = collect, result, None

    def result(self) -> ModelRunnerOutput:
        if self._error is not None:
            raise self._error
        if self._result is None:
            collect, self._collect = self._collect, None
            try:
                self._result = collect()
            except BaseException as e:
                self._error = e
                raise
        return self._result


class Executor(ABC):
    num_blocks: int  # KV blocks every rank can hold: the scheduler's block ids are valid on all of them
    # True where a step runs outside this thread (rank actors): the engine then does its text work for
    # one step while the ranks compute the next (LLMEngine.step).
    overlaps_host_work: bool = False

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the sampled tokens of the sequences with `sample=True`."""

    @property
    def alive(self) -> bool:
        """False once the executor failed or was shut down: it runs nothing more."""
        return True

    # True where a step may be sent while the one before it is still out (asynchronous scheduling): the
    # step carries placeholders for the tokens the step before samples, sent after it with `fill`.
    supports_ahead: bool = False
    # False where the ranks fill a step sent ahead themselves (one rank, which sampled the tokens; read after each
    # submit, as the TP ranks of cluster/ray_executor.py do after an all plain greedy step): then the engine does not
    # build the token list for `fill` at all.
    needs_fill: bool = True
    # How many steps over disjoint sequences may be out at once (pipelined steps, EngineConfig.step_groups: one
    # per pipeline stage); 1 where steps run one at a time.
    max_steps_in_flight: int = 1

    def submit(self, out: SchedulerOutput, ahead: bool = False, overlap: bool = False) -> PendingStep:
        """Start one step; its `result()` is `execute(out)`. Here the step runs before this returns.
        `ahead=True`: the previous step is still out and `out` has placeholders (`supports_ahead` only).
        `overlap=True`: earlier steps may still be out, over other sequences than `out`'s, and stay out: the ranks
        run `out` after them, the first stage while the later stages still run those (`max_steps_in_flight`)."""
        if ahead or overlap:
            raise ExecutorError(f"{type(self).__name__} runs one step at a time")
        return PendingStep(None, self.execute(out))

    def fill(self, tokens: list[int]) -> None:
        """The tokens for the placeholders of the step sent ahead, in step order (`supports_ahead` only)."""
        raise ExecutorError(f"{type(self).__name__} runs one step at a time")

    @abstractmethod
    def shutdown(self) -> None:
        """Release the ranks and their memory. Safe to call more than once."""

    @abstractmethod
    def profile(self, action: str, gpu_every: int = 0) -> list[dict]:
        """Per-rank step profiles (workers/rank_profile.py): "start" begins recording on every rank
        (every gpu_every-th step also under torch.profiler); "report" returns each rank's summary by
        step kind, and its process's collector pauses under "gc" (workers/gc_freeze.py), in rank order."""

    # ---- KV transfer between pools (workers/kv_transfer) ----
    @abstractmethod
    def kv_setup(self, role: str) -> None:
        """Give every rank a `KVTransferAgent` over its KV cache ('prefill' or 'decode' pool)."""

    @abstractmethod
    def kv_call(self, method: str, *args, ranks: list[int] | None = None) -> list:
        """Call `KVTransferAgent.<method>(*args)` on the given ranks (all by default), concurrently;
        results in rank order. A failed transfer raises `KVTransferError` and leaves the executor usable."""


class UniprocExecutor(Executor):
    """One rank, in this process: no process groups, no communication.

    On a GPU it schedules asynchronously too (`supports_ahead`): a plain greedy decode step is launched and left
    running (`ModelRunner.launch_greedy`), the engine plans the next step meanwhile, and where that step continues the
    same decodes it is launched behind the first with the first one's tokens as its inputs, on the device. So the GPU
    runs decode steps back to back while this thread applies, checks, detokenizes and schedules (LLMEngine.step); on
    an H200 that host work took 0.2-0.55 ms between batch-1 decode steps of 2.3-4.2 ms (docs/benchmarks.md). A step
    sent ahead that cannot be launched so (a prefill, sampling, its predecessor ran whole) waits for `fill` and runs
    then. TANDEM_RANK_LAUNCH_AHEAD (workers/launched_step.py) turns it off ("0") or on for CPU ("1": tests). With
    TANDEM_LAUNCH_MIXED=1 (the default; "0" turns it off) a plain greedy step with prefill chunks is launched too
    (`launch_greedy(mixed=True)`), so the host's work on the step before overlaps it instead of following it."""

    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int], show_progress: bool = True):
        self.runner: ModelRunner | None = ModelRunner(config, hf_config, max_model_len, eos_token_ids, show_progress)
        logged = logged_profile(0)  # TANDEM_RANK_PROFILE: a served replica's rank logs its own profile
        self.profiled: ProfiledRunner | None = ProfiledRunner(self.runner, 0, logged) if logged is not None else None
        self.num_blocks = self.runner.num_blocks
        self.supports_ahead = launch_ahead_enabled(self.runner.device)
        self.launch_mixed = launch_mixed_enabled()  # steps with prefill chunks launched too (workers/launched_step.py)
        self._launched: LaunchedStep | None = None  # the step submitted last, where it was launched (not run whole)
        # A step sent ahead that runs at its `fill`, and the one-item list its PendingStep finds it in once run.
        self._waiting: tuple[SchedulerOutput, list[PendingStep]] | None = None
        self._needs_fill = True
        # steps launched, those launched behind the one before, and those with prefill chunks
        self.launches = {"launched": 0, "continued": 0, "mixed": 0}

    @property
    def needs_fill(self) -> bool:  # type: ignore[override]
        """Whether the step sent ahead last waits for `fill` (not where it was launched with the device's tokens)."""
        return self._needs_fill

    @property
    def alive(self) -> bool:
        return self.runner is not None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise ExecutorError("the executor was shut down")
        self._launched = None
        if self.profiled is not None:
            return self.profiled.execute(out)
        return self.runner.execute(out)

    def submit(self, out: SchedulerOutput, ahead: bool = False, overlap: bool = False) -> PendingStep:
        if overlap or (ahead and not self.supports_ahead):
            raise ExecutorError(f"{type(self).__name__} runs {'one step at a time' if overlap else 'no step ahead'}")
        if self._waiting is not None:
            raise ExecutorError("a step was sent ahead and its placeholders were never filled")
        if self.runner is None:
            raise ExecutorError("the executor was shut down")
        if not ahead:
            return self._start(out)
        ids = self._continued_ids(out)
        if ids is not None:
            launched_at = time.perf_counter()
            launched = self.runner.launch_greedy(out, ids)
            if launched is not None:
                self._needs_fill = False
                self.launches["continued"] += 1
                return self._track(launched, out, launched_at)
        started: list[PendingStep] = []
        self._needs_fill, self._waiting = True, (out, started)
        return PendingStep(lambda: self._collect_filled(started))

    def fill(self, tokens: list[int]) -> None:
        if self._waiting is None:
            raise ExecutorError("fill() with no step sent ahead waiting for it")
        (out, started), self._waiting = self._waiting, None
        fill_placeholders(out.seqs, tokens)
        started.append(self._start(out))

    @staticmethod
    def _collect_filled(started: list[PendingStep]) -> ModelRunnerOutput:
        if not started:
            raise ExecutorError("the step sent ahead was collected before its placeholders were filled")
        return started[0].result()

    def _start(self, out: SchedulerOutput) -> PendingStep:
        """Launch `out` where it is a plain greedy decode (not one a profile samples: that runs whole), else run it."""
        if self.supports_ahead and (self.profiled is None or self.profiled.may_launch()):
            launched_at = time.perf_counter()
            launched = self.runner.launch_greedy(out, mixed=self.launch_mixed)
            if launched is not None:
                return self._track(launched, out, launched_at)
        return PendingStep(None, self.execute(out))

    def _track(self, launched: LaunchedStep, out: SchedulerOutput, launched_at: float) -> PendingStep:
        self._launched = launched
        self.launches["launched"] += 1
        self.launches["mixed"] += launched.mixed
        if self.profiled is None:
            return PendingStep(launched.finish)
        return PendingStep(self.profiled.launched(out, launched_at, launched.finish))

    def _continued_ids(self, out: SchedulerOutput):
        """The input tokens on the device of a step sent ahead whose every sequence is a plain decode waiting for the
        token the launched step before samples (its `next_ids`, by row); None where it is anything else."""
        last = self._launched
        if last is None or (self.profiled is not None and not self.profiled.may_launch(ahead=1)):
            return None  # (the step before is out, not yet recorded: this one is the profile's next but one)
        rows = {seq_id: i for i, seq_id in enumerate(last.seq_ids)}
        picked = []
        for s in out.seqs:
            row = rows.get(s.seq_id)
            if row is None or s.token_ids != [PLACEHOLDER_TOKEN]:
                return None
            picked.append(row)
        if picked == list(range(len(last.seq_ids))):
            return last.next_ids
        return last.next_ids.index_select(0, self.runner.on_device(picked))

    def profile(self, action: str, gpu_every: int = 0) -> list[dict]:
        if action == "start":
            if self.profiled is not None:
                self.profiled.profile.gc.remove()
            self.profiled = ProfiledRunner(self.runner, gpu_every)
            return []
        return [self.profiled.profile.summary() if self.profiled is not None else {}]

    def shutdown(self) -> None:
        # Dropping the runner frees the weights and the KV cache (nothing else holds them).
        self.runner = None
        self.profiled = None  # it holds the runner too
        self.kv_agent = None
        self._launched = self._waiting = None

    def kv_setup(self, role: str) -> None:
        from workers.kv_transfer.transport import KVTransferAgent

        self.kv_agent = KVTransferAgent(self.runner.kv_cache, self.runner.kv_shard(0), role,
                                        self.runner.config.cache.kv_transfer_timeout_seconds,
                                        self.runner.track_chunk_ends() if role == "prefill" else None)

    def kv_call(self, method: str, *args, ranks: list[int] | None = None) -> list:
        return [getattr(self.kv_agent, method)(*args)]
