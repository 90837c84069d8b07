"""Drives an `LLMEngine` from asyncio, for the served pools and the colocated backend.

One background task steps the engine (in a worker thread, so the event loop keeps serving) while
there is work; each request has an asyncio queue that receives a snapshot of its output after every
step it took part in. Every engine call goes through one lock: the engine is not thread-safe. A
consumer that stops listening (client gone, task cancelled) aborts its request, which frees its
blocks whatever state it was in.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable, TypeVar

from workers.engine import LLMEngine, RequestOutput
from workers.sampling_params import SamplingParams
from workers.scheduler_output import SampledToken

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """A step failed (a rank died, a kernel raised): this engine serves nothing more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, lease_check_interval_s: float = 1.0):
        self.engine = engine
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._lease_interval = lease_check_interval_s

    # ---- engine calls, serialised ----
    def _locked(self, fn: Callable[..., T], *args) -> T:
        with self._lock:
            return fn(*args)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """Run one engine method under the engine lock, off the event loop."""
        self._check_alive()
        return await asyncio.to_thread(self._locked, fn, *args)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped after an error: {self._dead}") from self._dead

    @property
    def alive(self) -> bool:
        return self._dead is None

    # ---- request streams ----
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                       handoff: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, step by step; the last one has `finish_reason` set."""
        queue = self._open(request_id)
        try:
            await self.call(self.engine.add_request, request_id, prompt, params, priority, handoff)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        async for out in self._drain(request_id, queue):
            yield out

    async def start(self, request_id: str, first: SampledToken) -> AsyncIterator[RequestOutput]:
        """Decode side: continue a reserved request whose KV has arrived, from its first token."""
        queue = self._open(request_id)
        try:
            first_out = await self.call(lambda: self.engine.start(request_id, first).snapshot())
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        queue.put_nowait(first_out)
        if first_out.finished:
            self._queues.pop(request_id, None)
        async for out in self._drain(request_id, queue):
            yield out

    def _open(self, request_id: str) -> asyncio.Queue:
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._ensure_loop()
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                # Cancelled or abandoned: free everything now, without waiting here.
                self._queues.pop(request_id, None)
                asyncio.ensure_future(self._abort_quietly(request_id))

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        await self.call(self.engine.abort, request_id)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.to_thread(self._locked, self.engine.abort, request_id)
        except Exception:  # noqa: BLE001 - the engine may be dead; nothing left to free then
            log.exception("abort of %s failed", request_id)

    # ---- the step loop ----
    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _has_work(self) -> bool:
        return self.engine.scheduler.has_work

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            self.engine.expire_leases()
            return [o.snapshot() for o in self.engine.step()]

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wake.clear()
                try:
                    # Leases (held/reserved KV) must expire even when nothing runs.
                    await asyncio.wait_for(self._wake.wait(), self._lease_interval)
                except asyncio.TimeoutError:
                    if self.engine.scheduler.has_leases:
                        await asyncio.to_thread(self._locked, self.engine.expire_leases)
                continue
            try:
                outputs = await asyncio.to_thread(self._step)
            except Exception as e:  # noqa: BLE001 - fail every waiter with the cause, then stop
                log.exception("engine step failed")
                self._dead = e
                for queue in self._queues.values():
                    queue.put_nowait(EngineDeadError(f"engine step failed: {e}"))
                self._queues.clear()
                return
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
