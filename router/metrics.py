"""Every Tandem metric, in one place (the Grafana dashboard is checked against `METRICS`).

They are `ray.util.metrics` objects: inside a Ray cluster each process's values are exported by
Ray's metrics agent to Prometheus as `ray_<name>` (counters with a `_total` suffix unless the name
has one, histograms as `_bucket`/`_sum`/`_count`). Outside Ray (tests, the standalone server)
that recording is a cheap no-op, so callers never check.

Every metric also records into this process's own Prometheus registry, which the OpenAI app serves
at `GET /metrics` (`prometheus_text`) under the same names less Ray's `ray_` prefix
(`tandem_requests_total`, `tandem_ttft_seconds_bucket`, ...). So a scraper needs only the API port
(and its key), not Ray's metrics port. It is per process: one replica's front-end metrics, plus, for a
colocated replica, its own engine's gauges; the pools of a disaggregated app report through Ray.

Who records what:
    front ends (openai_api, grpc_api): tandem_ttft_seconds, tandem_tpot_seconds, tandem_e2e_seconds,
        tandem_requests_total{status}
    each engine replica's engine thread, after every engine call (LocalBackend, the pools): tandem_queue_depth{pool},
        tandem_kv_blocks_used{pool}, tandem_prefix_cache_hit_tokens
    the KV handoff (disaggregated pools): tandem_kv_transfer_bytes, tandem_kv_transfer_seconds
    each decode replica, per request: tandem_prefill_site_total{site} (local: prefilled there; remote: handed off)
"""
from __future__ import annotations

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

    def __init__(self, name: str, description: str = "", boundaries: list[float] | None = None):
        super().__init__(name, description=description, boundaries=boundaries)
        self._local = prom.Histogram(name, description, buckets=boundaries, registry=REGISTRY)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        super().observe(value, tags=tags)
        self._local.observe(value)


def prometheus_text() -> tuple[bytes, str]:
    """This process's metrics in the Prometheus text format, and its content type."""
    return prom.generate_latest(REGISTRY), prom.CONTENT_TYPE_LATEST

# Latency buckets from interactive (10 ms) to long generations (5 min).
_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
_TOKEN_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56]
_TRANSFER_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

TTFT = Histogram("tandem_ttft_seconds", description="Time from request arrival to its first output token.",
                 boundaries=_LATENCY_S)
TPOT = Histogram("tandem_tpot_seconds", description="Mean time per output token after the first, per request.",
                 boundaries=_TOKEN_S)
E2E = Histogram("tandem_e2e_seconds", description="Time from request arrival to its last token.", boundaries=_LATENCY_S)
QUEUE_DEPTH = Gauge("tandem_queue_depth", description="Requests waiting for admission, per pool.", tag_keys=("pool",))
REQUESTS = Counter("tandem_requests_total", description="Finished requests by outcome.", tag_keys=("status",))
PREFIX_CACHE_HIT_TOKENS = Counter("tandem_prefix_cache_hit_tokens",
                                  description="Prompt tokens whose KV came from the prefix cache.")
KV_BLOCKS_USED = Gauge("tandem_kv_blocks_used", description="KV cache blocks in use, per pool.", tag_keys=("pool",))
KV_TRANSFER_BYTES = Counter("tandem_kv_transfer_bytes", description="KV cache bytes sent from prefill to decode.")
KV_TRANSFER_SECONDS = Histogram("tandem_kv_transfer_seconds", description="Duration of one request's KV handoff.",
                                boundaries=_TRANSFER_S)
PREFILL_SITE = Counter("tandem_prefill_site_total", description="Disaggregated requests by where their prompt was "
                       "prefilled: local (on the decode replica, conditional disaggregation) or remote (prefill pool).",
                       tag_keys=("site",))

METRICS = {m.info["name"]: m for m in (TTFT, TPOT, E2E, QUEUE_DEPTH, REQUESTS, PREFIX_CACHE_HIT_TOKENS, KV_BLOCKS_USED,
                                KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS, PREFILL_SITE)}


class RequestTimer:
    """Latency of one client request (one or more sequences): call `token` per streamed token batch."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0

    def token(self, n: int = 1) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.num_tokens += n

    def finish(self, status: str) -> None:
        REQUESTS.inc(1, tags={"status": status})
        if status != "ok" or self.first is None:
            return
        TTFT.observe(self.first - self.start)
        E2E.observe(self.last - self.start)
        if self.num_tokens > 1:
            TPOT.observe((self.last - self.first) / (self.num_tokens - 1))


class PoolGauges:
    """Engine stats -> the pool's gauges and the prefix-hit counter (an `AsyncEngine.on_step`). Called after
    every step and every other engine call (aborts, releases, reservations, lease expiry), so the gauges
    are true at rest, when no step follows a free."""

    def __init__(self, pool: str) -> None:
        self.tags = {"pool": pool}
        self.hits_seen = 0

    def __call__(self, stats: dict) -> None:
        QUEUE_DEPTH.set(stats["waiting"], tags=self.tags)
        KV_BLOCKS_USED.set(stats["blocks_used"], tags=self.tags)
        hits = stats["prefix_hit_tokens"]
        if hits > self.hits_seen:
            PREFIX_CACHE_HIT_TOKENS.inc(hits - self.hits_seen)
        self.hits_seen = hits
