"""`AppConfig`: the served application's arguments (Serve `args`, `tandem serve` and Python share it).

It *is* the engine's argument model (`workers.config.EngineArgs`, subclassed, not copied) plus what
only a served system has: the prefill and decode pools, API keys and a per-request timeout. Each pool
takes its size (`num_replicas` or `autoscaling_config`) and may override any engine argument for its
own replicas (its rank grid, batch limits, KV budget, Ray resources...), except the few that both
pools must share for the KV handoff to be meaningful (`SHARED_ONLY`).

The model folder is not required to exist here: Serve validates the args on the head node, which
often has no weights; the replicas that load the model check the folder (`engine_config`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from ray.serve.config import AutoscalingConfig, BackpressureConfig

from parallel.config import StrictModel
from router.tool_parsers import ToolCallParserName
from workers.config import ENGINE_FIELDS, EngineArgs, EngineConfig, unknown_argument_message
from workers.hub import is_model_id

Pool = Literal["prefill", "decode"]

# Engine arguments a pool cannot override: both pools must read the same weights and tokenizer at the
# same precision, and agree on the KV layout they hand over.
SHARED_ONLY = ("model", "tokenizer", "dtype", "device", "load_format", "max_model_len", "block_size",
               "generation_config", "quantization", "kv_cache_dtype")

# Admission control of a served engine (engine/scheduler.py `_check_admission`). Offline, the engine's
# queue is unbounded (LLM.generate queues a whole dataset at once); served, a request that cannot start
# soon is better refused with 429 + Retry-After, which a client or load balancer can act on, than
# queued for tens of seconds. Unless given, the queue ahead of a request is sized by the KV cache (its
# prompts may need at most the whole cache: SERVED_MAX_WAITING_KV_RATIO) and by this target delay
# (nothing ahead may have waited, or be predicted to wait, longer), under a ceiling of
# SERVED_WAITING_CEILING batches that keeps Serve's own slack (`max_ongoing_requests`) finite.
SERVED_MAX_QUEUE_DELAY_S = 5.0
SERVED_MAX_WAITING_KV_RATIO = 1.0
SERVED_WAITING_CEILING = 4
# With a whole-request limit, one KV handoff may take at most this share of it (and no less than the
# floor): a stuck transfer then fails while the request still has time for its one re-prefill, and the
# requests queued behind it on the same prefill/decode pair (transfers on a pair run one at a time) are
# not all held until they time out. Seen under the fault script: a replacement decode replica's first
# receive waited the engine's 60 s default past a 30 s request limit, and 29 requests got 504.
SERVED_KV_TRANSFER_SHARE = 1 / 3
SERVED_KV_TRANSFER_FLOOR_S = 5.0
# The disaggregated app's default router replicas per decode replica on GPUs. Measured on 2 x H100 (Llama-3.1-8B
# shapes, in 2048 / out 256, docs/benchmarks.md "Ninth session"): with one router the app saturated at ~7 req/s
# (~1,600 tokens/s streamed) while its decode replica ran 30-40 sequences at 10-13 ms a step; with four, at ~10.5.
# Every token of every request passes through a router's Python (Serve's streaming, the SSE body, metrics).
ROUTERS_PER_GPU_DECODE_REPLICA = 4
# A decode replica's default stream item budget (`stream_items_per_s`, engine/async_engine.py StreamPace). With GPUs:
# each item is a Ray object of its own, and one decode replica sent at most ~2,600 a second on an H100 host, so at
# 16 req/s its tokens reached the client every ~31 ms while its rank stepped every ~14 ms; at 1,000, TPOT was 14.8 ms
# (docs/benchmarks.md, "Tenth session"). On CPUs the engine and every Serve hop share a few cores, so each item
# costs compute too: on the 2-core box, 250 took PD at 8 clients from 0.80-0.85x colocated's request rate to
# 1.09-1.10x (two runs each, same session), with one-client TPOT within 1.03x.
STREAM_ITEMS_PER_S_GPU = 1000.0
STREAM_ITEMS_PER_S_CPU = 250.0


class PoolConfig(StrictModel):
    """One pool of engine replicas: its size (fixed or autoscaled), and engine-argument overrides for its
    replicas, given as extra keys (`tensor_parallel_size: 2`, `max_num_seqs: 64`, `rank_resources: {...}`)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, protected_namespaces=())

    num_replicas: int | None = Field(default=None, ge=1, description="Fixed replica count (default 1); "
                                     "leave unset when autoscaling_config is given.")
    autoscaling_config: dict[str, Any] | None = Field(default=None, description="Ray Serve autoscaling_config "
                                                      "(min_replicas, max_replicas, target_ongoing_requests, ...).")

    # Serve's defaults (a check every 10 s, 30 s to answer) leave a replica whose engine died (a rank process
    # lost) in the routing tables for up to 10 s, answering every request routed to it with 503. A check is
    # one flag read on the replica (`_PoolMethods.check_health`), so checking often costs nothing.
    health_check_period_s: float = Field(default=2.0, gt=0, description="Seconds between Serve's health checks "
                                         "of each replica; one whose engine stopped is replaced after the first "
                                         "failed check.")
    health_check_timeout_s: float = Field(default=10.0, gt=0, description="Seconds a replica may take to answer "
                                          "a health check before Serve counts it as failed.")

    @field_validator("autoscaling_config")
    @classmethod
    def _valid_autoscaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        # Serve's model ignores unknown keys; a misspelt key would silently fall back to a default.
        unknown = sorted(set(v) - set(AutoscalingConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown autoscaling_config keys {unknown}; known: {sorted(AutoscalingConfig.model_fields)}")
        AutoscalingConfig(**v)  # Serve's own checks (min <= max, positive targets, ...)
        return v

    @model_validator(mode="after")
    def _valid_overrides(self) -> "PoolConfig":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give either num_replicas or autoscaling_config, not both (Serve rejects the pair)")
        overrides = self.engine_overrides()
        for key in overrides:
            if key in SHARED_ONLY:
                raise ValueError(f"{key!r} is shared by both pools: set it at the top level, not per pool")
            if key not in ENGINE_FIELDS:
                raise ValueError(unknown_argument_message(key))
        # Each value validated (and coerced) by the engine's own field definitions.
        checked = EngineArgs(**overrides)
        for key in overrides:
            object.__setattr__(self, key, getattr(checked, key))  # keeps the coerced value; no re-validation
            self.__pydantic_extra__[key] = getattr(checked, key)
        return self

    def engine_overrides(self) -> dict[str, Any]:
        """The engine arguments this pool sets for its own replicas."""
        return dict(self.__pydantic_extra__ or {})

    def serve_options(self) -> dict[str, Any]:
        """The replica-count and health-check options for `Deployment.options(...)`."""
        health = {"health_check_period_s": self.health_check_period_s,
                  "health_check_timeout_s": self.health_check_timeout_s}
        if self.autoscaling_config is not None:
            return {"autoscaling_config": dict(self.autoscaling_config), **health}
        return {"num_replicas": self.num_replicas or 1, **health}


class AppConfig(EngineArgs):
    """Everything `router.app:build_app` needs, validated before any replica starts. The engine
    arguments at the top level apply to both pools; a pool's own keys override them for that pool."""

    served_model_name: str | None = Field(default=None, description="The name clients pass as `model`; "
                                          "defaults to the model folder's name.")
    prefill: PoolConfig = Field(default_factory=PoolConfig, description="The prefill pool: size and overrides.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="The decode pool: size and overrides.")
    colocated: bool = Field(default=False, description="One engine per replica does prefill and decode (no KV "
                            "handoff); it takes the decode pool's size and overrides.")
    local_prefill_max_tokens: int = Field(default=256, ge=0, description="Disaggregated: a prompt with at most "
                                          "this many tokens not already cached on its decode replica is prefilled "
                                          "there, with no KV handoff; 0 = hand every prompt off.")
    local_prefill_when_idle: bool = Field(default=True, description="Disaggregated: a decode replica with nothing "
                                          "running or queued prefills a prompt itself when one step holds it. With prefill_lane on, the router "
                                          "prefills such prompts over the lane instead, as quick for token 1.")
    router_prefill: bool = Field(default=True, description="Disaggregated: for a prompt that its decode replica "
                                 "would hand off whatever its state (or, fitting one step, while no decode replica "
                                 "is likely idle), the router calls the prefill pool itself, "
                                 "concurrently with the decode replica's reservation, and streams token 1 from the "
                                 "prefill replica's answer: two Serve hops before the first token instead of four.")
    prefill_lane: bool = Field(default=True, description="Disaggregated, with router_prefill: the router starts "
                               "its prefills and takes their token 1 over a direct TCP connection to the prefill "
                               "replica (a 'lane', router/prefill_lane.py) beside the Serve call, which still owns "
                               "the request: the Serve call's two hops leave the first token's path. False: Serve "
                               "calls only (no port opened on prefill replicas).")
    router_replicas: int | None = Field(default=None, ge=1, description="Disaggregated: replicas of the router, "
                                        "the deployment that takes every request and streams its tokens to the client. "
                                        "Default: with GPUs, 4 per decode replica, autoscaled with the decode pool "
                                        "when it autoscales (one router process streamed at most ~1,600 tokens/s on "
                                        "an H100 host); on CPUs, 1.")
    kv_push_pieces: bool = Field(default=False, description="Disaggregated: a decode replica that hands a prompt off "
                                 "itself asks the prefill replica for its KV in pieces, one per chunked-prefill step, "
                                 "moved while the later chunks compute; the rest goes with the first token. Prompts "
                                 "the router prefills itself (router_prefill) still move in one piece.")
    kv_transfers_in_flight: int = Field(default=1, ge=1, le=8, description="Disaggregated: KV transfers a decode "
                                        "replica keeps in flight at once with one prefill replica (1 to 8: each "
                                        "waits on a rank thread). They "
                                        "share the pair's one NCCL stream, so more overlap the host's work (Ray round "
                                        "trips, gathers, scatters), not the wire. 1: every served PD measurement so "
                                        "far was made with one at a time.")
    stream_items_per_s: float | None = Field(default=None, ge=0, description="Disaggregated: most stream items a "
                                             "decode replica sends its routers per second, over all its requests. Under "
                                             "load an item carries the tokens of several steps (a request's first and "
                                             "last are never held); below it every token is its own item. Default: "
                                             "1,000 with GPUs (one process sent at most ~2,600 a second on an H100 "
                                             "host), 250 on CPUs; 0 = one item per step always.")
    api_keys: list[str] = Field(default_factory=list, description="Accepted `Authorization: Bearer` keys; empty = no auth.")
    api_keys_env: str | None = Field(default=None, description="Environment variable with more comma-separated keys, "
                                     "read on the replica (keeps secrets out of the config).")
    request_timeout_s: float | None = Field(default=None, gt=0, description="Whole-request limit; past it: 504 / "
                                            "DEADLINE_EXCEEDED and the request is aborted. Unless given, the KV "
                                            "handoff's limit (kv_transfer_timeout_seconds) becomes a third of it "
                                            "(at least 5 s, at most 60 s), so a stuck transfer leaves time for a "
                                            "re-prefill.")
    max_request_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0, description="Largest request body (HTTP) "
                                        "or message (gRPC) accepted; larger: 413 / RESOURCE_EXHAUSTED, before parsing.")
    trace_requests: bool = Field(default=False, description="Log one JSON line per finished request (logger "
                                 "`tandem.trace`) with its stage timestamps relative to arrival: queue, prefill, KV "
                                 "push, decode admission, first decode step, first byte. `tandem serve` then sets "
                                 "RAY_DEDUP_LOGS=0 (unless set), so Ray does not fold the lines together.")
    sse_keepalive_s: float = Field(default=5.0, gt=0, description="A stream still queued after this many seconds "
                                   "starts with SSE comment lines (`: keep-alive`), repeated at this period until its "
                                   "first tokens, so that proxies' and clients' idle timeouts do not fire.")
    tool_call_parser: ToolCallParserName = Field(default="auto", description="How tool calls are read out of "
                                                 "a chat reply (vLLM's `--tool-call-parser`): `hermes` "
                                                 "(`<tool_call>{...}</tool_call>`, Qwen), `llama3_json` (`{\"name\", "
                                                 "\"parameters\"}` objects, Llama 3.1/3.2), or `auto`: `hermes` when "
                                                 "the chat template writes `<tool_call>`, else `llama3_json`.")
    max_prompt_chars: int | None = Field(default=None, gt=0, description="Most prompt characters per request (all "
                                         "prompts or messages), checked before tokenizing: 400 / INVALID_ARGUMENT; "
                                         "default: 32 x the context length in tokens.")
    max_queued_requests: int | None = Field(default=None, ge=-1, description="Requests Ray Serve may hold at each "
                                            "caller (proxy, router, decode replica) while every replica of a deployment "
                                            "is at its max_ongoing_requests; more: 429 + Retry-After / "
                                            "RESOURCE_EXHAUSTED at once. Default: the pool's max_num_seqs (the router: "
                                            "4 x the decode pool's); -1: unbounded (Serve's default).")

    @field_validator("max_queued_requests")
    @classmethod
    def _queued_bound(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("max_queued_requests must be -1 (no bound) or at least 1")
        return v

    @field_validator("api_keys")
    @classmethod
    def _non_empty_keys(cls, v: list[str]) -> list[str]:
        if any(not k.strip() for k in v):
            raise ValueError("api_keys must not contain empty keys")
        return v

    @model_validator(mode="after")
    def _pools(self) -> "AppConfig":
        if self.served_model_name is None:
            # Bypass validate_assignment (which would re-enter this validator).
            # A folder is served under its name; a Hugging Face ID under the whole ID, as vLLM does.
            name = self.model if is_model_id(self.model) else Path(self.model.rstrip("/")).name
            object.__setattr__(self, "served_model_name", name)
        for pool in ("prefill", "decode"):
            try:
                args = self.engine_args(pool)
            except ValidationError as e:  # a pool's overrides break a cross-field rule (the rank grid)
                raise ValueError(f"{pool}: {_first_error(e)}") from None
            if pool == "decode" and not self.colocated and args.parallel_config().sequence_parallel_size > 1:
                raise ValueError("decode: sequence_parallel_size > 1 splits long prompts; give it to the prefill "
                                 "pool (or set colocated: true)")
        if self.colocated and self.router_replicas is not None:
            raise ValueError("router_replicas sizes the disaggregated app's router; a colocated app has none "
                             "(its replicas take the requests themselves)")
        return self

    def starting_replicas(self, pool: Pool) -> int:
        """A pool's replicas at start: num_replicas, or autoscaling's initial (else min) replicas."""
        cfg = self.pool(pool)
        if cfg.autoscaling_config is not None:
            auto = cfg.autoscaling_config
            return auto["initial_replicas"] if auto.get("initial_replicas") is not None else auto.get("min_replicas", 1)
        return cfg.num_replicas or 1

    def resolved_stream_items_per_s(self, on_gpus: bool) -> float:
        """`stream_items_per_s`, or its default where the decode ranks run (GPUs or CPUs)."""
        if self.stream_items_per_s is not None:
            return self.stream_items_per_s
        return STREAM_ITEMS_PER_S_GPU if on_gpus else STREAM_ITEMS_PER_S_CPU

    def router_serve_options(self, on_gpus: bool) -> dict[str, Any]:
        """The Router deployment's size: `router_replicas` when given; on CPUs, 1; where the ranks run on GPUs, in
        step with the decode pool: ROUTERS_PER_GPU_DECODE_REPLICA per decode replica, fixed or autoscaled (bounds
        times that, and the decode pool's target of ongoing requests per replica split among them: every request
        streams through one router and one decode replica, so both see the same requests). At least one: the
        Router takes every request, so it never scales to zero."""
        if self.router_replicas is not None:
            return {"num_replicas": self.router_replicas}
        if not on_gpus:
            return {"num_replicas": 1}
        k = ROUTERS_PER_GPU_DECODE_REPLICA
        given = self.decode.autoscaling_config
        if given is None:
            return {"num_replicas": k * self.starting_replicas("decode")}
        resolved = AutoscalingConfig(**given)  # Serve's defaults for the bounds the config leaves out
        scaled = {**given, "min_replicas": max(1, k * resolved.min_replicas), "max_replicas": max(1, k * resolved.max_replicas),
                  "target_ongoing_requests": max(1.0, resolved.target_ongoing_requests / k)}
        if resolved.initial_replicas is not None:
            scaled["initial_replicas"] = max(1, k * resolved.initial_replicas)
        return {"autoscaling_config": scaled}

    def gpus_needed(self) -> dict[str, float]:
        """Ray GPUs each pool takes at its starting size (num_replicas, or autoscaling's initial/min
        replicas): replicas x ranks x gpus_per_rank. The colocated app is one pool with the decode pool's
        size. Only meaningful where the ranks run on GPUs."""
        pools: tuple[Pool, ...] = ("decode",) if self.colocated else ("prefill", "decode")
        needed = {}
        for pool in pools:
            replicas, parallel = self.starting_replicas(pool), self.engine_args(pool).parallel_config()
            needed["colocated" if self.colocated else pool] = replicas * parallel.world_size * parallel.gpus_per_rank
        return needed

    def pool(self, pool: Pool) -> PoolConfig:
        if pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be 'prefill' or 'decode', not {pool!r}")
        return self.prefill if pool == "prefill" else self.decode

    def engine_args(self, pool: Pool) -> EngineArgs:
        """The engine arguments of one replica of `pool`: the top level's, overridden by the pool's."""
        args = {**self.given(), **self.pool(pool).engine_overrides()}
        return EngineArgs(**{**_served_admission_defaults(args), **self._served_transfer_timeout(), **args})

    def _served_transfer_timeout(self) -> dict[str, float]:
        """The KV handoff's time limit under a request limit, unless given (SERVED_KV_TRANSFER_SHARE says why)."""
        if self.request_timeout_s is None:
            return {}
        engine_default = EngineArgs.model_fields["kv_transfer_timeout_seconds"].default
        share = max(SERVED_KV_TRANSFER_FLOOR_S, SERVED_KV_TRANSFER_SHARE * self.request_timeout_s)
        return {"kv_transfer_timeout_seconds": min(engine_default, share)}

    def engine_config(self, pool: Pool) -> EngineConfig:
        """The EngineConfig of one replica of `pool` (checks that the model folder exists on this node)."""
        return self.engine_args(pool).engine_config()

    def max_ongoing_requests(self, pool: Pool) -> int:
        """Serve's default of 5 concurrent requests per replica would starve continuous batching: let in
        what the engine can run plus twice the most it may queue. The slack matters: past this limit Serve
        queues requests itself, blind to priority (bounded by `backpressure_options`), so the engine's own
        bound (which counts only the requests ahead of a new one, by priority) must be what a surplus meets
        first."""
        args = self.engine_args(pool)
        return args.max_num_seqs + 2 * (args.max_waiting_requests or args.max_num_seqs)

    def backpressure_options(self, pool: Pool, scale: int = 1) -> dict[str, Any]:
        """Serve's own queue at each caller of a deployment of `pool` (`scale` x its bound for the router,
        whose replicas each take `scale` x a pool replica's requests): past it, Serve refuses at once
        (`BackPressureError` at a handle, which the front ends answer as 429 / RESOURCE_EXHAUSTED and
        count; Serve's proxy answers 429 itself for an ingress deployment) instead of queueing without
        bound. Retry-After there: a queue at the target delay has drained by then."""
        limit = self.max_queued_requests
        if limit is None:
            limit = self.engine_args(pool).max_num_seqs
        retry = self.engine_args(pool).max_queue_delay_s or 1.0
        return {"max_queued_requests": limit if limit == -1 else scale * limit,
                "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=retry)}

    def to_args(self) -> dict[str, Any]:
        """JSON args for the replicas, holding only what was given: they re-validate them, and the
        engine's rules for unset arguments (EP alone implies TP) must apply there as here."""
        return self.model_dump(mode="json", exclude_unset=True)

    def resolved_api_keys(self) -> frozenset[str]:
        keys = set(self.api_keys)
        if self.api_keys_env:
            keys.update(k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip())
        return frozenset(keys)


def _served_admission_defaults(args: dict[str, Any]) -> dict[str, Any]:
    """The served defaults of the engine's admission arguments (an explicit value, even null, wins)."""
    max_num_seqs = args.get("max_num_seqs", EngineArgs.model_fields["max_num_seqs"].default)
    return {"max_waiting_requests": SERVED_WAITING_CEILING * max_num_seqs,
            "max_waiting_kv_ratio": SERVED_MAX_WAITING_KV_RATIO, "max_queue_delay_s": SERVED_MAX_QUEUE_DELAY_S}


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]
