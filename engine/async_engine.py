"""Drives an `LLMEngine` from asyncio: the colocated backend and both pools use it.

The engine is synchronous and not thread-safe, so every call into it (add, abort, step, reserve,
release, stats) runs on one dedicated thread, in submission order: the event loop never blocks on a
model step, and an abort submitted while a step runs takes effect right after it. A step task keeps
stepping while the engine has work; each request has an asyncio queue that receives a snapshot of
its output after every step it took part in. A consumer that stops listening (client gone, task
cancelled) aborts its request, which frees its blocks whatever state it was in.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from engine.llm_engine import LLMEngine, RequestOutput
from workers.gil import shorten_switch_interval
from workers.sampling_params import SamplingParams
from workers.scheduler_output import SampledToken

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """A step failed (a rank died, a kernel raised) or the engine was closed: it serves nothing more."""


class _StreamQueue(asyncio.Queue):
    """A request's outputs, read on the event loop that opened the request. The engine may be driven from
    several loops over its life (each loop gets its own step task, e.g. one TestClient after another, or a
    Serve replica's loops), so an output may come from a task on another loop's thread: an asyncio.Queue
    filled from a thread that is not its loop's does not wake its reader, so it goes through that loop."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()

    def put_anywhere(self, item: object) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.put_nowait(item)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.put_nowait, item)


class StreamPace:
    """A replica's budget of stream items per second, shared by its open streams. Each item a decode replica
    streams to its router is a Ray object of its own, and one process sends only so many a second (on an H100
    host, with the engine thread beside it, ~2,600: PD's decode replica then delivered its tokens at half the
    rate its GPU made them, docs/benchmarks.md "Tenth session"). Under that budget a stream waits
    `open streams / items_per_s` after an item before sending the next, and whatever its engine made meanwhile
    goes out as one item; at low load the gap is shorter than a step and every token is its own item. A
    request's first and last items are never held."""

    def __init__(self, items_per_s: float) -> None:
        if items_per_s <= 0:
            raise ValueError(f"a stream pace needs items_per_s > 0, got {items_per_s}")
        self.items_per_s = items_per_s
        self.open_streams = 0

    def gap_s(self) -> float:
        """The least time between two items of one stream now."""
        return self.open_streams / self.items_per_s


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[dict], None] | None = None,
                 lease_check_interval_s: float = 1.0, stream_pace: StreamPace | None = None):
        self.llm_engine = engine
        self.stream_pace = stream_pace
        # The engine thread computes in Python while the event loop streams tokens and a decode replica's KV
        # transfers wait on sockets: each of those waits must not cost a 5 ms GIL turn (workers/gil.py).
        shorten_switch_interval()
        # Called on the engine thread with engine.stats() after every step and every other engine call:
        # aborts, releases, reservation cancels and lease expiry free blocks outside steps, so gauges fed
        # from it (router/metrics.py) would otherwise keep showing freed blocks while no step follows.
        self.on_step = on_step
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-engine")
        self._queues: dict[str, _StreamQueue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._lease_interval = lease_check_interval_s

    # ---- engine calls, in order on the engine thread ----
    async def call(self, fn: Callable[..., T], *args) -> T:
        self._check_alive()
        run = functools.partial(self._then_report, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, run)

    async def call_for(self, request_id: str, fn: Callable[..., T], *args) -> T:
        """`call` for a method that creates state for `request_id` (admits, reserves or starts it). A
        running call cannot be interrupted: if the caller is cancelled, an abort queued behind the call
        undoes whatever it created, so nothing outlives its caller."""
        try:
            return await self.call(fn, *args)
        except asyncio.CancelledError:
            self._free_soon(self.llm_engine.abort, request_id)
            raise

    async def cleanup(self, fn: Callable[..., object], *args) -> None:
        """Run a method that only frees (abort, release, cancel_reservation), after what is queued before
        it. Never raises; also on an engine that died, whose bookkeeping is then all there is to free."""
        future = self._free_soon(fn, *args)
        if future is not None:
            try:
                await asyncio.wrap_future(future)
            except Exception:  # noqa: BLE001 - nothing more can be freed; the caller's own error matters more
                log.exception("%s%r failed", getattr(fn, "__name__", "cleanup"), args)

    def _free_soon(self, fn: Callable[..., object], *args) -> Future | None:
        try:
            return self._thread.submit(self._then_report, fn, *args)
        except RuntimeError:  # closed: the engine thread is gone, and the engine with it
            return None

    def _then_report(self, fn: Callable[..., T], *args) -> T:
        """On the engine thread: an engine call, then its effect on the stats to `on_step`."""
        try:
            return fn(*args)
        finally:
            self._report()

    def _report(self) -> None:
        """On the engine thread (so reports arrive in the order of the changes they describe)."""
        if self.on_step is None:
            return
        try:
            self.on_step(self.llm_engine.stats())
        except Exception:  # noqa: BLE001 - metrics must never fail an engine call
            log.exception("reporting engine stats failed")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}") from self._dead

    @property
    def alive(self) -> bool:
        return self._dead is None

    async def stats(self) -> dict:
        return await self.call(self.llm_engine.stats)

    # ---- request streams ----
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                       handoff: bool = False, pieces: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, step by step; the last one has `finish_reason` set. pieces: see
        `LLMEngine.add_request` (outputs with `kv_blocks` come before the handoff's)."""
        queue = self._open(request_id)
        add = functools.partial(self.llm_engine.add_request, pieces=True) if pieces else self.llm_engine.add_request
        try:
            await self.call_for(request_id, add, request_id, prompt, params, priority, handoff)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        async for out in self._drain(request_id, queue):
            yield out

    async def start(self, request_id: str, first: SampledToken) -> AsyncIterator[RequestOutput]:
        """Decode side: continue a reserved request whose KV has arrived, from its first token."""
        queue = self._open(request_id)
        try:
            first_out = await self.call_for(request_id, lambda: self.llm_engine.start(request_id, first).snapshot())
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        queue.put_nowait(first_out)
        async for out in self._drain(request_id, queue):
            yield out

    async def generate_many(self, items: list[tuple[str, str | list[int], SamplingParams, int]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several requests (a client's prompts and `n` choices: (request_id, prompt, params, priority)) as
        one stream of (index, output). The requests of one prompt share its KV through the prefix cache:
        the first of them is added with the first of every other prompt, in one engine call, and the rest
        in one more call as soon as its prompt has run (its first output), so that they find its full
        blocks cached and compute only the last partial one. Closing the stream aborts every unfinished one."""
        opened: list[str] = []
        finished: set[str] = set()

        async def start(indices: list[int], leader: RequestOutput | None) -> list[AsyncIterator[RequestOutput]]:
            streams = await self.open_many([items[i] for i in indices])
            opened.extend(items[i][0] for i in indices)
            return streams

        try:
            async with contextlib.aclosing(staged_fanout([item[1] for item in items], start, lambda out, seen: True)) as merged:
                async for i, out in merged:
                    if out.finished:
                        finished.add(out.request_id)
                    yield i, out
        finally:
            self.abort_soon([rid for rid in opened if rid not in finished])

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort requests opened here whose streams may never have started (so their own cleanup never
        ran): their queues go, and the aborts are queued on the engine thread (no-ops for finished ones)."""
        for rid in request_ids:
            self._queues.pop(rid, None)
            self._free_soon(self.llm_engine.abort, rid)

    async def open_many(self, items: list[tuple[str, str | list[int], SamplingParams, int]]) -> list[AsyncIterator[RequestOutput]]:
        """Add several requests in one engine call (all or none) and return their output streams."""
        ids = [item[0] for item in items]
        queues: list[asyncio.Queue] = []
        try:
            for rid in ids:
                queues.append(self._open(rid))
            await self.call(self._add_all, items)
        except BaseException as e:
            for rid in ids[:len(queues)]:
                self._queues.pop(rid, None)
            if isinstance(e, asyncio.CancelledError):
                for rid in ids:
                    self._free_soon(self.llm_engine.abort, rid)
            raise
        return [self._drain(rid, queue) for rid, queue in zip(ids, queues)]

    def _add_all(self, items: list[tuple[str, str | list[int], SamplingParams, int]]) -> None:
        """On the engine thread: add every request, or none (a refusal undoes the ones added before it)."""
        added: list[str] = []
        try:
            for rid, prompt, params, priority in items:
                self.llm_engine.add_request(rid, prompt, params, priority)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.llm_engine.abort(rid)
            raise

    def _open(self, request_id: str) -> asyncio.Queue:
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_loop()
        queue = _StreamQueue()
        self._queues[request_id] = queue
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        self._wake.set()
        finished = False
        pending: RequestOutput | BaseException | None = None
        first = True
        pace, loop, last_sent = self.stream_pace, asyncio.get_running_loop(), 0.0
        if pace is not None:
            pace.open_streams += 1
        try:
            while True:
                item, pending = (pending, None) if pending is not None else (await queue.get(), None)
                if isinstance(item, BaseException):
                    raise item
                if pace is not None and not first and not item.finished:
                    wait = last_sent + pace.gap_s() - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)  # the outputs of the steps meanwhile join this item
                # Outputs that queued while the consumer was busy (a slow client, a loaded Serve hop) or the
                # pace held this one go out as one item: the latest, with the deltas of all. The first item
                # stays alone (callers may treat it specially: a disaggregated decode replica's token 1 was
                # already streamed).
                while not first and not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        pending = nxt
                        break
                    item = _merged(item, nxt)
                first = False
                finished = item.finished
                last_sent = loop.time()
                yield item
                if finished:
                    return
        finally:
            if pace is not None:
                pace.open_streams -= 1
            self._queues.pop(request_id, None)
            if not finished:
                # Cancelled, closed early or failed (a dead engine too): free the request now. Submitted,
                # not awaited, so it also happens while the task is being cancelled; the engine thread runs
                # it after the add.
                self._free_soon(self.llm_engine.abort, request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream (if any) ends with finish_reason "abort". No-op if unknown."""
        if self._dead is not None:
            return
        out = await self.call(self.llm_engine.abort, request_id)
        queue = self._queues.get(request_id)
        if out is not None and queue is not None:
            queue.put_anywhere(out.snapshot())

    async def close(self) -> None:
        """Stop stepping and fail what is still streaming; the engine thread ends."""
        if self._dead is None:
            self._dead = EngineDeadError("the engine was closed")
        if self._task is not None:
            self._task.cancel()
        for queue in self._queues.values():
            queue.put_anywhere(EngineDeadError("the server is shutting down"))
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ---- the step loop ----
    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            # First use, or a new event loop (each loop gets its own step task).
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="tandem-step-loop")

    def _step(self) -> list[RequestOutput]:
        """On the engine thread: snapshots are taken before the next step mutates the outputs."""
        self.llm_engine.expire_leases()
        outputs = [o.snapshot() for o in self.llm_engine.step()]
        self._report()
        return outputs

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        me, wake = asyncio.current_task(), self._wake  # this loop's own event (`_ensure_loop` made both)
        while self._dead is None:
            if self._task is not me:
                # Superseded: a request came from another event loop (`_ensure_loop`), whose step task now
                # steps the engine; one step task at a time.
                return
            if not self.llm_engine.scheduler.has_work:
                wake.clear()
                try:
                    # Leases (held/reserved KV) must expire even when nothing runs.
                    await asyncio.wait_for(wake.wait(), self._lease_interval)
                except asyncio.TimeoutError:
                    if self.llm_engine.scheduler.has_leases:
                        await self.call(self.llm_engine.expire_leases)
                continue
            try:
                outputs = await loop.run_in_executor(self._thread, self._step)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - a rank died or a kernel raised: fail every stream, stop
                log.exception("engine step failed; this engine stops serving")
                self._dead = e
                for queue in self._queues.values():
                    queue.put_anywhere(EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
                return
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_anywhere(out)
            if not outputs:
                # Prefill chunks sample nothing; yield to the loop so a burst of them can't starve it.
                await asyncio.sleep(0)


async def staged_fanout(prompts: list, start: Callable[[list[int], RequestOutput | None], Awaitable[list[AsyncIterator[RequestOutput]]]],
                        ready: Callable[[RequestOutput, int], bool]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The streams of several requests merged as (index, output), in arrival order. Requests with equal
    prompts form a group whose first request leads: `start(leaders, None)` opens the leaders of every
    group at once; a group's other requests are opened with `start(them, output)` once an output of their
    leader satisfies `ready(output, outputs seen)` (or finishes), so that they run after the prompt's KV
    exists and reuse it. Ends when every request has finished; on an error or when closed, every stream
    opened is closed (which aborts its request)."""
    groups: dict[object, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt if isinstance(prompt, str) else tuple(prompt), []).append(i)
    followers = {g[0]: g[1:] for g in groups.values() if len(g) > 1}
    merged: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    unfinished = set(range(len(prompts)))
    seen: dict[int, int] = {}

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait((i, e))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def launch(indices: list[int], leader: RequestOutput | None) -> None:
        streams = await start(indices, leader)
        tasks.extend(asyncio.ensure_future(pump(i, s)) for i, s in zip(indices, streams))

    try:
        await launch([g[0] for g in groups.values()], None)
        while unfinished:
            i, item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            seen[i] = seen.get(i, 0) + 1
            if i in followers and (item.finished or ready(item, seen[i])):
                await launch(followers.pop(i), item)
            if item.finished:
                unfinished.discard(i)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive snapshots of one request as one: the later's cumulative fields, both deltas."""
    # Stamps ride on tokens 1 and 2 and the last output only: keep the earlier's when the later has none.
    timeline = later.timeline if later.timeline is not None else earlier.timeline
    return replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids, new_text=earlier.new_text + later.new_text,
                   timeline=timeline)
