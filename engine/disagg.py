"""Disaggregated serving, replica side: a prefill replica runs prompts and holds their KV; a decode
replica reserves blocks, drives the KV handoff, and streams the rest of the tokens.

The protocol (docs/architecture.md, "Prefill/decode handoff"):
 1. decode: reserve blocks for the prompt (+1 token), reusing its own cached prefix; full -> QueueFullError.
 2. decode -> prefill (any replica, via the caller's `PrefillClient`): run the prompt, sample the first
    token, hold the blocks under a lease; answer `PrefillReady` (first token, block ids, rank handles).
 3. decode: under its lock for that prefill replica, build the pair's transfer group if new and number the
    transfer on the pair; then (up to `kv_transfers_in_flight` in flight on it, every rank posting them in
    number order) make the prefill ranks send and its own ranks receive the blocks it lacks, resharded by
    `plan_transfers`.
    With `kv_pieces`, pieces of a long prompt (`PrefillPiece`) come and move before step 2's answer, while
    its later chunks are prefilled; the answer's transfer moves the rest.
 4. decode reads the rest of the prefill stream (in the background): the prefill replica waits for
    its ranks to report the send done (the ack), then frees the blocks; or when the lease ends.
 5. decode: the first token goes to the caller as soon as step 2 answers, while step 3 moves the KV;
    then the request joins the running batch from that token and the rest streams to the caller.
A failure before step 5 is retried once (a new prefill, maybe on another replica), unless it is this
decode replica's own (a dead rank); a prefill replica that died (or whose engine died) before answering
(`PrefillUnavailable`) is retried at once on this replica's own engine, which prefills the prompt itself,
rather than through the pool (which, with no other live replica, would wait for a replacement); a
cancelled caller aborts both sides, and so does a handoff whose prefill the router abandoned (its client
gone) before a prefill rank began sending it (`PrefillAbandoned`: what arrived is discarded). Every path frees
the blocks on both sides, no block is freed while a transfer may still write into it, and a prefill replica
frees no block that one of its ranks has begun sending (`KVTransferAgent.abandon`).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import os
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Awaitable, Callable

from engine.async_engine import AsyncEngine, staged_fanout
from engine.llm_engine import LLMEngine, RequestOutput
from workers.executor import ExecutorError
from workers.kv_transfer.plan import RankShard, Transfer, plan_transfers, share_a_gpu
from workers.kv_transfer.transport import KVTransferError, PairSpec, RecvResult, SendResult
from workers.sampling_params import SamplingParams
from engine.scheduler import QueueFullError
from workers.scheduler_output import SampledToken

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    request_id: str
    decode_replica: str
    block_ids: list[int]
    num_hit_blocks: int  # leading blocks the decode side holds already (prefix cache): not sent
    shards: list[RankShard]
    # Prefill replicas whose rank handles the decode side holds already: they need not travel again
    # (pickling actor handles costs a registration with Ray's ownership tables per request).
    known_peers: frozenset[str] = frozenset()
    # Ask for the prompt's pieces (`PrefillPiece`) while it is prefilled over several steps, so that its KV moves
    # while the later chunks compute (`DecodeReplica.kv_pieces`).
    pieces: bool = False


@dataclass
class PrefillPiece:
    """A prompt that its prefill replica computes over several steps (chunked prefill), part-way: its first
    `len(block_ids)` blocks are full and computed, and may move while the later chunks run (`Reservation.pieces`).
    Only these blocks: the next chunk writes into the partial block after them. A decode replica admits the request
    only once every piece and the rest (`PrefillReady`) have arrived."""

    prefill_replica: str
    block_ids: list[int]
    epoch: int  # the prefill's preemptions so far: a preemption frees its blocks, so an older epoch's pieces are stale
    shards: list[RankShard] = field(default_factory=list)
    rank_handles: list = field(default_factory=list)  # as PrefillReady's: only on a replica's first item to a decode one


@dataclass
class PrefillReady:
    """The prefill replica's answer. `finished` when the first token already ended the request."""

    prefill_replica: str
    output: RequestOutput  # the first token (text, logprobs); finish_reason "handoff" unless finished
    first: SampledToken | None = None
    block_ids: list[int] = field(default_factory=list)
    shards: list[RankShard] = field(default_factory=list)
    rank_handles: list = field(default_factory=list)  # Ray actor handles of the prefill ranks ([]: already known)
    # This prefill's key on the prefill ranks (their sends, acks and abandons): not the request id, which a retry
    # reuses, maybe on the same replica, where an earlier attempt's abandon must not touch the new one's KV.
    handoff_id: str = ""
    epoch: int = 0  # as PrefillPiece's, when the prompt ended

    @property
    def finished(self) -> bool:
        return self.output.finish_reason != "handoff"


@dataclass
class TransferStats:
    bytes: int
    seconds: float
    blocks: int
    start: float = 0.0  # wall clock (time.time()) when the transfer began, after the pair's lock was taken
    end: float = 0.0  # wall clock when every rank of both sides had finished it
    send_start: float = 0.0  # wall clock when the first prefill rank began its send (the Ray call's hop before it)
    send_end: float = 0.0  # ... and when the last one had sent everything
    recv_start: float = 0.0  # wall clock when the first decode rank began its receive,
    recv_posted: float = 0.0  # when the last one had posted its receives and queued its scatters,
    recv_end: float = 0.0  # and when the last one had its blocks

    @staticmethod
    def combined(parts: list["TransferStats"]) -> "TransferStats":
        """One handoff's transfers (its pieces and the rest) as one: the bytes and blocks of all, from the first
        one's start to the last one's end."""
        if len(parts) == 1:
            return parts[0]
        start, end = min(p.start for p in parts), max(p.end for p in parts)
        ranks = [p for p in parts if p.send_start]
        first = lambda name: min(getattr(p, name) for p in ranks) if ranks else 0.0  # noqa: E731
        last = lambda name: max(getattr(p, name) for p in ranks) if ranks else 0.0  # noqa: E731
        return TransferStats(sum(p.bytes for p in parts), end - start, sum(p.blocks for p in parts), start, end,
                             first("send_start"), last("send_end"), first("recv_start"), last("recv_posted"),
                             last("recv_end"))

    def stamps(self) -> dict[str, float]:
        """The push's stamps for the request's timeline (router/metrics.py STAGES); the ranks' own where known."""
        ranks = dict(kv_send_start=self.send_start, kv_send_end=self.send_end, kv_recv_start=self.recv_start,
                     kv_recv_posted=self.recv_posted, kv_recv_end=self.recv_end) if self.send_start else {}
        return {"kv_push_start": self.start, "kv_push_end": self.end, **ranks}


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """Conditional disaggregation, as Dynamo and llm-d do it: when a decode replica prefills a prompt
    itself instead of handing it to the prefill pool. A handoff has a fixed cost (a prefill-pool hop,
    a reservation, a KV push, the first token's trip back) that a short prompt's own compute does not
    repay; and a decode replica with nothing running has no decodes that the prefill could delay."""

    max_tokens: int = 0  # prompt tokens not already cached here: at most this many, prefill here
    when_idle: bool = False  # nothing running or queued here: prefill here if one step holds the prompt

    def prefill_here(self, uncached_tokens: int, busy: bool, step_tokens: int) -> bool:
        if uncached_tokens <= self.max_tokens:
            return True
        return self.when_idle and not busy and uncached_tokens <= step_tokens


class PrefillUnavailable(ConnectionError):
    """The prefill replica that took a request died, or its engine did, before it answered: the prompt
    never ran there. The pool's client (router/pools.py) raises it for the transport's own errors."""


class PrefillAbandoned(Exception):
    """A prefill rank's send found the handoff abandoned before it began (the router gave the request up: its
    client left): its blocks may have been reused, so the KV that arrived is junk and is thrown away with the
    reservation. Not retried: the request is being cancelled (and it is no `KVTransferError`: the pair is fine)."""


PrefillClient = Callable[[str, list[int], SamplingParams, int, Reservation], AsyncIterator[PrefillReady]]

# What `DecodeReplica.generate` yields first for a router-driven prefill: its blocks are reserved, so the router
# may stream token 1 as soon as the prefill answers it (a full decode replica raises QueueFullError instead).
RESERVED = "reserved"


class RouterPrefill:
    """A prefill the router started itself (`PrefillReplica.prefill_first`), concurrently with its call to this
    decode replica, as the decode side sees it: shaped like the prefill client's stream (its answer, then the
    end), so the handoff's code takes either. `answer` resolves to the same `PrefillReady` the router streams
    token 1 from. Closed before the KV moved (the request given up, failed or cancelled), it has the prefill
    ranks abandon the blocks (`KVTransferAgent.abandon`): the prefill replica frees them at once, not at the
    lease (or, on a rank whose send of them has begun, once that send has ended); an answer still on its way is
    abandoned when it lands."""

    def __init__(self, answer: Awaitable[PrefillReady], request_id: str):
        self._answer = asyncio.ensure_future(answer)
        self.request_id = request_id
        self.moved = False  # set once the KV is here: nothing to abandon
        self._read = False
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> PrefillReady:
        if self._read:
            raise StopAsyncIteration
        self._read = True
        return await asyncio.shield(self._answer)  # a cancelled reader leaves the answer to `aclose`

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.moved:
            return
        if self._answer.done():
            self._abandon(self._answer)
        else:
            self._answer.add_done_callback(self._abandon)

    def _abandon(self, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return  # no answer: the prefill replica freed its blocks itself
        abandon_prefill(answer.result())


def abandon_prefill(ready: PrefillReady) -> None:
    """Have a router-driven prefill's ranks give up waiting for the send: its replica frees the blocks now. Safe
    whoever else may be moving them: on a rank whose send of them has begun this is a no-op (the send's end
    frees them), and a send that begins after it tells its decode replica, which throws away what it received
    (`KVTransferAgent.abandon`, `PrefillAbandoned`)."""
    if ready.finished:
        return

    def submit() -> None:
        for handle in ready.rank_handles:
            try:
                handle.kv.remote("abandon", ready.handoff_id)  # fire and forget: a dead rank frees nothing anyway
            except Exception:  # noqa: BLE001
                log.debug("abandoning %s on a prefill rank failed", ready.handoff_id, exc_info=True)

    # From a thread without the (maybe cancelled) request's context, as the transfer's own calls (`_transfer`).
    threading.Thread(target=submit, name="tandem-abandon", daemon=True).start()


def _ray_executor(engine: LLMEngine):
    from cluster.ray_executor import RayExecutor

    if not isinstance(engine.executor, RayExecutor):
        raise TypeError("pool replicas run their ranks as Ray actors (RayExecutor), so the peer pool can reach them")
    return engine.executor


SENT_POLL_S = 0.05  # longest a round of the send watcher waits for news (a request added meanwhile waits this)


# A router-driven prefill started early over the router's lane (router/prefill_lane.py) waits this long for its
# Serve call (`prefill_first`) to take it over; one not taken by then is given up and its blocks freed. The call
# normally comes within milliseconds; it comes later only when Serve held it back (the replica at its
# max_ongoing_requests), or never (it went to another replica, or the client left before it was sent).
FIRST_CLAIM_S = 10.0


@dataclass
class _FirstRun:
    """One router-driven prefill on this replica: started by its Serve call or, earlier, by the router's lane."""
    task: asyncio.Task  # `_run`: the prompt and token 1 (a PrefillReady)
    received: float  # time.time() of the first of the lane's start and the Serve call
    claimed: bool = False  # the Serve call has taken it: it owns the blocks from here on
    on_claim: list[Callable[[], None]] = field(default_factory=list)  # the lane's notices, told when claimed
    expiry: asyncio.TimerHandle | None = None  # FIRST_CLAIM_S, while not claimed


@dataclass
class _AwaitingSend:
    future: asyncio.Future  # True once every rank sent the handoff's KV (or it was abandoned); False at the lease
    deadline: float  # time.monotonic() of the lease's end
    ranks: set[int] = field(default_factory=set)  # the ranks that have sent it


class PrefillReplica:
    def __init__(self, engine: LLMEngine, replica_id: str | None = None):
        self.replica_id = replica_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.llm_engine = engine
        self.async_engine = AsyncEngine(engine)
        self.executor = _ray_executor(engine)
        self.executor.kv_setup("prefill")
        self.shards: list[RankShard] = self.executor.kv_call("get_shard")
        self.lease_s = engine.config.cache.kv_lease_seconds
        self._holding: set[asyncio.Task] = set()  # router-driven prefills' blocks, held until sent (`prefill_first`)
        # Requests whose blocks are held until every rank has sent them: one watcher asks the ranks about all of
        # them at once (`_watch_sent`), rather than a thread and a rank-actor thread blocked per request.
        self._awaiting_send: dict[str, _AwaitingSend] = {}  # by handoff id
        self._watcher: asyncio.Task | None = None
        self._handoffs = itertools.count()  # numbers this replica's prefills (`PrefillReady.handoff_id`)
        self._first_runs: dict[str, _FirstRun] = {}  # router-driven prefills in progress, by request id
        self._first_taken: collections.deque[str] = collections.deque(maxlen=1024)  # the newest runs calls took

    @property
    def alive(self) -> bool:
        """False once this replica's engine or one of its ranks failed: it serves nothing more."""
        return self.async_engine.alive and self.executor.alive

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                      reservation: Reservation) -> AsyncIterator[PrefillPiece | PrefillReady]:
        """The decode replica's call: with `reservation.pieces`, the prompt's pieces as its steps complete them;
        the answer; then (the stream held open) the blocks held until sent."""
        tell_handles = self.replica_id not in reservation.known_peers
        ready: PrefillReady | None = None
        async with contextlib.aclosing(self._items(request_id, prompt_token_ids, params, priority,
                                                   reservation.pieces)) as items:
            async for item in items:
                if isinstance(item, PrefillReady):
                    ready = item
                    continue
                item.shards = self.shards
                if tell_handles:
                    item.rank_handles, tell_handles = list(self.executor.workers), False
                yield item
        if ready.finished:
            yield ready
            return
        try:
            ready.shards = self.shards
            if tell_handles:
                ready.rank_handles = list(self.executor.workers)
            yield ready
            await self._wait_sent(ready.handoff_id)
        finally:
            # Delivered, given up on (the decode side closed the stream) or failed: free the held blocks,
            # even if this engine has died meanwhile.
            await self.async_engine.cleanup(self.llm_engine.release, request_id)

    async def prefill_first(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            priority: int) -> PrefillReady:
        """The router's call (router-driven prefill, docs/architecture.md): the answer at once, to the router,
        which streams token 1 to the client and hands the answer to the decode replica it called meanwhile.
        The blocks stay held here, in the background, until every rank has sent them (the decode replica
        drives that), or they are abandoned (by the decode replica or the router, `KVTransferAgent.abandon`: a rank
        whose send of them has begun acks only when that send ends), or the lease ends.
        A cancelled call (the client gone while prefilling) frees them at once."""
        run = self._first_runs.get(request_id)
        if run is None or run.claimed:  # not started by the lane (or a second call under the same id: its own run)
            run = self._first_runs[request_id] = _FirstRun(
                asyncio.ensure_future(self._run(request_id, prompt_token_ids, params, priority)), time.time())
        self._claim(request_id, run)
        try:
            ready = await run.task  # cancelled (the client gone): the run is too, and frees its blocks
        finally:
            if self._first_runs.get(request_id) is run:
                del self._first_runs[request_id]
        ready.output.timeline = {**(ready.output.timeline or {}), "prefill_received": run.received}
        if ready.finished:
            return ready
        try:
            ready.shards = self.shards
            ready.rank_handles = list(self.executor.workers)  # the router cannot know which decode replica has them
        except BaseException:
            await self.async_engine.cleanup(self.llm_engine.release, request_id)
            raise
        task = asyncio.ensure_future(self._hold(request_id, ready.handoff_id))
        self._holding.add(task)
        task.add_done_callback(self._holding.discard)
        ready.output.timeline["prefill_returned"] = time.time()
        return ready

    def start_first(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                    on_claim: Callable[[], None] | None = None) -> asyncio.Task | None:
        """The router's lane starts a router-driven prefill before its Serve call (`prefill_first`) arrives, which
        then takes the run over. The run's task (its PrefillReady) is returned; `on_claim` is called once the Serve
        call has taken it, from when on the answer that call returns is the one the decode replica gets. A run not
        taken within FIRST_CLAIM_S, or dropped by the router (`drop_first`), is given up and its blocks freed.
        None for a request whose Serve call has already taken a run here (a start that came late) or whose id the
        engine has now: a second run under one id would be refused, and its clean-up could abort the first's."""
        run = self._first_runs.get(request_id)
        if run is None:
            if request_id in self._first_taken or request_id in self.llm_engine.requests:
                return None  # a start that came after its Serve call's run (or under an id in use): never a second
            run = self._first_runs[request_id] = _FirstRun(
                asyncio.ensure_future(self._run(request_id, prompt_token_ids, params, priority)), time.time())
            run.expiry = asyncio.get_running_loop().call_later(FIRST_CLAIM_S, self.drop_first, request_id)
        if on_claim is not None:
            if run.claimed:
                on_claim()
            else:
                run.on_claim.append(on_claim)
        return run.task

    @property
    def unclaimed_first_runs(self) -> int:
        return sum(not run.claimed for run in self._first_runs.values())

    def drop_first(self, request_id: str) -> None:
        """Give up a lane-started run that no Serve call has taken: cancelled if still running (the engine aborts
        the request), its blocks freed if it has answered. A run already taken belongs to its call: untouched."""
        run = self._first_runs.get(request_id)
        if run is None or run.claimed:
            return
        del self._first_runs[request_id]
        if run.expiry is not None:
            run.expiry.cancel()
        if not run.task.done():
            run.task.cancel()
        elif not run.task.cancelled() and run.task.exception() is None and not run.task.result().finished:
            task = asyncio.ensure_future(self.async_engine.cleanup(self.llm_engine.release, request_id))
            self._holding.add(task)
            task.add_done_callback(self._holding.discard)

    def _claim(self, request_id: str, run: _FirstRun) -> None:
        run.claimed = True
        self._first_taken.append(request_id)
        if run.expiry is not None:
            run.expiry.cancel()
        for notify in run.on_claim:
            try:
                notify()
            except Exception:  # noqa: BLE001 - a lane gone meanwhile: the router takes token 1 from the answer
                log.debug("telling the lane of a claim failed", exc_info=True)
        run.on_claim.clear()

    async def _run(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   priority: int) -> PrefillReady:
        """Run the prompt and sample token 1; unless that ended the request, its blocks stay held (the caller
        frees them). A cancelled or failed run frees them itself."""
        ready = None
        async with contextlib.aclosing(self._items(request_id, prompt_token_ids, params, priority, False)) as items:
            async for ready in items:
                pass
        return ready

    async def _items(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                     pieces: bool) -> AsyncIterator[PrefillPiece | PrefillReady]:
        """`_run`'s answer, last; before it, with `pieces`, a `PrefillPiece` for each step that completed more of
        the prompt's blocks. Closed early, the request is aborted (its blocks freed)."""
        first: RequestOutput | None = None
        async with contextlib.aclosing(self.async_engine.generate(request_id, prompt_token_ids, params, priority,
                                                                  handoff=True, pieces=pieces)) as outputs:
            async for out in outputs:
                if out.kv_blocks is not None and not out.finished:
                    yield PrefillPiece(self.replica_id, out.kv_blocks, out.kv_epoch)
                else:
                    first = out
        ready = PrefillReady(self.replica_id, first)
        if ready.finished:
            yield ready
            return
        try:
            ready.first = SampledToken(first.token_ids[0], *_first_logprobs(first))
            # Read here, not on the engine thread (which may be inside a step): the engine held the blocks
            # before it returned this output, and held blocks do not change until `release`.
            ready.block_ids, ready.epoch = self.llm_engine.held_kv(request_id)
            ready.handoff_id = f"{request_id}#{next(self._handoffs)}"
        except BaseException:
            await self.async_engine.cleanup(self.llm_engine.release, request_id)
            raise
        yield ready

    async def _wait_sent(self, handoff_id: str) -> None:
        """The decode replica drives our ranks' send: hold the blocks until every rank reports it done (or
        abandoned), at most the lease. Raises what the ranks raised (a dead rank)."""
        waiting = self._awaiting_send[handoff_id] = _AwaitingSend(asyncio.get_running_loop().create_future(),
                                                                   time.monotonic() + self.lease_s)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_sent())
        try:
            sent = await waiting.future
        finally:
            if self._awaiting_send.get(handoff_id) is waiting:
                del self._awaiting_send[handoff_id]
        if not sent:
            log.warning("handoff %s: KV not collected within the %.0fs lease; freeing it", handoff_id, self.lease_s)

    async def _watch_sent(self) -> None:
        """While requests wait for their send: ask every rank which of them it has sent (`sent_among`, one call
        per rank for all of them, waiting at most SENT_POLL_S for news), and end each wait once every rank has
        sent it, or at its lease. A request added meanwhile is asked about in the next round."""
        while self._awaiting_send:
            ids = list(self._awaiting_send)
            try:
                per_rank = await asyncio.to_thread(self.executor.kv_call, "sent_among", ids, SENT_POLL_S)
            except Exception as e:  # noqa: BLE001 - a dead rank: every wait ends with its error (the blocks are freed)
                for waiting in self._awaiting_send.values():
                    if not waiting.future.done():
                        waiting.future.set_exception(e)
                self._awaiting_send.clear()
                return
            for rank, done in enumerate(per_rank):
                for rid in done:
                    waiting = self._awaiting_send.get(rid)
                    if waiting is not None:
                        waiting.ranks.add(rank)
            now = time.monotonic()
            for rid, waiting in list(self._awaiting_send.items()):
                if len(waiting.ranks) == len(per_rank) or now >= waiting.deadline:
                    if not waiting.future.done():
                        waiting.future.set_result(len(waiting.ranks) == len(per_rank))
                    del self._awaiting_send[rid]

    async def _hold(self, request_id: str, handoff_id: str) -> None:
        try:
            await self._wait_sent(handoff_id)
        except Exception:  # noqa: BLE001 - a dead rank: the blocks are freed below all the same
            log.warning("request %s: waiting for the KV send failed", request_id, exc_info=True)
        finally:
            await self.async_engine.cleanup(self.llm_engine.release, request_id)


def streamable(handoff: RequestOutput) -> RequestOutput:
    """The prefill side's first-token output as the client's first stream item: not finished."""
    return replace(handoff, finish_reason=None, stop_reason=None, prompt_token_ids=[])


def _first_logprobs(out: RequestOutput) -> tuple[float, list[tuple[int, float]] | None]:
    """The first token's logprob entry, in the form the decode side's engine rebuilds it from."""
    if out.logprobs is None:
        return 0.0, None
    entry = out.logprobs[0]
    return entry[out.token_ids[0]], sorted(entry.items(), key=lambda kv: -kv[1])


# Transfers a decode replica keeps in flight at once on one prefill/decode pair: the served `kv_transfers_in_flight`
# (router/config.py, the same default and bounds), `DecodeReplica(kv_transfers_in_flight=...)`. Several in flight on
# one pair share its one communicator, whose kernels NCCL runs in order on one stream: they overlap the host's work
# (Ray round trips, the wait for a turn to post, gathers and scatters on the rank threads' own CUDA streams), not the
# wire. Each waits on a thread of every rank actor of both replicas (16 each, `RayExecutor`) for its turn to post
# (`_PostOrder`), and the transfer whose turn it is must find a thread free: with 16 or more waiting on one pair it
# might not, and would wait out the transfer timeout. Hence at most 8, which leaves threads for the ranks' other KV
# calls (a prefill replica's `sent_among` polls, other pairs' transfers).
# The default is 1 because every served PD measurement so far was made with 1 in flight. Several in flight have
# passed on GPUs (2 x H100, 2026-11-27): tests/gpu/test_kv_transfer_gpu.py -k in_flight_from_threads (serial, 4 and
# 8 in flight with a busy GPU: every block bit for bit, none unfinished) and scripts/diagnose_pd_in_flight.py
# --in-flight 4 --rounds 3 (0 transfers failed, 0 wrong blocks, 0 requests with other tokens). The earlier failure
# with 4 (tests/gpu/test_disagg_gpu.py [whole] on 2 x H200: other tokens for one prompt, then no end in 70 s) is
# believed to be a bf16 near-tie (the reference decodes the four prompts at batch 4, the handoff run at other batch
# sizes) and a cold-start timeout, not the transport: the [in-flight-4-fp32] case tests the handoff without near-ties.
TRANSFERS_IN_FLIGHT_DEFAULT = 1
TRANSFERS_IN_FLIGHT_MAX = 8


def check_transfers_in_flight(n: int) -> int:
    """`n` if it is a valid `kv_transfers_in_flight`, else a ValueError naming the setting."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= TRANSFERS_IN_FLIGHT_MAX:
        raise ValueError(f"kv_transfers_in_flight must be an integer from 1 to {TRANSFERS_IN_FLIGHT_MAX}, not {n!r}")
    return n


class _PairState:
    """A pair group this decode replica built or warmed: it numbers the pair's transfers (the order every rank
    posts them in, `_PostOrder`) and bounds how many are in flight. A new object per group: a rebuilt group counts
    from 0 again, and a failure of a transfer on an older one does not drop it (`DecodeReplica._drop_pair`)."""

    def __init__(self, in_flight: int) -> None:
        self.seqs = itertools.count()
        self.slots = asyncio.Semaphore(in_flight)  # the replica's `kv_transfers_in_flight`


class _Pieces:
    """One handoff attempt's KV in pieces (`Reservation.pieces`): each `PrefillPiece` starts the transfer of the
    blocks it adds, while the prompt's later chunks compute; `finish` moves the rest once the prefill has answered
    and waits for everything. Every piece writes into the reservation: it is freed (`DecodeReplica._give_up`) only
    after `drain`. Pieces of an older epoch (a preemption on the prefill side freed their blocks, which may have been
    reused while they were read) are overwritten: the next transfer, once they have landed, sends every block again."""

    def __init__(self, replica: "DecodeReplica", reservation: Reservation):
        self.replica, self.res = replica, reservation
        self.sent = reservation.num_hit_blocks  # blocks [hits, sent) are here or on their way
        self.epoch = 0
        self.tasks: list[asyncio.Task] = []
        self.numbered: list[asyncio.Event] = []  # set once each piece's transfer has its number on the pair (or ended)
        self.landed_stats: list[TransferStats] = []  # of the pieces landed, stale ones too (their bytes moved as well)

    async def add(self, piece: PrefillPiece) -> None:
        await self.check()
        self.replica._peer_handles(piece)
        await self._rebase(piece.epoch)
        if len(piece.block_ids) <= self.sent:
            return
        blocks, self.sent = range(self.sent, len(piece.block_ids)), len(piece.block_ids)
        numbered = asyncio.Event()
        task = asyncio.ensure_future(self.replica._transfer(piece, self.res, blocks, piece=True, numbered=numbered))
        task.add_done_callback(lambda _: numbered.set())
        self.tasks.append(task)
        self.numbered.append(numbered)

    async def finish(self, ready: PrefillReady) -> TransferStats:
        """The rest of the prompt's blocks (and the handoff's ack: `KVTransferAgent.send` claims it), beside the
        pieces still on their way; then all of them. Raises the first failure, once nothing writes any more."""
        await self._rebase(ready.epoch)
        # Numbered after every piece, so every rank posts it, and its ack, after the pieces' gathers: the prefill
        # replica frees the blocks on that ack, and a piece numbered later could still be reading them.
        for numbered in self.numbered:
            await numbered.wait()
        last = await self.replica._transfer(ready, self.res, range(min(self.sent, len(ready.block_ids)), len(ready.block_ids)))
        await self.landed()
        return TransferStats.combined(self.landed_stats + [last])

    async def check(self) -> None:
        """Raise a piece's failure as soon as it is known (a dead decode rank fails the request, a failed pair
        re-prefills it), not after the rest of the prompt, nor as a consequence of it (its rank handles forgotten)."""
        if any(t.done() and (t.cancelled() or t.exception() is not None) for t in self.tasks):
            await self.landed()

    async def landed(self) -> None:
        """Wait for every piece on its way (never cancelling one: posted messages cannot be taken back); their stats
        join `landed_stats`. Raises the first failure."""
        tasks, self.tasks = self.tasks, []
        if not tasks:
            return
        await asyncio.wait(tasks)
        failed = [t.exception() for t in tasks if t.cancelled() or t.exception() is not None]
        if failed:
            raise failed[0] if failed[0] is not None else asyncio.CancelledError()
        self.landed_stats += [t.result() for t in tasks]

    async def drain(self) -> None:
        """`landed`, its outcome ignored: before the reservation is freed."""
        with contextlib.suppress(BaseException):
            await self.landed()

    async def _rebase(self, epoch: int) -> None:
        if epoch != self.epoch:
            await self.landed()  # stale pieces land before their blocks are sent again over them
            self.sent, self.epoch = self.res.num_hit_blocks, epoch


class DecodeReplica:
    def __init__(self, engine: LLMEngine, prefill: PrefillClient, replica_id: str | None = None, max_attempts: int = 2,
                 local_prefill: LocalPrefillPolicy | None = None, kv_pieces: bool = False,
                 kv_transfers_in_flight: int = TRANSFERS_IN_FLIGHT_DEFAULT):
        # Checked before anything starts (the config checks it too; tests and scripts build replicas directly).
        self.kv_transfers_in_flight = check_transfers_in_flight(kv_transfers_in_flight)
        if engine.config.parallel.sequence_parallel_size > 1:
            # KV arrives into one block table that every rank holds in full; SP splits blocks over ranks.
            raise ValueError("decode replicas do not support sequence_parallel_size > 1 (only prefill replicas use SP)")
        self.replica_id = replica_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.llm_engine = engine
        self.async_engine = AsyncEngine(engine)
        # Any executor: the decode side drives every transfer, so its ranks need not be reachable by the
        # peer (one rank runs in this process; more are Ray actors). The prefill side's must be (above).
        self.executor = engine.executor
        self.executor.kv_setup("decode")
        self.shards: list[RankShard] = self.executor.kv_call("get_shard")
        self.prefill = prefill
        self.max_attempts = max_attempts
        self.transfer_timeout_s = engine.config.cache.kv_transfer_timeout_seconds
        # Ask prefill replicas for a long prompt's pieces as its chunks compute (`PrefillPiece`), and move them then.
        self.kv_pieces = kv_pieces
        self._pair_locks: dict[str, asyncio.Lock] = {}  # held while a pair's group is built and a transfer numbered
        self._peer_ranks: dict[str, list] = {}  # prefill replica id -> its rank actor handles
        # Pairs whose group this client built (no `has_group` round trip per handoff), with their numbering; a failed
        # transfer drops the pair on both sides and here (`_drop_pair`).
        self._joined: dict[str, _PairState] = {}
        self._dropping: dict[str, list] = {}  # pair id -> its prefill ranks' drops, not yet known to have run
        self._background: set[asyncio.Task] = set()  # prefill streams being read to their end (step 4)
        self.transfers: list[TransferStats] = []  # for metrics and tests
        self.on_transfer: Callable[[TransferStats], None] | None = None
        self.local_prefill = local_prefill or LocalPrefillPolicy()
        self.prefill_sites = {"local": 0, "remote": 0}  # requests by where their prompt ran
        self.on_prefill_site: Callable[[str], None] | None = None
        self.prefill_fallbacks = 0  # requests whose prefill replica died and that this engine then ran whole

    @property
    def alive(self) -> bool:
        """False once this replica's engine or one of its ranks failed: it serves nothing more."""
        return self.async_engine.alive and self.executor.alive

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, prefilled: Awaitable[PrefillReady] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs. `prefilled`: the answer of a prefill the router started itself (router-driven
        prefill): the request is handed off from it (no local-prefill choice, no prefill call of its own on the
        first attempt); `RESERVED` is yielded first, once the blocks are reserved, and token 1, which the router
        streams itself, is not yielded again."""
        # This replica's stages of the request (wall clock), merged into its last output's timeline.
        timeline = {"replica_received": time.time()}
        if prefilled is not None:
            self._count_site("remote")
            async for out in self._handoff(request_id, prompt_token_ids, params, priority, timeline,
                                           RouterPrefill(prefilled, request_id)):
                yield out
            return
        site = "local" if self._prefill_here(prompt_token_ids) else "remote"
        self._count_site(site)
        if site == "local":  # the engine runs the whole request, as a colocated replica would
            async for out in self._local(request_id, prompt_token_ids, params, priority, timeline):
                yield out
            return
        async for out in self._handoff(request_id, prompt_token_ids, params, priority, timeline):
            yield out

    def _count_site(self, site: str) -> None:
        self.prefill_sites[site] += 1
        if self.on_prefill_site is not None:
            self.on_prefill_site(site)

    async def _handoff(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                       timeline: dict[str, float], routed: RouterPrefill | None = None) -> AsyncIterator[RequestOutput]:
        """A handed-off request: steps 1-5, retried as the module's docstring says. `routed`: the router's own
        prefill, which the first attempt takes instead of calling the prefill pool."""
        sent: SampledToken | None = None  # the first token, streamed to the client before its KV moved
        for attempt in range(1, self.max_attempts + 1):
            try:
                if attempt == 1 and routed is not None:
                    try:
                        reservation = await self._reserve(request_id, prompt_token_ids, params, priority, timeline)
                    except BaseException:
                        await asyncio.shield(_close(routed))  # the prefill side frees its blocks at once
                        raise
                    stream, pieces = routed, _Pieces(self, reservation)  # a unary answer: no pieces
                    try:
                        yield RESERVED  # the router may stream token 1 now, from the prefill's answer
                        ready = await anext(routed)
                    except BaseException:
                        await asyncio.shield(self._give_up(request_id, routed))
                        raise
                    timeline.update(ready.output.timeline or {}, prefill_answered=time.time())
                    if not ready.finished:
                        sent = ready.first  # the router has streamed token 1 itself
                else:
                    ready, reservation, stream, pieces = await self._remote_prefill(request_id, prompt_token_ids,
                                                                                    params, priority, timeline)
                if ready.finished:  # the first token ended the request: no KV to move
                    await self._give_up(request_id, stream, pieces)
                    if sent is not None:
                        raise RuntimeError(f"request {request_id}: its re-prefill ended where the first did not")
                    ready.output.timeline = timeline
                    yield ready.output
                    return
                if sent is None:
                    sent = ready.first
                    try:
                        yield streamable(ready.output)  # the client sees token 1 while its KV moves
                    except BaseException:  # the client went away here: let go of both sides' blocks
                        await asyncio.shield(self._give_up(request_id, stream, pieces))
                        raise
                timeline["kv_queued"] = time.time()
                moved = await self._move_kv(request_id, ready, stream, pieces)
                timeline.update(moved.stamps())
                break
            except (KVTransferError, ConnectionError, RuntimeError) as e:
                # A new prefill may fix a failed prefill replica or transfer; not a full or dead decode replica.
                if isinstance(e, QueueFullError) or not self.alive:
                    raise
                if isinstance(e, PrefillUnavailable) and sent is None:
                    # Its prefill replica is gone: this engine runs the whole request now, rather than the pool
                    # holding it until Serve has noticed the death and started a replacement (seconds). On the
                    # last attempt too: a routed prefill that failed, then a re-prefill that found no replica.
                    log.warning("%s; prefilling on this decode replica", e)  # e names the request
                    self.prefill_fallbacks += 1
                    async for out in self._local(request_id, prompt_token_ids, params, priority, timeline):
                        yield out
                    return
                if attempt == self.max_attempts:
                    raise
                log.warning("request %s: handoff attempt %d failed (%s); re-prefilling", request_id, attempt, e)
        # The prompt's logprobs (vLLM's prompt_logprobs) were computed where the prompt ran: the prefill side.
        # They went out with token 1 and go again with the last output, which a non-streaming client reads.
        prompt_lps = ready.output.prompt_logprobs
        # A re-prefill computes the same prompt KV; the request goes on from the token already sent.
        stream_out = self.async_engine.start(request_id, sent)
        try:
            first = await anext(stream_out)  # token 1 again, now in this engine: already streamed
            if first.finished:  # only the end is news
                yield replace(first, new_token_ids=[], new_text="", timeline={**timeline, **(first.timeline or {})},
                              prompt_logprobs=prompt_lps if prompt_lps is not None else first.prompt_logprobs)
                return
            async for out in stream_out:
                if out.finished:
                    out.timeline = {**timeline, **(out.timeline or {})}
                    if prompt_lps is not None:  # this engine ran none of the prompt: its entries are empty
                        out.prompt_logprobs = prompt_lps
                yield out
        finally:
            await stream_out.aclose()  # a client gone mid-stream: the engine aborts the request now

    async def generate_many(self, items: list[tuple[str, list[int], SamplingParams, int]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several requests ((request_id, prompt, params, priority): a client's prompts and `n` choices) as one
        stream of (index, output). The first request of each distinct prompt goes the usual way (handed off
        or prefilled here); the others of that prompt start once their leader's KV is in this engine (its
        second output, the first from this engine's own step) and run here, finding the prompt's full
        blocks in the prefix cache: the shared prompt is prefilled once. Closing the stream aborts them all."""
        opened: list[str] = []  # followers added to this engine at once (their streams may never start)
        finished: set[str] = set()

        async def start(indices: list[int], leader: RequestOutput | None) -> list[AsyncIterator[RequestOutput]]:
            if leader is None or (leader.finished and len(leader.token_ids) <= 1):
                # Leaders; or followers of a leader whose first token ended it (its KV never came here).
                return [self.generate(*items[i]) for i in indices]
            streams = await self.async_engine.open_many([items[i] for i in indices])
            opened.extend(items[i][0] for i in indices)
            return streams

        try:
            async with contextlib.aclosing(staged_fanout([item[1] for item in items], start, lambda out, seen: seen >= 2)) as merged:
                async for i, out in merged:
                    if out.finished:
                        finished.add(items[i][0])
                    yield i, out
        finally:
            self.async_engine.abort_soon([rid for rid in opened if rid not in finished])

    async def _local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                     timeline: dict[str, float]) -> AsyncIterator[RequestOutput]:
        """The whole request on this replica's engine (prefill too), as a colocated replica runs it."""
        async for out in self.async_engine.generate(request_id, prompt_token_ids, params, priority):
            if out.finished:
                out.timeline = {**timeline, **(out.timeline or {})}
            yield out

    def _prefill_here(self, prompt: list[int]) -> bool:
        """Read from this thread while the engine thread steps: the prefix lookup only reads the
        cache's dict, and a slightly stale load is fine for a routing choice."""
        engine = self.llm_engine
        uncached = len(prompt) - engine.block_manager.cached_prefix_tokens(prompt)
        busy = engine.scheduler.has_work or engine.scheduler.has_leases
        return self.local_prefill.prefill_here(uncached, busy, engine.config.scheduler.max_num_batched_tokens)

    async def _remote_prefill(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                              timeline: dict[str, float]) -> tuple[PrefillReady, Reservation, AsyncIterator, "_Pieces"]:
        """Steps 1-2: reserve blocks here, have the prefill pool run the prompt (with `kv_pieces`, moving its pieces
        as they come). On failure or cancellation both sides have let go of the request's blocks, or are letting go
        of them, when this raises; otherwise the caller owns the reservation, the prefill stream and the pieces on
        their way (`_move_kv` or `_give_up`). Stamps "reserved" and "prefill_answered" into `timeline`, with the
        prefill engine's own stages."""
        reservation = await self._reserve(request_id, prompt, params, priority, timeline)
        stream = self.prefill(request_id, prompt, params, priority, reservation)
        pieces = _Pieces(self, reservation)
        try:
            items = aiter(stream)
            while isinstance(ready := await anext(items), PrefillPiece):
                await pieces.add(ready)
            await pieces.check()
            if not ready.finished:
                self._peer_handles(ready)
        except BaseException:
            # Shielded: a second cancellation must not leave the reservation, the prefill's KV or a piece behind.
            await asyncio.shield(self._give_up(request_id, stream, pieces))
            raise
        timeline.update(ready.output.timeline or {}, prefill_answered=time.time())  # a retry's stamps replace the first's
        return ready, reservation, stream, pieces

    async def _reserve(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                       timeline: dict[str, float]) -> Reservation:
        """Step 1: this replica's blocks for the prompt and one token (QueueFullError when full). Stamps "reserved"."""
        if not self.executor.alive:
            raise ExecutorError(f"decode replica {self.replica_id} lost its ranks; it serves nothing more")
        engine = self.llm_engine
        reserved = await self.async_engine.call_for(request_id, engine.reserve, request_id, prompt, params, priority)
        if reserved is None:
            raise QueueFullError(f"decode replica {self.replica_id} has no room for request {request_id}")
        block_ids, hits = reserved
        timeline["reserved"] = time.time()
        return Reservation(request_id, self.replica_id, block_ids, hits, self.shards, frozenset(self._peer_ranks),
                           self.kv_pieces)

    def _peer_handles(self, ready: PrefillReady | PrefillPiece) -> None:
        """Remember a prefill replica's rank handles the first time they come; fill them in after."""
        if ready.rank_handles:
            self._peer_ranks[ready.prefill_replica] = ready.rank_handles
            return
        handles = self._peer_ranks.get(ready.prefill_replica)
        if handles is None:  # forgotten after a failed transfer while this request was on its way
            raise KVTransferError(f"no rank handles for {ready.prefill_replica}; re-prefilling")
        ready.rank_handles = handles

    async def _move_kv(self, request_id: str, ready: PrefillReady, stream, pieces: _Pieces) -> TransferStats:
        """Steps 3-4: move the KV (what its pieces have not) into the reservation (which is then the request's, for
        `start`), and read the prefill stream to its end in the background. Lets go of both sides if it raises."""
        try:
            moved = await pieces.finish(ready)
        except BaseException:
            await asyncio.shield(self._give_up(request_id, stream, pieces))
            raise
        if isinstance(stream, RouterPrefill):
            stream.moved = True  # every rank has sent: the prefill replica frees the blocks itself
        self._in_background(_read_to_end(stream))  # step 4, off the request's path
        self.transfers.append(moved)
        if self.on_transfer is not None:
            self.on_transfer(moved)
        return moved

    async def _give_up(self, request_id: str, stream, pieces: _Pieces | None = None) -> None:
        """Once no piece writes into the reservation any more, free it (even on a dead engine), and close the
        prefill stream, which frees its KV."""
        try:
            if pieces is not None:
                await pieces.drain()
            await self.async_engine.cleanup(self.llm_engine.cancel_reservation, request_id)
        finally:
            await _close(stream)

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _pair_spec(self, prefill_replica: str, shards: list[RankShard]) -> PairSpec:
        """The pair's spec with a prefill replica whose ranks hold `shards`: the same for its warm-up and its handoffs."""
        shared = share_a_gpu(shards, self.shards)
        return PairSpec(f"{prefill_replica}->{self.replica_id}", len(shards), len(self.shards), staged=shared,
                        ipc=shared and os.environ.get("TANDEM_KV_IPC") == "1")

    async def warm_pair(self, prefill_replica: str, rank_handles: list, shards: list[RankShard]) -> bool:
        """Build the transfer group with a prefill replica, and its communicator, before a request needs them
        (router/kv_peers.py tells this replica of every prefill replica); the first handoff on a cold pair paid
        both, about a second on GPUs. False if the pair had been built already (by a handoff or a warm-up).
        A failure drops what was built and raises: the pair's first handoff builds it then, as before."""
        spec = self._pair_spec(prefill_replica, shards)
        async with self._pair_locks.setdefault(spec.pair_id, asyncio.Lock()):  # never beside a transfer on the pair
            if spec.pair_id in self._joined:
                return False
            # A thread without the caller's context, as `_transfer`'s calls (no Serve request to cancel them).
            await asyncio.get_running_loop().run_in_executor(None, self._join_blocking, spec, rank_handles, True)
            self._joined[spec.pair_id] = _PairState(self.kv_transfers_in_flight)
            self._peer_ranks.setdefault(prefill_replica, rank_handles)
        return True

    def _join_blocking(self, spec: PairSpec, rank_handles: list, warm: bool = False) -> None:
        """Build the pair's group (and with `warm`, its communicator: `KVTransferAgent.warm`). A group its ranks
        have already that this replica did not build (`_joined`) numbers its transfers in a way this one cannot
        know: it is dropped on both sides and built anew. A failure drops what was built and raises."""
        import ray

        try:
            with contextlib.suppress(Exception):  # a rank that is gone has no group to drop
                ray.get(self._dropping.pop(spec.pair_id, []), timeout=self.transfer_timeout_s)
            if self.executor.kv_call("has_group", spec.pair_id, ranks=[0])[0]:
                ray.get([h.kv.remote("drop", spec.pair_id) for h in rank_handles], timeout=self.transfer_timeout_s)
                self.executor.kv_call("drop", spec.pair_id)
            self._connect(spec, rank_handles)
            if warm:
                warms = [h.kv.remote("warm", spec) for h in rank_handles]
                self.executor.kv_call("warm", spec)
                ray.get(warms, timeout=self.transfer_timeout_s)
        except Exception as e:
            self._drop_pair(spec.pair_id, rank_handles)
            if isinstance(e, ExecutorError):
                raise
            raise KVTransferError(f"building the KV transfer group {spec.pair_id} failed: {e}") from e

    async def _transfer(self, peer: PrefillReady | PrefillPiece, res: Reservation, blocks: range | None = None,
                        piece: bool = False, numbered: asyncio.Event | None = None) -> TransferStats:
        """Move `blocks` (by index in the sequence; default: all those the decode side lacks) of `peer`'s prompt into
        the reservation. Several transfers may be in flight on a pair: each is numbered on it, under the pair's lock
        (which also builds the group), and every rank of both sides posts them in that order (`_PostOrder`)."""
        spec = self._pair_spec(peer.prefill_replica, peer.shards)
        # The blocks the decode side lacks, by their index in the sequence (an SP prefill rank holds some of them).
        blocks = range(res.num_hit_blocks, len(peer.block_ids)) if blocks is None else blocks
        plan = plan_transfers(peer.shards, self.shards, blocks)
        loop = asyncio.get_running_loop()
        async with self._pair_locks.setdefault(spec.pair_id, asyncio.Lock()):
            state = self._joined.get(spec.pair_id)
            if state is None:
                try:
                    # On a thread that does not carry this request's context (not `asyncio.to_thread`, which copies
                    # it): the Ray tasks it submits (a pair's joins, the prefill ranks' sends) are then not children
                    # of the Serve request, whose cancellation (a client gone) would cancel them recursively, half-way
                    # through a transfer whose other side is posted: a stalled receive and a dropped pair.
                    await asyncio.shield(loop.run_in_executor(None, self._join_blocking, spec, peer.rank_handles))
                except KVTransferError:
                    self._peer_ranks.pop(peer.prefill_replica, None)  # the next answer brings them anew
                    raise
                state = self._joined[spec.pair_id] = _PairState(self.kv_transfers_in_flight)
            await state.slots.acquire()
            seq = next(state.seqs)
        if numbered is not None:
            numbered.set()
        try:
            # Submitted at once, with no await between the numbering and it: the thread pool starts its jobs in
            # order, so a transfer never waits on the ranks for one numbered after it that got a thread first.
            moving = loop.run_in_executor(None, functools.partial(
                self._transfer_blocking, spec, state, seq, peer, plan, res, len(blocks), piece))
            try:
                return await asyncio.shield(moving)
            except asyncio.CancelledError:
                # Posted messages cannot be taken back: the transfer runs on (bounded by the transfer
                # timeout) and writes into the reserved blocks. The caller frees them only once it has ended.
                await asyncio.wait([moving])
                if not moving.cancelled() and moving.exception() is not None:
                    log.warning("request %s: the transfer of a cancelled request failed: %s", res.request_id,
                                moving.exception())
                raise
        finally:
            state.slots.release()

    def _transfer_blocking(self, spec: PairSpec, state: _PairState, seq: int, peer: PrefillReady | PrefillPiece,
                           plan: list[Transfer], res: Reservation, num_blocks: int, piece: bool) -> TransferStats:
        import ray

        request_id = res.request_id
        handoff_id = "" if piece else peer.handoff_id
        # A piece's last token: its prefill rank finds the step that computed it (`ChunkEnds`); same block size.
        piece_end = (request_id, len(peer.block_ids) * self.llm_engine.config.cache.block_size) if piece else None
        src_by_rank = {s.rank: s for s in peer.shards}
        dst_by_rank = {s.rank: s for s in self.shards}
        t0, start = time.perf_counter(), time.time()
        try:
            # Both sides get the whole block table; the plan picks the blocks by index.
            sends = [h.kv.remote("send", spec, plan, dst_by_rank, peer.block_ids, handoff_id, seq, piece, piece_end)
                     for h in peer.rank_handles]
            received: list[RecvResult] = self.executor.kv_call("recv", spec, plan, src_by_rank, res.block_ids,
                                                                peer.block_ids, seq, piece)
            sent: list[SendResult] = ray.get(sends, timeout=self.transfer_timeout_s)
        except Exception as e:
            self._drop_pair(spec.pair_id, peer.rank_handles, state)
            self._peer_ranks.pop(peer.prefill_replica, None)  # the next answer brings them anew
            if isinstance(e, ExecutorError):
                raise  # this replica's own ranks are gone: no new prefill can help
            raise KVTransferError(f"request {request_id}: KV transfer {spec.pair_id} failed: {e}") from e
        if any(result.abandoned for result in sent):
            # Every message paired up (the pair stays usable), but some blocks came from a cache that had let them go.
            raise PrefillAbandoned(f"request {request_id}: handoff {handoff_id} was abandoned on the prefill side "
                                   "before its send; the KV received is discarded")
        return TransferStats(sum(r.bytes for r in received), time.perf_counter() - t0, num_blocks, start, time.time(),
                             min(r.began for r in sent), max(r.ended for r in sent), min(r.began for r in received),
                             max(r.posted for r in received), max(r.ended for r in received))

    def _connect(self, spec: PairSpec, prefill_ranks: list) -> None:
        """Build the pair's group: prefill rank 0 hosts its store, every rank of both replicas joins."""
        import ray

        host, port = ray.get(prefill_ranks[0].kv.remote("open_store", spec.pair_id), timeout=self.transfer_timeout_s)
        joins = [h.kv.remote("join", spec, host, port) for h in prefill_ranks]
        self.executor.kv_call("join", spec, host, port)
        ray.get(joins, timeout=self.transfer_timeout_s)

    def _drop_pair(self, pair_id: str, prefill_ranks: list, state: _PairState | None = None) -> None:
        """Forget the pair's group on both sides, best effort (either may be gone): the next transfer rebuilds it.
        `state`: the group a failed transfer ran on; if the pair has been rebuilt since, the new group stays."""
        if state is not None and self._joined.get(pair_id) is not state:
            return
        self._joined.pop(pair_id, None)
        # Not waited for here (a rank may be gone), but before the pair is built again (`_join_blocking`): a drop that
        # a prefill rank ran after the new group's join would leave it without the group, or with the old one.
        self._dropping[pair_id] = [h.kv.remote("drop", pair_id) for h in prefill_ranks]
        if self.executor.alive:
            try:
                self.executor.kv_call("drop", pair_id)
            except (ExecutorError, KVTransferError):
                log.debug("dropping %s on the decode ranks failed", pair_id, exc_info=True)


async def _read_to_end(stream) -> None:
    """Step 4: the rest of the prefill stream is the prefill replica collecting its ranks' acks and
    freeing the blocks. The KV is already here, so a failure there is only logged."""
    try:
        async for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - the request goes on regardless
        log.warning("the prefill side failed after handing off its KV", exc_info=True)
    finally:
        await _close(stream)


async def _close(stream) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - closing a failed stream must not mask the real error
            log.debug("closing the prefill stream failed", exc_info=True)
    else:
        cancel = getattr(stream, "cancel", None)
        if cancel is not None:
            cancel()
