"""The disaggregated application: `Router` (ingress: OpenAI HTTP + gRPC) -> `DecodePool` -> `PrefillPool`.

The router tokenises and validates (in the front ends), then streams each request from the decode
pool, which drives the prefill and the KV handoff (router/pools.py, engine/disagg.py). The KV never
passes through the router; only token deltas do. The decode replica is the one with the most free KV
blocks, and the decode replica's prefill call goes to the prefill replica its prompt's leading block
hashes to, unless that one is overloaded (router/routing.py); a decode replica that is full answers
`QueueFullError`, which reaches the client as 429, as does Serve's `BackPressureError` when a pool's
callers already queue `max_queued_requests` for it (`AppConfig.backpressure_options`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from transformers import AutoConfig, AutoTokenizer

from router.colocated import gpus_per_replica, in_process_rank_options
from router.config import AppConfig
from router.grpc_api import InferenceServicer
from router.guards import RequestLimits
from router.openai_api import create_openai_app
from router.pools import DecodePool, PrefillFailed, PrefillPool
from router.prefill_lane import LaneClient
from router.protocol import BackendUnavailable, GenerateRequest
from router.replica_metrics import start_publishing
from router.routing import (REPLICAS_POLL_S, ReplicasGone, first_unless_replicas_gone, lane_for_prefill, live_replicas,
                            pool_busy)
from router.stream_wire import RESERVED_ITEM, StreamDecoder
from engine.disagg import PrefillReady, abandon_prefill, streamable
from engine.llm_engine import RequestOutput
from workers.executor import ExecutorError
from workers.hub import resolve_model_path

log = logging.getLogger(__name__)
INFO_TIMEOUT_S = 600.0  # the router's first health check waits this long for the pools to load their models
READY_WAIT_S = 60.0  # a request that arrives before the pools answered waits this long, then gets 503


class DisaggregatedBackend:
    """`router.protocol.Backend` over the decode pool's Serve handle."""

    lanes: LaneClient | None = None  # router-driven prefills' lanes to the prefill replicas (router/prefill_lane.py)
    block_size = 16

    def __init__(self, config: AppConfig, decode: DeploymentHandle, prefill: DeploymentHandle | None = None,
                 ready_wait_s: float = READY_WAIT_S):
        self.decode = decode
        self.prefill = prefill
        self.ready_wait_s = ready_wait_s
        self.model_name = config.served_model_name
        model = resolve_model_path(config.model, config.revision)  # a Hugging Face ID: its folder in the cache
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.tokenizer) if config.tokenizer else model,
                                                       local_files_only=True)
        hf_config = AutoConfig.from_pretrained(model, local_files_only=True)
        self.vocab_size = hf_config.vocab_size
        # Known exactly once a decode replica answers (the cache size may lower it); until then the
        # configured or model limit, which the decode engine checks again.
        self.max_model_len = config.max_model_len or hf_config.max_position_embeddings
        self._streams: dict[str, Any] = {}
        # Router-driven prefill (docs/architecture.md, "Prefill/decode handoff"): for a prompt its decode replica
        # would hand off whatever its state (longer than a local prefill may take), this router calls the prefill
        # pool itself, concurrently with the decode replica's reservation, and streams token 1 from its answer.
        decode_args = config.engine_args("decode")
        self.router_prefill = config.router_prefill and prefill is not None
        self.local_prefill_max_tokens = config.local_prefill_max_tokens
        self.local_prefill_idle_tokens = decode_args.max_num_batched_tokens if config.local_prefill_when_idle else 0
        self.router_prefills = 0  # requests that took it (for tests)
        self.lanes = LaneClient() if self.router_prefill and config.prefill_lane else None
        self.block_size = config.block_size
        self._info_task: asyncio.Task | None = None
        self._ready = False

    async def _fetch_info(self) -> None:
        """Both pools answer: the decode pool with its limits (the checks need them), the prefill pool at all."""
        info = await self.decode.info.remote()
        if self.prefill is not None:
            await self.prefill.stats.remote()
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        self._ready = True

    def _info(self) -> asyncio.Task:
        """The one fetch in flight; one that failed or timed out is replaced by a new one."""
        task = self._info_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._info_task = asyncio.ensure_future(asyncio.wait_for(self._fetch_info(), INFO_TIMEOUT_S))
        return task

    async def wait_ready(self, timeout: float) -> bool:
        """True once both pools have answered; waits for that at most `timeout` seconds."""
        if self._ready:
            return True
        task = self._info()
        done, _ = await asyncio.wait([task], timeout=timeout)  # not wait_for: a caller's timeout must not cancel it
        if not done:
            return False
        if task.cancelled() or task.exception() is not None:
            log.warning("the pools did not answer: %r", None if task.cancelled() else task.exception())
            return False
        return True

    async def ready(self) -> bool:
        # A request (or probe) that arrives while the pools load waits for them, bounded, rather than
        # getting 503 at once: under Serve this only happens before the router's first health check.
        return await self.wait_ready(self.ready_wait_s)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.routes_prefill(len(req.prompt_token_ids)):
            async for out in self._generate_routed(req):
                yield out
            return
        async for _, out in self._decode_call("generate", req, [req.request_id], lambda item: item[1].finished):
            yield out

    def routes_prefill(self, prompt_len: int) -> bool:
        """Whether this router prefills a prompt itself: only one that every decode replica would hand off,
        its whole length above what `LocalPrefillPolicy` lets a decode replica prefill (a prompt partly in a
        decode replica's prefix cache may have been prefilled there; handed off, only its missing blocks move).
        A prompt that an idle decode replica would prefill itself (`local_prefill_when_idle`) is routed too when
        every decode replica reported work in its last routing stats: none is idle, so it would be handed off
        anyway, and the decode-driven path puts two more Serve hops and a reservation before the prefill (on
        2 x H100 at 4-16 req/s, 2K-token prompts reached the prefill engine 22.5 ms after arrival, p50, where a
        colocated replica's engine had them at 5.3 ms). Stale stats (a second at most) only choose the slower
        of two correct paths.
        With a prefill lane every such prompt is routed, idle decode replicas or not: over the lane token 1 comes as
        fast as from a local prefill (2 x H100, rate 1: the router's stats had a decode replica at one request, not
        busy, when it had begun another; 6 of the 18 timelines the log kept took the decode-driven path, 10-15 ms more
        before the prefill and 3-6 ms more after it, and PD's TTFT p50 was 1.11-1.22x colocated, against 1.08x at one client
        with every prompt over the lane)."""
        if not self.router_prefill or prompt_len <= self.local_prefill_max_tokens:
            return False
        return prompt_len > self.local_prefill_idle_tokens or self.lanes is not None or pool_busy(self.decode)

    async def _generate_routed(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Router-driven prefill: token 1 takes two Serve hops (router -> prefill replica -> router), not four.
        The prefill call (unary, `PrefillPool.prefill_first`) and the decode call (`generate_prefilled`, given
        the prefill call's ObjectRef) go out together; the decode replica reserves its blocks, says so
        (`RESERVED_ITEM`), then takes the same answer and moves the KV as before. Token 1 goes to the client once
        both the answer and the reservation are in, so a full decode replica still refuses (429) before any token.
        Any prefill failure is the decode replica's to handle (a re-prefill, or the whole request on its own
        engine): the router then streams nothing of its own, and token 1 comes from the decode stream.
        With a prefill lane (router/prefill_lane.py) the run starts at the lane's message, before the Serve call
        arrives, and token 1 comes back on the lane once that call has taken the run over: neither Serve hop
        is on the first token's path."""
        if not await self.ready():
            raise BackendUnavailable("the decode pool is not ready yet")
        rid = req.request_id
        # The decode call goes out once the prefill call has a replica: a decode replica that died meanwhile must
        # fail it at once, as a call made now would (first_unless_replicas_gone), not wait for a replacement.
        decode_was_live = bool(live_replicas(self.decode))
        called = time.time()
        lane = await self._start_on_lane(req)
        try:
            async with contextlib.aclosing(self._routed_from(req, called, lane, decode_was_live)) as outs:
                async for out in outs:
                    yield out
        finally:
            if lane is not None:
                self.lanes.drop(lane.address, rid)

    async def _start_on_lane(self, req: GenerateRequest) -> _LaneStart | None:
        """A router-driven prefill started on the lane of the prefill replica that the prefill pool's router will
        prefer (router/prefill_lane.py); None where there is none to use."""
        if self.lanes is None:
            return None
        chosen = lane_for_prefill(self.prefill, req.prompt_token_ids, self.block_size)
        if chosen is None:
            return None
        key, address, token = chosen
        first = await self.lanes.start(address, token, req.request_id, req.prompt_token_ids, req.sampling_params,
                                       req.priority)
        return None if first is None else _LaneStart(address, key, first)

    async def _routed_from(self, req: GenerateRequest, called: float, lane: _LaneStart | None,
                           decode_was_live: bool) -> AsyncIterator[RequestOutput]:
        rid = req.request_id
        response, ref = await self._call_prefill(req, None if lane is None else lane.replica)
        if ref is None:  # no prefill replica to take it now: the decode replica copes (prefills it itself)
            async for _, out in self._decode_call("generate", req, [rid], lambda item: item[1].finished):
                yield out
            return
        self.router_prefills += 1
        try:
            stream = self.decode.options(stream=True).generate_prefilled.remote(req, [ref])
        except BaseException:
            _cancel(response)
            _abandon_when_answered(ref, rid)  # the decode call never left: no decode replica will let the blocks go
            raise
        self._streams[rid] = stream
        decoder = StreamDecoder()
        stamps: dict[str, float] = {}
        lane_token: RequestOutput | None = None  # token 1 as the lane gave it, until the decode stream's first item
        streamed, finished, retry, abandoned = False, False, False, False
        try:
            try:
                item = await first_unless_replicas_gone(stream, self.decode, already_empty_fails=decode_was_live)
            except StopAsyncIteration:
                return
            except ReplicasGone as e:
                _abandon_when_answered(ref, rid)
                abandoned = True
                raise BackendUnavailable(f"request {rid}: the decode replica died and no other one is left") from e
            if item == RESERVED_ITEM:
                stamps["router_reserved"] = time.time()
                answer = asyncio.ensure_future(_answer_or_none(ref))
                lane_token = await _lane_first(lane, answer)
                if lane_token is not None:  # token 1 over the lane, of the run the Serve call has taken over
                    stamps["router_lane_first"] = time.time()
                    streamed = True
                    yield lane_token
                else:
                    ready = await answer
                    stamps["router_answered"] = time.time()
                    if ready is not None and not ready.finished:
                        streamed = True
                        yield streamable(ready.output)  # token 1, straight from the prefill replica
                item = None
            while True:
                if item is not None:
                    _, out = decoder.decode(item)
                    if lane_token is not None:
                        _check_lane_first(rid, lane_token, out)
                        lane_token = None
                    streamed = True
                    if out.finished:
                        finished = True
                        out.timeline = {**(out.timeline or {}), "prefill_called": called, **stamps}
                    yield out
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
        except _REPLICA_GONE as e:
            # The decode replica died. The prefill replica holds the KV for it: let it go (nothing reads it now).
            _abandon_when_answered(ref, rid)
            abandoned = True
            if streamed:
                raise BackendUnavailable(f"decode replica failed during request {rid}: {_first_line(e)}") from e
            log.warning("request %s: decode replica died before its first token; retrying", rid)
            retry = True
        finally:
            self._streams.pop(rid, None)
            if not finished:
                _let_go(stream, response, ref, rid, abandoned)
        if retry:  # once more, the usual way (another decode replica; it calls the prefill pool itself)
            async for _, out in self._decode_call("generate", req, [rid], lambda item: item[1].finished, retried=True):
                yield out

    async def _call_prefill(self, req: GenerateRequest, lane_replica: str | None = None) -> tuple[Any, Any]:
        """The prefill call (`PrefillPool.prefill_first`) and, once Serve has given it a replica, its ObjectRef;
        None for the ref (the call cancelled) when the prefill pool has no live replica now. `lane_replica`: the
        replica whose lane started the run, which the prefill pool's router then prefers."""
        pin = {} if lane_replica is None else {"lane_replica": lane_replica}
        response = self.prefill.prefill_first.remote(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                     req.priority, **pin)
        try:
            ref = await self._assigned(response)
        except BaseException:
            response.cancel()
            raise
        if ref is None:
            response.cancel()
        return response, ref

    async def _assigned(self, response) -> Any:
        """The prefill call's ObjectRef once Serve has given it a replica; None when the prefill pool has no
        live replica (Serve would hold the call for a replacement) or the call could not be sent."""
        task = asyncio.ensure_future(response._to_object_ref())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=REPLICAS_POLL_S)
                if done:
                    return task.result()
                if live_replicas(self.prefill) == 0:
                    return None
        except BackPressureError:
            raise  # the prefill pool's callers queue all they may: 429, as the decode pool's
        except Exception:  # noqa: BLE001 - e.g. an older Serve without the ObjectRef API: the usual path
            log.warning("router-driven prefill unavailable; the decode replica calls the prefill pool", exc_info=True)
            return None
        finally:
            if not task.done():
                task.cancel()

    async def generate_batch(self, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """A client request's prompts and `n` choices in one decode-pool call (DecodePool.generate_batch):
        (index into `reqs`, output) items."""
        unfinished = set(range(len(reqs)))

        def done(item: tuple[int, RequestOutput]) -> bool:
            if item[1].finished:
                unfinished.discard(item[0])
            return not unfinished

        async for item in self._decode_call("generate_batch", reqs, [r.request_id for r in reqs], done):
            yield item

    async def _decode_call(self, method: str, payload: Any, request_ids: list[str],
                           done: Callable[[tuple[int, RequestOutput]], bool], retried: bool = False
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """A streaming call of the decode pool: its items as (index into the call's requests, the engine's
        cumulative output), rebuilt from the wire's deltas (router/stream_wire.py), until `done(item)`.
        `retried`: the request's decode replica died under an earlier call (router-driven prefill)."""
        if not await self.ready():
            raise BackendUnavailable("the decode pool is not ready yet")
        name = request_ids[0]
        attempts = 2  # a decode replica that dies before the first token is retried once, elsewhere
        for attempt in range(1, attempts + 1):
            stream = getattr(self.decode.options(stream=True), method).remote(payload)
            decoder = StreamDecoder()  # per call: a retried call streams from its first output again
            for rid in request_ids:
                self._streams[rid] = stream
            got_any, finished = False, False
            try:
                # A decode replica dying under the call before its first token: Serve retries the call on
                # another replica; with none left, the client gets 503 now rather than when a replacement has
                # started. (A new call made while Serve already knows of no live replica waits for one, as
                # before; a retry, `retried` or a second attempt, does not: its client has waited once already.)
                try:
                    item = decoder.decode(await first_unless_replicas_gone(stream, self.decode,
                                                                           already_empty_fails=retried or attempt > 1))
                except StopAsyncIteration:
                    return
                except ReplicasGone as e:
                    raise BackendUnavailable(f"request {name}: the decode replica died and no other one is left") from e
                while True:
                    got_any = True
                    finished = done(item)
                    yield item
                    try:
                        item = decoder.decode(await anext(stream))
                    except StopAsyncIteration:
                        return
            except _REPLICA_GONE as e:
                if got_any or attempt == attempts:
                    raise BackendUnavailable(f"decode replica failed during request {name}: {_first_line(e)}") from e
                log.warning("request %s: decode replica died before its first token; retrying", name)
            finally:
                for rid in request_ids:
                    self._streams.pop(rid, None)
                if not finished:
                    stream.cancel()  # client gone or error: the decode replica aborts, and cancels the prefill

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()


# A decode replica that serves nothing more: the actor died, or its ranks did (it raises ExecutorError, through
# Serve as a RayTaskError that is also an ExecutorError, until its failed health check has it replaced). Either
# way, another replica may take a request that has streamed nothing yet; one that has gets 503, never 500.
_REPLICA_GONE = (RayActorError, ExecutorError)


def _first_line(e: BaseException) -> str:
    """An error's first line: a RayTaskError's text carries the remote traceback, which a client need not read."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


async def _answer_or_none(ref) -> PrefillReady | None:
    """The router-driven prefill's answer; None if it failed (the decode replica handles that), raised or
    answered (`PrefillFailed`: the prefill replica's engine has stopped)."""
    try:
        answer = await ref
    except Exception:  # noqa: BLE001
        return None
    return None if isinstance(answer, PrefillFailed) else answer


@dataclass
class _LaneStart:
    address: str  # the prefill replica's lane
    replica: str  # its key, which the Serve call names so that the prefill pool's router prefers it
    first: asyncio.Future  # token 1 once the Serve call has claimed the run (`LaneClient.start`)


async def _lane_first(lane: _LaneStart | None, answer: asyncio.Future) -> RequestOutput | None:
    """Token 1 from the lane, if it comes (claimed) before the Serve call's answer; else None (that answer's)."""
    if lane is None:
        return None
    done, _ = await asyncio.wait({lane.first, answer}, return_when=asyncio.FIRST_COMPLETED)
    return lane.first.result() if lane.first in done else None


def _check_lane_first(request_id: str, first: RequestOutput, out: RequestOutput) -> None:
    """The decode stream's first output after token 1 went out from the lane: the Serve answer the decode replica
    went on from is of the same run (its call claimed it), so its tokens start with that token. An answer that
    failed (the prefill replica died after token 1) has the decode replica prefill again, maybe to another token 1
    (sampling): then the request ends, 503, as when a decode replica dies mid-stream. Read from the stream, the
    check costs the stream nothing (waiting for the Serve answer first held the decode stream's first items back)."""
    if out.token_ids and out.token_ids[0] != first.token_ids[0]:
        raise BackendUnavailable(f"request {request_id}: the prefill replica failed after the first token")


def _let_go(stream, response, ref, request_id: str, abandoned: bool) -> None:
    """A routed request that did not finish (client gone or error): the decode call and, if still prefilling, the
    prefill call are cancelled, and the prefill's KV is abandoned once answered, unless it was already (issue 24).
    Whether the decode call reached a decode replica is often not known here (Serve may have sent it while its
    assignment was pending or being cancelled), and need not be: a prefill rank that has begun sending the KV
    ignores the abandon, and a send that begins after it tells its decode replica, which discards what it got
    (`KVTransferAgent.abandon`). So blocks no decode replica will collect are freed at once, not at the lease."""
    _cancel(stream)
    _cancel(response)  # still prefilling: the prefill replica frees its blocks
    if not abandoned:
        _abandon_when_answered(ref, request_id)


def _cancel(response) -> None:
    """`response.cancel()`, which in Serve 2.60 raises the assignment's error (e.g. BackPressureError) for a call
    refused before assignment, from a `finally` that must go on (and must not replace the error in flight)."""
    try:
        response.cancel()
    except Exception:  # noqa: BLE001
        log.debug("cancelling a Serve call failed", exc_info=True)


_abandoning: set[asyncio.Task] = set()


def _abandon_when_answered(ref, request_id: str) -> None:
    """The router gives a routed request up (its decode replica died, the decode call never reached one, or the
    client is gone): have the prefill's ranks abandon its KV once the answer is in (a cancelled prefill call fails
    instead, and its replica has freed the blocks itself). Safe while a decode replica moves the KV (`_let_go`)."""
    async def abandon() -> None:
        ready = await _answer_or_none(ref)
        if ready is not None:
            log.debug("request %s: abandoning its prefill's KV (%s)", request_id, ready.handoff_id)
            abandon_prefill(ready)

    task = asyncio.ensure_future(abandon())
    _abandoning.add(task)
    task.add_done_callback(_abandoning.discard)


@serve.ingress()
class Router(InferenceServicer):
    """Ingress: the OpenAI routes (built per replica by `__serve_build_asgi_app__`) and the gRPC methods."""

    def __init__(self, args: dict[str, Any], decode: DeploymentHandle, prefill: DeploymentHandle | None = None):
        self.config = AppConfig.model_validate(args)
        start_publishing()  # this replica's front-end metrics on every Router replica's GET /metrics
        InferenceServicer.__init__(self, DisaggregatedBackend(self.config, decode, prefill),
                                   self.config.resolved_api_keys(), self.config.request_timeout_s,
                                   RequestLimits.from_config(self.config), self.config.trace_requests)

    def __serve_build_asgi_app__(self):
        return create_openai_app(self.backend, self.config.resolved_api_keys(), self.config.request_timeout_s,
                                 RequestLimits.from_config(self.config), self.config.trace_requests,
                                 self.config.sse_keepalive_s, self.config.tool_call_parser)

    async def check_health(self) -> None:
        """Serve runs this once before the replica counts as started (and so before the deployment and the
        app report RUNNING), then periodically: ready means both pools answer, so the first request succeeds."""
        if not await self.backend.wait_ready(INFO_TIMEOUT_S):
            raise RuntimeError("the decode and prefill pools did not answer")


def decode_ranks_as_actors(config: AppConfig) -> AppConfig:
    """The config with a GPU decode pool of one rank per replica set to run that rank in a rank actor (the Ray
    executor, as the prefill pool always does), where its `distributed_executor_backend` is left at "auto".

    Measured on 2 x H100 (Llama-3.1-8B shapes, in 2048 / out 256, 4 to 16 req/s, two calls; docs/benchmarks.md,
    "Eighth session"): with the rank in the decode replica's own process, TPOT p50 was 9.9-11.9 ms; in a rank
    actor, 8.0-9.1 ms, and below two colocated replicas'. In its own process the engine's thread shares the
    GIL with the replica's event loop, which handles every streamed token of every request. On CPUs
    (compute on the same cores either way) the rank stays in-process. Decided here, once, where the
    deployment's resources are too (`in_process_rank_options`), so the replica and its options agree."""
    args = config.engine_args("decode")
    if (args.distributed_executor_backend != "auto" or args.parallel_config().world_size != 1
            or not gpus_per_replica(config)):
        return config
    given = config.to_args()
    given["decode"] = {**given.get("decode", {}), "distributed_executor_backend": "ray"}
    return AppConfig.model_validate(given)


def build_disaggregated_app(config: AppConfig) -> Application:
    config = decode_ranks_as_actors(config)
    on_gpus = bool(gpus_per_replica(config))
    # The decode replicas' stream pace, resolved here where the devices are known (router/pools.py reads it).
    config = config.model_copy(update={"stream_items_per_s": config.resolved_stream_items_per_s(on_gpus)})
    args = config.to_args()
    # Pool replicas hold no devices themselves: their ranks are Ray actors that take the GPUs/CPUs.
    actor = {"num_cpus": 0, "num_gpus": 0}
    # Prefill by prefix affinity (bounded by load), decode by free KV blocks: router/routing.py.
    prefill_router = RequestRouterConfig(request_router_class="router.routing:PrefillAffinityRouter",
                                         request_router_kwargs={"block_size": config.block_size},
                                         request_routing_stats_period_s=1.0)
    decode_router = RequestRouterConfig(request_router_class="router.routing:DecodeCapacityRouter",
                                        request_routing_stats_period_s=1.0)
    prefill = serve.deployment(PrefillPool, name="PrefillPool").options(
        max_ongoing_requests=config.max_ongoing_requests("prefill"), ray_actor_options=actor, request_router_config=prefill_router,
        **config.prefill.serve_options(), **config.backpressure_options("prefill")).bind(args)
    # A decode replica of one rank on CPUs runs it in-process (router/pools.py), so it takes that rank's devices.
    in_process = in_process_rank_options(config, "decode")
    decode_actor = {"num_cpus": 0, **in_process} if in_process else actor
    decode = serve.deployment(DecodePool, name="DecodePool").options(
        max_ongoing_requests=config.max_ongoing_requests("decode"), ray_actor_options=decode_actor, request_router_config=decode_router,
        **config.decode.serve_options(), **config.backpressure_options("decode")).bind(args, prefill)
    router = serve.deployment(Router, name="Router").options(
        max_ongoing_requests=4 * config.max_ongoing_requests("decode"), ray_actor_options={"num_cpus": 0},
        **config.router_serve_options(on_gpus=on_gpus),
        **config.backpressure_options("decode", scale=4)).bind(args, decode, prefill)
    return router
