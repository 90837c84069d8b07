"""`LocalBackend`: the `Backend` over one in-process `LLMEngine` (colocated prefill and decode).

The engine is synchronous and not thread-safe, so every call into it (add, abort, step, stats) runs
on one dedicated thread, in submission order: the event loop never blocks on a model step, and an
abort submitted while a step runs takes effect right after it. A step loop task keeps stepping while
the engine has requests and routes each output snapshot to its request's asyncio queue.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

from router import metrics
from router.config import AppConfig
from router.protocol import BackendUnavailable, GenerateRequest
from workers.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

POOL_TAG = {"pool": "colocated"}


class LocalBackend:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.model_name = model_name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-engine")
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop_task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._prefix_hits_seen = 0

    @classmethod
    def from_config(cls, config: AppConfig) -> "LocalBackend":
        """Colocated mode runs one engine per replica with the decode pool's layout."""
        engine_config = config.engine_config("decode")
        if engine_config.parallel.world_size > 1:
            raise ValueError(f"colocated mode runs the engine in-process; a layout of {engine_config.parallel.world_size} "
                             "ranks needs the disaggregated pools (set colocated: false)")
        return cls(LLMEngine(engine_config, show_progress=False), config.served_model_name)

    # ---- Backend ----
    async def ready(self) -> bool:
        return not self._closed and self._failure is None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._ensure_loop()
        if self._failure is not None or self._closed:
            raise BackendUnavailable(f"the engine is not running ({self._failure or 'closed'})")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        rid = req.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        self._streams[rid] = queue
        finished = False
        try:
            await self._call(self.engine.add_request, rid, req.prompt_token_ids, req.sampling_params, req.priority)
            self._wakeup.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and not self._closed:
                # Cancelled, closed early or failed: free the request's blocks. Not awaited, so that it
                # also runs when the task is being cancelled; the engine thread orders it after the add.
                self._executor.submit(self.engine.abort, rid)

    async def abort(self, request_id: str) -> None:
        if self._closed:
            return
        out = await self._call(self.engine.abort, request_id)
        queue = self._streams.get(request_id)
        if out is not None and queue is not None:
            queue.put_nowait(out.snapshot())  # ends the consumer's stream with finish_reason "abort"

    # ---- introspection and lifecycle ----
    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    async def close(self) -> None:
        """Stop the step loop and fail what is still streaming; the engine thread ends."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        for queue in self._streams.values():
            queue.put_nowait(BackendUnavailable("the server is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the step loop ----
    async def _call(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._loop_task
        if task is not None and not task.done() and task.get_loop() is not loop:
            if not task.get_loop().is_closed():
                # Queues and the step task belong to one loop; a second one would race them.
                raise RuntimeError("this LocalBackend is already driven by another running event loop")
            task = None
        if task is None or task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = loop.create_task(self._step_loop(), name="tandem-step-loop")

    def _step(self) -> tuple[list[RequestOutput], dict]:
        """Runs on the engine thread: snapshots are taken before the next step mutates the outputs."""
        outputs = [out.snapshot() for out in self.engine.step()]
        return outputs, self.engine.stats()

    async def _step_loop(self) -> None:
        while not self._closed:
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()  # set by generate() after an add
                continue
            try:
                outputs, stats = await self._call(self._step)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # an engine bug or a device error: fail every stream, stop serving
                log.exception("engine step failed; the local backend stops serving")
                self._failure = e
                for queue in self._streams.values():
                    queue.put_nowait(BackendUnavailable(f"engine step failed: {type(e).__name__}: {e}"))
                return
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            self._record(stats)
            if not outputs:
                # Prefill chunks sample nothing; yield to the loop so a burst of them can't starve it.
                await asyncio.sleep(0)

    def _record(self, stats: dict) -> None:
        metrics.QUEUE_DEPTH.set(stats["waiting"], tags=POOL_TAG)
        metrics.KV_BLOCKS_USED.set(stats["blocks_used"], tags=POOL_TAG)
        hits = stats["prefix_hit_tokens"]
        if hits > self._prefix_hits_seen:
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(hits - self._prefix_hits_seen)
        self._prefix_hits_seen = hits
