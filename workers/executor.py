"""Executors run a step's `SchedulerOutput` on every rank of one replica and return its tokens.

The engine only sees this interface: `UniprocExecutor` runs the one `ModelRunner` in-process;
`cluster.ray_executor.RayExecutor` runs one runner per rank in Ray actors (TP/PP/SP layouts).
"""
from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Callable

from workers.config import EngineConfig
from workers.model_runner import ModelRunner
from workers.rank_profile import ProfiledRunner
from workers.scheduler_output import ModelRunnerOutput, SchedulerOutput, fill_placeholders, placeholder_seqs


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

    def submit(self, out: SchedulerOutput, ahead: bool = False) -> PendingStep:
        """Start one step; its `result()` is `execute(out)`. Here the step runs before this returns.
        `ahead=True`: the previous step is still out and `out` has placeholders (`supports_ahead` only)."""
        if ahead:
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
        step kind, in rank order."""

    # ---- KV transfer between pools (workers/kv_transfer) ----
    @abstractmethod
    def kv_setup(self, role: str) -> None:
        """Give every rank a `KVTransferAgent` over its KV cache ('prefill' or 'decode' pool)."""

    @abstractmethod
    def kv_call(self, method: str, *args, ranks: list[int] | None = None) -> list:
        """Call `KVTransferAgent.<method>(*args)` on the given ranks (all by default), concurrently;
        results in rank order. A failed transfer raises `KVTransferError` and leaves the executor usable."""


class UniprocExecutor(Executor):
    """One rank, in this process: no process groups, no communication."""

    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int], show_progress: bool = True):
        self.runner: ModelRunner | None = ModelRunner(config, hf_config, max_model_len, eos_token_ids, show_progress)
        self.profiled: ProfiledRunner | None = None
        self.num_blocks = self.runner.num_blocks

    @property
    def alive(self) -> bool:
        return self.runner is not None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise ExecutorError("the executor was shut down")
        if self.profiled is not None:
            return self.profiled.execute(out)
        return self.runner.execute(out)

    def profile(self, action: str, gpu_every: int = 0) -> list[dict]:
        if action == "start":
            self.profiled = ProfiledRunner(self.runner, gpu_every)
            return []
        return [self.profiled.profile.summary() if self.profiled is not None else {}]

    def shutdown(self) -> None:
        # Dropping the runner frees the weights and the KV cache (nothing else holds them).
        self.runner = None
        self.profiled = None  # it holds the runner too
        self.kv_agent = None

    def kv_setup(self, role: str) -> None:
        from workers.kv_transfer.transport import KVTransferAgent

        self.kv_agent = KVTransferAgent(self.runner.kv_cache, self.runner.kv_shard(0), role,
                                        self.runner.config.cache.kv_transfer_timeout_seconds)

    def kv_call(self, method: str, *args, ranks: list[int] | None = None) -> list:
        return [getattr(self.kv_agent, method)(*args)]


class ThreadedUniprocExecutor(UniprocExecutor):
    """One rank, in this process, run by a step thread of its own (asynchronous scheduling on one GPU).

    The engine's thread sends steps into a queue and returns; the step thread builds each step's inputs,
    launches it and waits for its tokens (the wait releases the GIL), so the engine's update, checks, next
    schedule and text work run while the GPU computes, as with rank actors but without a process hop. The
    protocol is the rank loop's (cluster/rank_worker.py): a step sent `ahead` waits in the thread for its
    `fill`. Off for CPU devices, where both threads would compete for the same cores (engine/executor.py)."""

    overlaps_host_work = True
    supports_ahead = True

    def __init__(self, config: EngineConfig, hf_config, max_model_len: int, eos_token_ids: list[int], show_progress: bool = True):
        super().__init__(config, hf_config, max_model_len, eos_token_ids, show_progress)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._latest: Future | None = None  # the newest step sent
        self._to_fill = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tandem-step", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.runner is not None and self._error is None and self._thread.is_alive()

    def _loop(self) -> None:
        runner = self.runner
        if runner is not None and runner.device.type == "cuda":
            import torch

            torch.cuda.set_device(runner.device)  # the current device is per thread
        waiting: tuple[SchedulerOutput, Future] | None = None
        while True:
            message = self._inbox.get()
            if message is None:
                if waiting is not None:  # its fill will never come
                    waiting[1].set_exception(ExecutorError("the executor was shut down"))
                return
            if message[0] == "step":
                _, out, to_fill, future = message
                if to_fill:
                    waiting = (out, future)
                    continue
            else:  # ("fill", tokens)
                if waiting is None:
                    continue  # cannot happen: `fill` checks that a step waits
                (out, future), waiting = waiting, None
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if message[0] == "fill":
                    fill_placeholders(out.seqs, message[1])
                future.set_result(UniprocExecutor.execute(self, out))
            except BaseException as e:  # noqa: BLE001 - handed to the engine's thread, which raises it
                self._error = e
                future.set_exception(e)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(out).result()

    def submit(self, out: SchedulerOutput, ahead: bool = False) -> PendingStep:
        if not self.alive:
            raise ExecutorError(f"the executor cannot run more steps: {self._error!r}" if self._error else
                                "the executor was shut down")
        if self._to_fill:
            raise ExecutorError("a step was sent ahead and its placeholders were never filled")
        if not ahead and self._latest is not None:
            self._latest.exception()  # one step at a time: wait for the one out (its error stays for its owner)
        to_fill = len(placeholder_seqs(out.seqs))
        future: Future = Future()
        self._inbox.put(("step", out, to_fill, future))
        self._to_fill, self._latest = to_fill, future

        def collect() -> ModelRunnerOutput:
            if to_fill and self._latest is future and self._to_fill:
                raise ExecutorError("a step's result was asked for before its placeholders were filled")
            return future.result()

        return PendingStep(collect)

    def fill(self, tokens: list[int]) -> None:
        if len(tokens) != self._to_fill:
            raise ExecutorError(f"the step sent ahead has {self._to_fill} placeholders, {len(tokens)} tokens came")
        if tokens:
            self._to_fill = 0
            self._inbox.put(("fill", tokens))

    def _settle(self) -> None:
        if self._latest is not None and not self._to_fill:
            self._latest.exception()

    def profile(self, action: str, gpu_every: int = 0) -> list[dict]:
        self._settle()  # the step thread reads `profiled` per step: change it between steps
        return super().profile(action, gpu_every)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._to_fill = 0
            self._inbox.put(None)
            self._thread.join(timeout=60)
        super().shutdown()
