"""`Fanout`: the backend requests of one client request (several prompts, `n` choices) run together.

With more than one request and a backend that has `generate_batch` (every backend here), they go to the
backend as ONE call, which adds them to one engine together (so the choices of a prompt share its KV,
engine/async_engine.py `staged_fanout`) and streams back outputs tagged with their index; otherwise one
`generate` stream each. Outputs arrive merged in arrival order as `(index, RequestOutput)`. A deadline covers the whole
request. `aclose()` cancels the streams and aborts every request that has not finished; it is
shielded, so it completes even while the calling task is being cancelled (a client that went away).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

import anyio

from router.protocol import Backend, GenerateRequest
from engine.llm_engine import RequestOutput


class Fanout:
    def __init__(self, backend: Backend, requests: list[GenerateRequest], timeout_s: float | None = None):
        self.backend = backend
        self.requests = requests
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._unfinished = set(range(len(requests)))
        self._deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        if len(requests) > 1 and hasattr(backend, "generate_batch"):
            self._tasks = [asyncio.create_task(self._pump_batch(), name=f"batch-{requests[0].request_id}")]
        else:
            self._tasks = [asyncio.create_task(self._pump(i, r), name=f"stream-{r.request_id}") for i, r in enumerate(requests)]
        self._buffer: list[tuple[int, RequestOutput]] = []

    async def _pump_batch(self) -> None:
        try:
            async with contextlib.aclosing(self.backend.generate_batch(self.requests)) as stream:
                async for i, out in stream:
                    self._queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the whole call failed: the consumer sees it on its next output
            self._queue.put_nowait((-1, e))

    async def _pump(self, i: int, req: GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(self.backend.generate(req)) as stream:
                async for out in stream:
                    self._queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, who maps it to a status
            self._queue.put_nowait((i, e))

    @property
    def done(self) -> bool:
        return not self._unfinished and not self._buffer

    async def _next(self) -> tuple[int, RequestOutput]:
        timeout = None if self._deadline is None else self._deadline - asyncio.get_running_loop().time()
        if timeout is not None and timeout <= 0:
            raise asyncio.TimeoutError("no result within the request timeout")
        try:
            i, item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError("no result within the request timeout") from None
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._unfinished.discard(i)
        return i, item

    async def started(self) -> None:
        """Wait until every stream has produced its first output (or failed): errors such as a full
        queue or a bad prompt surface here, before a streaming response commits to status 200."""
        seen: set[int] = {i for i, _ in self._buffer}
        while len(seen) < len(self.requests):
            i, out = await self._next()
            self._buffer.append((i, out))
            seen.add(i)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._buffer:
            yield self._buffer.pop(0)
        while self._unfinished:
            yield await self._next()

    async def final_outputs(self, on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """The last (cumulative) output of each stream, in request order; `on_output` sees every one."""
        last: dict[int, RequestOutput] = {}
        async for i, out in self:
            last[i] = out
            if on_output is not None:
                on_output(out)
        return [last[i] for i in range(len(self.requests))]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for i in sorted(self._unfinished):
                await self.backend.abort(self.requests[i].request_id)
            self._unfinished.clear()
