"""Every Tandem metric, in one place (the Grafana dashboard is checked against `METRICS`).

They are `ray.util.metrics` objects: inside a Ray cluster each process's values are exported by
Ray's metrics agent to Prometheus as `ray_<name>` (counters with a `_total` suffix unless the name
has one, histograms as `_bucket`/`_sum`/`_count`). Outside Ray (tests, the standalone server)
that recording is a cheap no-op, so callers never check.

Every metric also records into this process's own Prometheus registry (`REGISTRY`, `prometheus_text`)
under the same names less Ray's `ray_` prefix (`tandem_requests_total`,
`tandem_time_to_first_token_seconds_bucket`, ...). The OpenAI app's `GET /metrics` serves it: outside
Serve this process's registry alone; under Serve the registries of every live replica of the application
(ingress replicas, both pools of a disaggregated app, colocated replicas), which each replica publishes
to Ray's internal KV and the answering replica merges, adding a `replica` label to samples without one
(router/replica_metrics.py). So a scraper needs only the API port (and its key), not Ray's metrics port.

Names are vLLM's, with `tandem_` for `vllm:` (Ray refuses ':'), so vLLM dashboards and alerts port by
renaming; every metric a front end records carries `model_name`, every engine metric `model_name`, `pool`
and `replica` (the Serve replica; "local" outside Serve).

Who records what:
    front ends (openai_api, grpc_api), per request: tandem_time_to_first_token_seconds,
        tandem_request_time_per_output_token_seconds, tandem_inter_token_latency_seconds,
        tandem_e2e_request_latency_seconds, tandem_requests_total{status}, tandem_prompt_tokens_total,
        tandem_generation_tokens_total
    each engine replica's engine thread, after every engine call (LocalBackend, the pools):
        tandem_num_requests_running, tandem_num_requests_waiting, tandem_kv_cache_usage_perc,
        tandem_kv_blocks_used, tandem_prefix_cache_queries_total, tandem_prefix_cache_hits_total (tokens),
        tandem_num_preemptions_total
    the KV handoff, on the decode replica that receives it: tandem_kv_transfer_bytes, tandem_kv_transfer_seconds
        (model_name, pool, replica)
    each decode replica, per request: tandem_prefill_site_total{site, model_name, pool, replica} (local: prefilled
        there; remote: handed off)
    each engine replica that speculates (from its engine stats), with (model_name, pool, replica):
        tandem_spec_decode_num_drafts, tandem_spec_decode_num_draft_tokens, tandem_spec_decode_num_accepted_tokens,
        tandem_spec_decode_num_accepted_tokens_per_pos{..., position}
    front ends, per finished request, from its timeline (`RequestTimer`, `STAGES`):
        tandem_request_stage_seconds{stage, site}; with `trace_requests`, one JSON line on the `tandem.trace` logger
"""
from __future__ import annotations

import json
import logging
import time

import prometheus_client as prom
from ray.util import metrics as ray_metrics

# This process's own registry (not prometheus_client's global one, which Ray's own processes may use).
REGISTRY = prom.CollectorRegistry(auto_describe=True)


class Counter(ray_metrics.Counter):
    """A Ray counter that also counts in `REGISTRY`."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()):
        super().__init__(name, description=description, tag_keys=tag_keys)
        # prometheus_client adds `_total` itself, as Ray's exporter does for names without it.
        self._local = prom.Counter(name.removesuffix("_total"), description, tag_keys, registry=REGISTRY)

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        super().inc(value, tags=tags)
        (self._local.labels(**tags) if tags else self._local).inc(value)


class Gauge(ray_metrics.Gauge):
    """A Ray gauge that also sets its value in `REGISTRY`."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()):
        super().__init__(name, description=description, tag_keys=tag_keys)
        self._local = prom.Gauge(name, description, tag_keys, registry=REGISTRY)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        super().set(value, tags=tags)
        (self._local.labels(**tags) if tags else self._local).set(value)


class Histogram(ray_metrics.Histogram):
    """A Ray histogram that also observes into `REGISTRY`."""

    def __init__(self, name: str, description: str = "", boundaries: list[float] | None = None,
                 tag_keys: tuple[str, ...] = ()):
        super().__init__(name, description=description, boundaries=boundaries, tag_keys=tag_keys)
        self._local = prom.Histogram(name, description, tag_keys, buckets=boundaries, registry=REGISTRY)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        super().observe(value, tags=tags)
        (self._local.labels(**tags) if tags else self._local).observe(value)


def prometheus_text() -> tuple[bytes, str]:
    """This process's metrics in the Prometheus text format, and its content type."""
    return prom.generate_latest(REGISTRY), prom.CONTENT_TYPE_LATEST

# Latency buckets from interactive (10 ms) to long generations (5 min).
_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
_TOKEN_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56]
_STAGE_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0]
_TRANSFER_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

# vLLM's metric names (vllm:x is tandem_x here: Ray refuses ':' in names), labelled with the served model
# (`model_name`); engine gauges also with the pool and the Serve replica that reports them.
_MODEL = ("model_name",)
_ENGINE = ("model_name", "pool", "replica")
TTFT = Histogram("tandem_time_to_first_token_seconds", description="Time from request arrival to its first output token.",
                 boundaries=_LATENCY_S, tag_keys=_MODEL)
TPOT = Histogram("tandem_request_time_per_output_token_seconds", description="Mean time per output token after the "
                 "first, per request.", boundaries=_TOKEN_S, tag_keys=_MODEL)
ITL = Histogram("tandem_inter_token_latency_seconds", description="Time between two output tokens of a request, as its "
                "front end received them (tokens that arrive together share the gap).", boundaries=_TOKEN_S, tag_keys=_MODEL)
E2E = Histogram("tandem_e2e_request_latency_seconds", description="Time from request arrival to its last token.",
                boundaries=_LATENCY_S, tag_keys=_MODEL)
REQUESTS = Counter("tandem_requests_total", description="Finished requests by outcome.", tag_keys=("status", "model_name"))
PROMPT_TOKENS = Counter("tandem_prompt_tokens_total", description="Prompt tokens of finished requests (each choice's).",
                        tag_keys=_MODEL)
GENERATION_TOKENS = Counter("tandem_generation_tokens_total", description="Tokens generated for finished requests.",
                            tag_keys=_MODEL)
RUNNING = Gauge("tandem_num_requests_running", description="Sequences in the engine's running batch.", tag_keys=_ENGINE)
WAITING = Gauge("tandem_num_requests_waiting", description="Sequences waiting for admission to the running batch.",
                tag_keys=_ENGINE)
KV_USAGE = Gauge("tandem_kv_cache_usage_perc", description="Fraction of the KV cache's blocks in use (0 to 1).",
                 tag_keys=_ENGINE)
KV_BLOCKS_USED = Gauge("tandem_kv_blocks_used", description="KV cache blocks in use.", tag_keys=_ENGINE)
PREFIX_QUERIES = Counter("tandem_prefix_cache_queries_total", description="Prompt tokens looked up in the prefix cache.",
                         tag_keys=_ENGINE)
PREFIX_HITS = Counter("tandem_prefix_cache_hits_total", description="Prompt tokens whose KV came from the prefix cache.",
                      tag_keys=_ENGINE)
PREEMPTIONS = Counter("tandem_num_preemptions_total", description="Sequences preempted (their KV freed, recomputed "
                      "later) for lack of KV blocks.", tag_keys=_ENGINE)
# Recorded by the decode replica that receives the KV (pool="decode").
KV_TRANSFER_BYTES = Counter("tandem_kv_transfer_bytes", description="KV cache bytes sent from prefill to decode.",
                            tag_keys=_ENGINE)
KV_TRANSFER_SECONDS = Histogram("tandem_kv_transfer_seconds", description="Duration of one request's KV handoff.",
                                boundaries=_TRANSFER_S, tag_keys=_ENGINE)
PREFILL_SITE = Counter("tandem_prefill_site_total", description="Disaggregated requests by where their prompt was "
                       "prefilled: local (on the decode replica, conditional disaggregation) or remote (prefill pool).",
                       tag_keys=("site", *_ENGINE))
REQUEST_STAGE = Histogram("tandem_request_stage_seconds", description="Duration of one stage of a request's "
                          "timeline (`STAGES`), per site: colocated, local (prefilled on its decode replica) or remote "
                          "(handed off to the prefill pool).", boundaries=_STAGE_S, tag_keys=("stage", "site"))

# Speculative decoding (engine/spec_decode.py), vLLM's names: proposals, drafted and accepted tokens, and accepted
# tokens by draft position (acceptance at position i = accepted_per_pos{position=i} / drafts).
SPEC_DRAFTS = Counter("tandem_spec_decode_num_drafts", description="Speculative proposals verified (one per "
                      "speculating sequence and step).", tag_keys=_ENGINE)
SPEC_DRAFT_TOKENS = Counter("tandem_spec_decode_num_draft_tokens", description="Draft tokens proposed and verified.",
                            tag_keys=_ENGINE)
SPEC_ACCEPTED_TOKENS = Counter("tandem_spec_decode_num_accepted_tokens", description="Draft tokens the target accepted.",
                               tag_keys=_ENGINE)
SPEC_ACCEPTED_PER_POS = Counter("tandem_spec_decode_num_accepted_tokens_per_pos", description="Draft tokens accepted, "
                                "by position in the proposal (0 = first).", tag_keys=(*_ENGINE, "position"))

METRICS = {m.info["name"]: m for m in (TTFT, TPOT, ITL, E2E, REQUESTS, PROMPT_TOKENS, GENERATION_TOKENS, RUNNING, WAITING,
                                KV_USAGE, KV_BLOCKS_USED, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, KV_TRANSFER_BYTES,
                                KV_TRANSFER_SECONDS, PREFILL_SITE, REQUEST_STAGE, SPEC_DRAFTS, SPEC_DRAFT_TOKENS,
                                SPEC_ACCEPTED_TOKENS, SPEC_ACCEPTED_PER_POS)}


def replica_label() -> str:
    """The Serve replica this process runs ("local" outside Serve: tests, the standalone server)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # not in a Serve replica (Serve raises when asked outside one)
        return "local"
    replica_id = getattr(ctx, "replica_id", None)
    return getattr(replica_id, "unique_id", None) or getattr(ctx, "replica_tag", None) or "local"

# ---- request timelines (docs/architecture.md, "Request timeline") ----
# A finished request's `RequestOutput.timeline` holds wall-clock stamps (time.time()) from every process it
# crossed: "arrival" and "first_byte" (this front end), "replica_received", "reserved", "prefill_answered",
# "kv_queued", "kv_push_start", "kv_push_end" (the decode replica), "kv_send_start", "kv_send_end" (its
# prefill ranks' sends, which the decode replica hears of), "kv_recv_start", "kv_recv_posted", "kv_recv_end" (its ranks'), "prefill_called",
# "router_reserved", "router_answered" (the router, when it calls the prefill pool itself: its call, the decode
# replica's reservation and the prefill answer as it sees them), "router_lane_first" (token 1 in from the prefill
# lane, router/prefill_lane.py), "prefill_received", "prefill_returned" (the run's start on the prefill replica,
# at its lane's message or its Serve call's entry, whichever came first, and that call's return), "queued", "scheduled", "first_token" (the
# engine that ran the prompt), "decode_started", "first_decode_step" (the engine that decodes). Each stage is
# the time between two stamps: (name, start stamps (the first present counts), end stamp). A stage whose
# stamps are missing did not happen on the request's path (a colocated request has no KV push).
STAGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("dispatch", ("arrival",), "replica_received"),  # tokenizing, the Serve hop to the decode replica
    ("reserve", ("replica_received",), "reserved"),  # decode admission, part 1: KV blocks reserved
    # the call to the prefill pool, until its engine has it: from the router's call (router-driven prefill, sent
    # with the decode call) or else from the decode replica's reservation
    ("prefill_dispatch", ("prefill_called", "reserved"), "queued"),
    # router-driven prefill only: the Serve hop from the router's call into the prefill replica's method, and
    # the unary answer's trip from that method's return to the router, which token 1 waits for
    ("prefill_hop", ("prefill_called",), "prefill_received"),
    ("prefill_answer", ("prefill_returned",), "router_answered"),
    ("lane_first", ("first_token",), "router_lane_first"),  # with a prefill lane: token 1's trip to the router on it
    ("engine_dispatch", ("replica_received", "arrival"), "queued"),  # colocated/local: until the engine has it
    ("queue", ("queued",), "scheduled"),  # waiting for admission on the engine that prefills
    ("prefill", ("scheduled",), "first_token"),  # prefill compute, to the first sampled token
    ("prefill_return", ("first_token",), "prefill_answered"),  # token 1 and block ids back to the decode replica
    ("kv_wait", ("prefill_answered",), "kv_push_start"),  # token 1 passed on, the pair's lock, the thread hop
    ("kv_push", ("kv_push_start",), "kv_push_end"),
    # inside kv_push: the Ray calls' hops to the prefill ranks and to this replica's ranks, the prefill ranks'
    # sends (gather, NCCL, its sync), the decode ranks' receives (posting them and queueing the scatters; then
    # waiting for the messages and the scatters), and the answer's way back to this replica
    ("kv_send_hop", ("kv_push_start",), "kv_send_start"),
    ("kv_send", ("kv_send_start",), "kv_send_end"),
    ("kv_recv_hop", ("kv_push_start",), "kv_recv_start"),
    ("kv_recv_post", ("kv_recv_start",), "kv_recv_posted"),
    ("kv_recv_wait", ("kv_recv_posted",), "kv_recv_end"),
    ("kv_recv_return", ("kv_recv_end",), "kv_push_end"),
    ("decode_admission", ("kv_push_end",), "decode_started"),  # part 2: the request joins the running batch
    ("first_decode_step", ("decode_started", "first_token"), "first_decode_step"),
    ("first_byte", ("first_token",), "first_byte"),  # token 1's trip from the engine to the client
)
trace_log = logging.getLogger("tandem.trace")
trace_log.setLevel(logging.INFO)  # it logs only when `trace_requests` is on: then at INFO, whatever the root's level


def _trace_handler() -> None:
    """A process whose logging nobody configured (a Ray worker outside Serve's loggers) would drop INFO
    records through logging's last-resort handler: give the trace logger its own stderr handler then."""
    if not trace_log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        trace_log.addHandler(handler)


def timeline_site(timeline: dict[str, float]) -> str:
    """Where the request's prompt ran, from the stamps its path leaves."""
    if "prefill_answered" in timeline:
        return "remote"
    return "local" if "replica_received" in timeline else "colocated"


def stage_seconds(timeline: dict[str, float]) -> dict[str, float]:
    """Each stage of `STAGES` that the timeline has both stamps of. Stamps from different hosts may be
    skewed by their clocks: a stage that comes out negative is reported as 0."""
    out = {}
    for name, starts, end in STAGES:
        start = next((timeline[k] for k in starts if k in timeline), None)
        if start is not None and end in timeline:
            out[name] = max(0.0, timeline[end] - start)
    if "reserved" in timeline:  # a handoff's engine_dispatch is prefill_dispatch, already counted
        out.pop("engine_dispatch", None)
    return out


def record_timeline(request_id: str, timeline: dict[str, float], trace: bool) -> None:
    """Observe a finished request's stages; with `trace`, log its stamps relative to arrival (ms), in order."""
    site = timeline_site(timeline)
    for stage, seconds in stage_seconds(timeline).items():
        REQUEST_STAGE.observe(seconds, tags={"stage": stage, "site": site})
    if trace:
        _trace_handler()
        arrival = timeline.get("arrival", min(timeline.values()))
        ms = {k: round((v - arrival) * 1e3, 3) for k, v in sorted(timeline.items(), key=lambda kv: kv[1])}
        trace_log.info(json.dumps({"request_id": request_id, "site": site, "ms": ms}, separators=(",", ":")))


class RequestTimer:
    """Latency of one client request (one or more sequences): call `output` per backend output (or `token`
    per streamed token batch) and `sent` when response bytes go out. Its finished outputs' timelines are
    completed with this front end's stamps, recorded, and traced when `trace`."""

    def __init__(self, trace: bool = False, model_name: str = "") -> None:
        self.tags = {"model_name": model_name}
        self.num_prompt_tokens = 0  # the requests' prompts (each choice counts, as vLLM counts them): set by the front end
        self.start = time.perf_counter()
        self.arrival = time.time()  # wall clock: the timeline's origin, comparable with other processes' stamps
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        self.trace = trace
        self.first_byte: float | None = None
        self.timelines: list[tuple[str, dict[str, float]]] = []  # (engine request id, completed timeline)

    def output(self, out) -> None:
        """One backend output (`engine.llm_engine.RequestOutput`): its tokens, and its timeline once finished."""
        self.token(len(out.new_token_ids))
        if out.finished and out.timeline is not None:
            self.timelines.append((out.request_id, out.timeline))

    def sent(self) -> None:
        """Response bytes went to the client (the first call counts)."""
        if self.first_byte is None:
            self.first_byte = time.time()

    def token(self, n: int = 1) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:  # the gap since the last tokens, shared by the n that arrived together
            for _ in range(n):
                ITL.observe((now - self.last) / n, tags=self.tags)
        self.last = now
        self.num_tokens += n

    def finish(self, status: str) -> None:
        REQUESTS.inc(1, tags={"status": status, **self.tags})
        if status != "ok":
            return
        for counter, n in ((PROMPT_TOKENS, self.num_prompt_tokens), (GENERATION_TOKENS, self.num_tokens)):
            if n > 0:  # Ray's counters refuse an increment of 0
                counter.inc(n, tags=self.tags)
        self.sent()  # a unary response's first byte is its whole body, sent now
        for request_id, timeline in self.timelines:
            # The output's own dict (a new one per request on the engine side): completing it in place
            # leaves the full timeline on the caller's final RequestOutput.
            timeline.update(arrival=self.arrival, first_byte=self.first_byte)
            record_timeline(request_id, timeline, self.trace)
        if self.first is None:
            return
        TTFT.observe(self.first - self.start, tags=self.tags)
        E2E.observe(self.last - self.start, tags=self.tags)
        if self.num_tokens > 1:
            TPOT.observe((self.last - self.first) / (self.num_tokens - 1), tags=self.tags)


class PoolGauges:
    """Engine stats -> the pool's gauges and counters (an `AsyncEngine.on_step`). Called after every step and
    every other engine call (aborts, releases, reservations, lease expiry), so the gauges are true at rest,
    when no step follows a free. The engine's counters are cumulative; the Prometheus ones grow by difference."""

    def __init__(self, pool: str, model_name: str = "") -> None:
        self.tags = {"pool": pool, "model_name": model_name, "replica": replica_label()}
        self.seen: dict[str, int] = {}  # engine counter -> value already counted
        self.spec_seen: dict[str, int] = {}  # engine counter (or per-position key) -> value already counted

    def __call__(self, stats: dict) -> None:
        RUNNING.set(stats["running"], tags=self.tags)
        WAITING.set(stats["waiting"], tags=self.tags)
        KV_BLOCKS_USED.set(stats["blocks_used"], tags=self.tags)
        KV_USAGE.set(stats["blocks_used"] / max(stats["num_blocks"], 1), tags=self.tags)
        for key, metric in (("prefix_queried_tokens", PREFIX_QUERIES), ("prefix_hit_tokens", PREFIX_HITS),
                            ("preemptions", PREEMPTIONS)):
            value, seen = stats[key], self.seen.get(key, 0)
            if value > seen:
                metric.inc(value - seen, tags=self.tags)
            self.seen[key] = value
        self._spec(stats)

    def _spec(self, stats: dict) -> None:
        """The engine's cumulative speculative-decoding counters -> the Prometheus counters, by difference."""
        if not stats.get("spec_decode_num_drafts"):
            return
        tags = self.tags
        totals = {name: (metric, tags, stats[name]) for name, metric in (
            ("spec_decode_num_drafts", SPEC_DRAFTS), ("spec_decode_num_draft_tokens", SPEC_DRAFT_TOKENS),
            ("spec_decode_num_accepted_tokens", SPEC_ACCEPTED_TOKENS))}
        for pos, n in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
            totals[f"pos{pos}"] = (SPEC_ACCEPTED_PER_POS, {**tags, "position": str(pos)}, n)
        for key, (metric, tags, value) in totals.items():
            seen = self.spec_seen.get(key, 0)
            if value > seen:
                metric.inc(value - seen, tags=tags)
            self.spec_seen[key] = value
