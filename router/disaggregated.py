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
import logging
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from transformers import AutoConfig, AutoTokenizer

from router.colocated import in_process_rank_options
from router.config import AppConfig
from router.grpc_api import InferenceServicer
from router.guards import RequestLimits
from router.openai_api import create_openai_app
from router.pools import DecodePool, PrefillPool
from router.protocol import BackendUnavailable, GenerateRequest
from router.replica_metrics import start_publishing
from router.routing import ReplicasGone, first_unless_replicas_gone
from router.stream_wire import StreamDecoder
from engine.llm_engine import RequestOutput
from workers.hub import resolve_model_path

log = logging.getLogger(__name__)
INFO_TIMEOUT_S = 600.0  # the router's first health check waits this long for the pools to load their models
READY_WAIT_S = 60.0  # a request that arrives before the pools answered waits this long, then gets 503


class DisaggregatedBackend:
    """`router.protocol.Backend` over the decode pool's Serve handle."""

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
        async for _, out in self._decode_call("generate", req, [req.request_id], lambda item: item[1].finished):
            yield out

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
                           done: Callable[[tuple[int, RequestOutput]], bool]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """A streaming call of the decode pool: its items as (index into the call's requests, the engine's
        cumulative output), rebuilt from the wire's deltas (router/stream_wire.py), until `done(item)`."""
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
                # started. (A call made while Serve already knows of no live replica waits for one, as before.)
                try:
                    item = decoder.decode(await first_unless_replicas_gone(stream, self.decode, already_empty_fails=False))
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
            except RayActorError as e:
                if got_any or attempt == attempts:
                    raise BackendUnavailable(f"decode replica failed during request {name}: {e}") from e
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


def build_disaggregated_app(config: AppConfig) -> Application:
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
    # A decode replica of one rank runs it in-process (router/pools.py), so it takes that rank's devices.
    in_process = in_process_rank_options(config, "decode")
    decode_actor = {"num_cpus": 0, **in_process} if in_process else actor
    decode = serve.deployment(DecodePool, name="DecodePool").options(
        max_ongoing_requests=config.max_ongoing_requests("decode"), ray_actor_options=decode_actor, request_router_config=decode_router,
        **config.decode.serve_options(), **config.backpressure_options("decode")).bind(args, prefill)
    router = serve.deployment(Router, name="Router").options(
        max_ongoing_requests=4 * config.max_ongoing_requests("decode"), ray_actor_options={"num_cpus": 0},
        **config.backpressure_options("decode", scale=4)).bind(args, decode, prefill)
    return router
