"""The two pool deployments. Each Serve replica owns one engine whose ranks are Ray actors (so the
peer pool can reach them for KV transfers); Serve scales each pool on its own ongoing requests.

A decode replica of one rank (the default backend) runs its engine in its own process, like a colocated
replica; more ranks, and every prefill replica's ranks, are Ray actors. The decode replica drives the handoff (engine/disagg.py): it reserves its blocks, asks the prefill
pool (through Serve, so any prefill replica may answer) to run the prompt, then moves the KV.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from router import kv_peers, metrics, replica_metrics, routing
from router.config import AppConfig
from router.prefill_lane import LaneServer
from router.protocol import GenerateRequest
from router.serve_context import in_own_serve_request
from router.stream_wire import RESERVED_ITEM, StreamEncoder, encode_error
from engine.async_engine import EngineDeadError, StreamPace
from engine.disagg import (RESERVED, DecodeReplica, LocalPrefillPolicy, PrefillReady, PrefillReplica, PrefillUnavailable,
                           Reservation, TransferStats)
from engine.llm_engine import LLMEngine
from workers.executor import ExecutorError
from workers.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def _engine(config: AppConfig, pool: str) -> LLMEngine:
    engine_config = config.engine_config(pool)
    if pool == "prefill":
        # Prefill ranks are always Ray actors, even one: the decode replica drives their KV sends through
        # their actor handles. (Their steps still skip Ray: cluster/step_channel.py.) A decode replica of
        # one rank runs it in a rank actor on GPUs and in its own process on CPUs, unless the pool sets
        # distributed_executor_backend (router/disaggregated.py, `decode_ranks_as_actors`).
        engine_config.parallel.distributed_executor_backend = "ray"
    return LLMEngine(engine_config, show_progress=False)


def _replica_id(pool: str) -> str | None:
    try:
        return f"{pool}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - outside Serve (tests): a random id
        return None


class _PoolMethods:
    """What Serve asks of every pool replica: stats, routing stats, health."""

    replica: PrefillReplica | DecodeReplica

    async def stats(self) -> dict:
        return await self.replica.async_engine.stats()

    def record_routing_stats(self) -> dict:
        """For router/routing.py (polled by Serve). Plain reads of counters the engine thread updates:
        a slightly stale view is fine for routing."""
        engine = self.replica.llm_engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        return {"free_blocks": blocks.num_free_blocks, "running": len(scheduler.running) + len(scheduler.reserved),
                "waiting": len(scheduler.waiting)}

    async def check_health(self) -> None:
        # The engine and the ranks both: a rank can die while the engine is idle (a KV transfer finds it dead),
        # and an engine that runs no step never learns it; the replica then refuses every request, so Serve
        # must replace it (the fault script found such a decode replica answering 500 for 35 s).
        if not self.replica.alive:
            raise RuntimeError(f"{self.replica.replica_id}: its engine or one of its ranks has stopped")


class PrefillPool(_PoolMethods):
    def __init__(self, args: dict[str, Any]):
        self.config = AppConfig.model_validate(args)
        replica_metrics.start_publishing()  # this replica's metrics on the app's GET /metrics
        self.replica = PrefillReplica(_engine(self.config, "prefill"), _replica_id("prefill"))
        self.replica.async_engine.on_step = metrics.PoolGauges("prefill", self.config.served_model_name)
        # Decode replicas warm their KV pair with this one before a request needs it (router/kv_peers.py).
        identity = replica_metrics.serve_identity()
        self._app = identity[0] if identity is not None else None
        if self._app is not None:
            kv_peers.announce(kv_peers.peers_kv(), self._app, self.replica.replica_id, list(self.replica.executor.workers),
                              self.replica.shards)
        # The router's lane to this replica (router/prefill_lane.py), opened on the replica's event loop by the
        # first `stats` or health check, and announced in the routing stats.
        limit = self.config.max_ongoing_requests("prefill")
        self.lane = LaneServer(self.replica, lambda: self._load() < limit) if self.config.prefill_lane else None

    def _load(self) -> int:
        scheduler = self.replica.llm_engine.scheduler
        return len(scheduler.running) + len(scheduler.waiting)  # held KV awaiting its send is no Serve call

    async def _open_lane(self) -> None:
        if self.lane is not None and self.lane.address is None:
            try:
                await self.lane.start(ray.util.get_node_ip_address())
            except OSError:  # the replica serves through Serve alone
                log.warning("the prefill lane could not listen", exc_info=True)
                self.lane = None

    async def stats(self) -> dict:
        await self._open_lane()
        return await super().stats()

    async def check_health(self) -> None:
        await self._open_lane()
        await super().check_health()

    def record_routing_stats(self) -> dict:
        stats = super().record_routing_stats()
        if self.lane is not None and self.lane.address is not None:
            stats["lane"], stats["lane_token"] = self.lane.address, self.lane.token
        return stats

    def __del__(self) -> None:
        """Serve's graceful shutdown: take this replica's KV peer entry away (a killed one's is deleted by the
        decode replica that finds its actors dead)."""
        if getattr(self, "_app", None) is not None:
            try:
                kv_peers.withdraw(kv_peers.peers_kv(), self._app, self.replica.replica_id)
            except Exception:  # noqa: BLE001 - Ray shutting down: nothing to tidy
                log.debug("withdrawing the KV peer entry failed", exc_info=True)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                      reservation: Reservation) -> AsyncIterator[PrefillReady | PrefillFailed]:
        """The prompt's prefill as `PrefillReplica.prefill` streams it; a `PrefillFailed` item, last, if this
        replica's engine has stopped (see `PrefillFailed`)."""
        try:
            async for ready in self.replica.prefill(request_id, prompt_token_ids, params, priority, reservation):
                yield ready
        except ENGINE_STOPPED as e:
            yield _failed(self.replica.replica_id, request_id, e)

    async def prefill_first(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            priority: int, lane_replica: str | None = None) -> PrefillReady | PrefillFailed:
        """The router's own prefill call (router-driven prefill): a unary answer, which the router streams token
        1 from and passes to the decode replica as an ObjectRef; the blocks stay held until sent or abandoned.
        A run the router's lane started here is taken over (`lane_replica` names the replica the router's lane
        chose, for router/routing.py's choice: not read here). `PrefillFailed` if this replica's engine has
        stopped."""
        try:
            return await self.replica.prefill_first(request_id, prompt_token_ids, params, priority)
        except ENGINE_STOPPED as e:
            return _failed(self.replica.replica_id, request_id, e)


class DecodePool(_PoolMethods):
    def __init__(self, args: dict[str, Any], prefill: DeploymentHandle):
        self.config = AppConfig.model_validate(args)
        replica_metrics.start_publishing()  # this replica's metrics on the app's GET /metrics
        self.prefill = prefill
        engine = _engine(self.config, "decode")
        policy = LocalPrefillPolicy(self.config.local_prefill_max_tokens, self.config.local_prefill_when_idle)
        self.replica = DecodeReplica(engine, self._prefill_client, _replica_id("decode"), local_prefill=policy,
                                     kv_pieces=self.config.kv_push_pieces,
                                     kv_transfers_in_flight=self.config.kv_transfers_in_flight)
        gauges = metrics.PoolGauges("decode", self.config.served_model_name)
        self.replica.on_transfer = lambda stats: _record_transfer(stats, gauges.tags)
        self.replica.on_prefill_site = lambda site: metrics.PREFILL_SITE.inc(1, tags={"site": site, **gauges.tags})
        self.replica.async_engine.on_step = gauges
        # Resolved by build_disaggregated_app; a config built elsewhere (tests) without one: the CPU default.
        pace = self.config.resolved_stream_items_per_s(on_gpus=False)
        if pace > 0:
            self.replica.async_engine.stream_pace = StreamPace(pace)
        identity = replica_metrics.serve_identity()
        self._app = identity[0] if identity is not None else None
        self._warming: asyncio.Task | None = None

    async def check_health(self) -> None:
        await super().check_health()
        # Serve calls this every few seconds on the replica's own event loop, from its start: the first call starts
        # warming the KV pairs with the prefill replicas (router/kv_peers.py), on the loop the handoffs use.
        if self._app is not None and (self._warming is None or self._warming.done()):
            self._warming = asyncio.ensure_future(
                kv_peers.warm_pairs_forever(self.replica.warm_pair, kv_peers.peers_kv(), self._app))

    async def _prefill_client(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                              reservation: Reservation) -> AsyncIterator[PrefillReady]:
        """The prefill pool's stream for one prompt. A replica that died under it (the actor, or its engine:
        a rank lost) is `PrefillUnavailable`, which the decode replica retries at once on its own engine."""
        # Its own Serve request: the prefill calls of one decode call (several prompts) must not share an id.
        response = in_own_serve_request(self.prefill.options(stream=True).prefill.remote, request_id, prompt, params,
                                        priority, reservation)
        try:
            try:
                first = await routing.first_unless_replicas_gone(
                    response, self.prefill, already_empty_fails=routing.never_empty(self.config.prefill))
            except routing.ReplicasGone as e:
                raise PrefillUnavailable(f"request {request_id}: {e} in the prefill pool") from None
            yield ready_or_raise(first)
            async for ready in response:
                yield ready_or_raise(ready)
        except Exception as e:
            err = _prefill_failure(request_id, e)
            if err is e:
                raise
            raise err from e
        finally:
            response.cancel()  # closed early (client gone, handoff given up): the prefill replica frees its KV

    async def generate_prefilled(self, req: GenerateRequest, answer: list) -> AsyncIterator[bytes]:
        """A request whose prefill the router started itself (`PrefillPool.prefill_first`): `answer` holds
        that call's ObjectRef (in a list, so Ray passes the ref rather than waiting for its value). Items as in
        `generate`, after a first `RESERVED_ITEM` once this replica's blocks are reserved; token 1 is the
        router's to stream."""
        encoder = StreamEncoder()
        try:
            async for out in self.replica.generate(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                   req.priority, prefilled=_answer(req.request_id, answer[0])):
                yield RESERVED_ITEM if out is RESERVED else encoder.encode(0, out)
        except ENGINE_STOPPED as e:
            yield self._stopped(req.request_id, e)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[bytes]:
        """The request's outputs as router/stream_wire.py items: only what the router has not seen yet (it has
        the prompt and the earlier items), in one `bytes` Ray passes through without serializing."""
        encoder = StreamEncoder()
        try:
            async for out in self.replica.generate(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                   req.priority):
                yield encoder.encode(0, out)
        except ENGINE_STOPPED as e:
            yield self._stopped(req.request_id, e)

    async def generate_batch(self, reqs: list[GenerateRequest]) -> AsyncIterator[bytes]:
        """One client request's prompts and choices in one call: items as in `generate`, each naming its
        index into `reqs`."""
        items = [(r.request_id, r.prompt_token_ids, r.sampling_params, r.priority) for r in reqs]
        encoder = StreamEncoder()
        try:
            async with contextlib.aclosing(self.replica.generate_many(items)) as stream:
                async for i, out in stream:
                    yield encoder.encode(i, out)
        except ENGINE_STOPPED as e:
            yield self._stopped(reqs[0].request_id if reqs else "(none)", e)

    def _stopped(self, request_id: str, e: BaseException) -> bytes:
        """The item that ends a stream whose engine stopped (router/stream_wire.py `ERROR_ITEM`), with one warning
        line here instead of Serve's traceback: the router raises the error again and answers 503 as before."""
        _stopped_under("decode", self.replica.replica_id, request_id, e)
        return encode_error(e)

    async def info(self) -> dict:
        engine = self.replica.llm_engine
        return {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}


def _prefill_failure(request_id: str, e: Exception) -> Exception:
    """A prefill call's error as the decode replica takes it: a prefill replica that died (the actor, or its
    engine: a rank lost) is `PrefillUnavailable`, which it retries at once on its own engine."""
    cause = e
    while isinstance(cause, RayTaskError) and isinstance(getattr(cause, "cause", None), BaseException):
        cause = cause.cause
    if isinstance(e, RayActorError) or isinstance(cause, (RayActorError, EngineDeadError)):
        # The replica (ActorDiedError / ActorUnavailableError) or its engine (a rank lost) is gone.
        return PrefillUnavailable(f"the prefill replica failed under request {request_id}: {type(cause).__name__}")
    return e


async def _answer(request_id: str, ref) -> PrefillReady:
    """The router-driven prefill's answer (the ObjectRef of its `prefill_first` call)."""
    try:
        answer = await ref
    except Exception as e:
        err = _prefill_failure(request_id, e)
        if err is e:
            raise
        raise err from e
    return ready_or_raise(answer)


@dataclass(frozen=True)
class PrefillFailed:
    """What a prefill replica whose engine has stopped (a rank lost) answers instead of raising: an exception out of
    a Serve call is logged by Serve with its traceback ("Request failed.") once per request, and this one is no
    server bug: the caller takes it as `PrefillUnavailable` (the decode replica prefills the prompt itself; the
    router streams nothing of its own), as it takes the replica's death, and Serve's health check replaces the
    replica."""
    reason: str


# A pool replica's engine that has stopped: its loop ended (`EngineDeadError`), or a rank died under a call. Either
# pool answers it (`PrefillFailed`; a decode stream's error item, which the router raises again: stream_wire.py).
ENGINE_STOPPED = (EngineDeadError, ExecutorError, RayActorError)


def _stopped_under(pool: str, replica_id: str | None, request_id: str, e: BaseException) -> str:
    """The line a replica logs (one, no traceback) when its engine has stopped under a request; returned too."""
    text = str(e).splitlines()[0] if str(e) else ""
    line = f"{pool} replica {replica_id}: its engine has stopped under request {request_id} ({type(e).__name__}: {text})"
    log.warning("%s", line)
    return line


def _failed(replica_id: str | None, request_id: str, e: BaseException) -> PrefillFailed:
    return PrefillFailed(_stopped_under("prefill", replica_id, request_id, e))


def ready_or_raise(item: PrefillReady | PrefillFailed) -> PrefillReady:
    """A prefill call's item as its caller takes it: `PrefillFailed` raises `PrefillUnavailable`."""
    if isinstance(item, PrefillFailed):
        raise PrefillUnavailable(item.reason)
    return item


def _record_transfer(stats: TransferStats, tags: dict[str, str]) -> None:
    """One handoff's KV, counted on the decode replica that received it (`tags`: its model, pool, replica)."""
    if stats.bytes > 0:  # Ray's counters refuse an increment of 0
        metrics.KV_TRANSFER_BYTES.inc(stats.bytes, tags=tags)
    metrics.KV_TRANSFER_SECONDS.observe(stats.seconds, tags=tags)
