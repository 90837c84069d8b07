"""GET /metrics of a Serve application merges every replica's page (router/replica_metrics.py): the
merge itself, the pages' life in the KV (stale ones skipped, long-stale ones deleted), and the KV
transfer metrics' labels. In-process: real prometheus_client registries, an in-memory KV; the path
through Ray's KV and Serve is tests/test_serve_disagg.py::test_api_port_metrics_cover_every_replica."""
from __future__ import annotations

import collections
import re
import time

import prometheus_client as prom
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import metrics, replica_metrics
from router.replica_metrics import (FORGET_AFTER_S, STALE_AFTER_S, application_page, encode_page, live_pages,
                                    merge_expositions, page_key, publish_once)


class MemoryKV:
    """`replica_metrics.KeyValue` over a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.data if k.startswith(prefix)]

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)


def _replica_page(replica: str, requests: int, running: float, latencies: list[float]) -> str:
    """One replica's page, shaped as router/metrics.py's: a front-end counter and histogram without a
    `replica` label, an engine gauge with one."""
    registry = prom.CollectorRegistry()
    counter = prom.Counter("tandem_requests", "Finished requests.", ("status", "model_name"), registry=registry)
    counter.labels(status="ok", model_name="m").inc(requests)
    gauge = prom.Gauge("tandem_num_requests_running", "Running.", ("model_name", "pool", "replica"), registry=registry)
    gauge.labels(model_name="m", pool="decode", replica=replica).set(running)
    hist = prom.Histogram("tandem_e2e_request_latency_seconds", "Latency.", ("model_name",), buckets=(0.1, 1.0),
                          registry=registry)
    for v in latencies:
        hist.labels(model_name="m").observe(v)
    return prom.generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_merge_keeps_every_replicas_series_under_one_help_and_type():
    text = merge_expositions({"r1": _replica_page("r1", 3, 2, [0.05, 0.5]),
                              "r2": _replica_page("r2", 5, 0, [2.0])}).decode()
    kinds = collections.Counter(re.findall(r"^# TYPE (\S+) ", text, re.M))
    helps = collections.Counter(re.findall(r"^# HELP (\S+) ", text, re.M))
    assert kinds["tandem_requests_total"] == kinds["tandem_num_requests_running"] == 1
    assert kinds["tandem_e2e_request_latency_seconds"] == 1
    assert set(kinds.values()) == {1} and set(helps.values()) == {1} and kinds.keys() == helps.keys()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parseable
    assert families["tandem_requests"].type == "counter"
    assert families["tandem_e2e_request_latency_seconds"].type == "histogram"
    samples = _samples(text)
    for replica, requests in (("r1", 3.0), ("r2", 5.0)):  # the front-end counter got each replica's label
        assert samples[("tandem_requests_total", (("model_name", "m"), ("replica", replica), ("status", "ok")))] == requests
    # The engine gauge already had its replica label: kept, not doubled.
    assert samples[("tandem_num_requests_running", (("model_name", "m"), ("pool", "decode"), ("replica", "r1")))] == 2.0
    assert samples[("tandem_num_requests_running", (("model_name", "m"), ("pool", "decode"), ("replica", "r2")))] == 0.0
    bucket = "tandem_e2e_request_latency_seconds_bucket"
    assert samples[(bucket, (("le", "1.0"), ("model_name", "m"), ("replica", "r1")))] == 2.0
    assert samples[(bucket, (("le", "1.0"), ("model_name", "m"), ("replica", "r2")))] == 0.0
    assert samples[("tandem_e2e_request_latency_seconds_count", (("model_name", "m"), ("replica", "r2")))] == 1.0
    # Every sample of the merged page is one replica's: no series without a replica label, none twice.
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert all('replica="' in ln for ln in lines) and len(lines) == len(set(ln.rsplit(" ", 1)[0] for ln in lines))


def test_pages_of_dead_replicas_are_skipped_then_deleted():
    kv, now = MemoryKV(), time.time()
    page = _replica_page("x", 1, 0, [])
    for replica, age in (("me", 0.0), ("fresh", 1.0), ("stale", STALE_AFTER_S + 1), ("gone", FORGET_AFTER_S + 1)):
        kv.put(page_key("app", replica), encode_page(replica, page, now - age))
    kv.put(page_key("other-app", "elsewhere"), encode_page("elsewhere", page, now))
    kv.put(page_key("app", "broken"), b"not json")
    assert set(live_pages(kv, "app", "me", now)) == {"fresh"}  # its own page: the caller has it live
    assert set(kv.data) == {page_key("app", r) for r in ("me", "fresh", "stale")} | {page_key("other-app", "elsewhere")}


def test_application_page_under_serve_merges_this_registry_with_the_others(monkeypatch):
    kv = MemoryKV()
    tags = {"status": "ok", "model_name": "merge-test"}
    metrics.REQUESTS.inc(1, tags=tags)
    # One process here plays two replicas: "other" published its page a moment ago, "me" answers live.
    publish_once(kv, "app", "other")
    metrics.REQUESTS.inc(1, tags=tags)
    monkeypatch.setattr(replica_metrics, "serve_identity", lambda: ("app", "me"))
    body, content_type = application_page(kv)
    assert content_type == prom.CONTENT_TYPE_LATEST
    ok = {dict(labels)["replica"]: value for (name, labels), value in _samples(body.decode()).items()
          if name == "tandem_requests_total" and ("model_name", "merge-test") in labels}
    assert ok == {"other": 1.0, "me": 2.0}


def test_outside_serve_the_page_is_this_process_registry():
    assert replica_metrics.serve_identity() is None
    assert replica_metrics.start_publishing(MemoryKV()) is False
    body, _ = application_page(MemoryKV())
    assert body == metrics.prometheus_text()[0]


def test_kv_transfer_metrics_carry_model_pool_and_replica():
    from engine.disagg import TransferStats
    from router.pools import _record_transfer

    tags = {"model_name": "xfer-test", "pool": "decode", "replica": "r9"}
    _record_transfer(TransferStats(bytes=4096, seconds=0.01, blocks=2), tags)
    text = metrics.prometheus_text()[0].decode()
    labels = 'model_name="xfer-test",pool="decode",replica="r9"'
    assert f"tandem_kv_transfer_bytes_total{{{labels}}} 4096.0" in text
    assert f"tandem_kv_transfer_seconds_count{{{labels}}} 1.0" in text


@pytest.mark.parametrize("metric", ["tandem_kv_transfer_bytes", "tandem_kv_transfer_seconds"])
def test_kv_transfer_metrics_declare_the_engine_labels(metric):
    assert tuple(metrics.METRICS[metric].info["tag_keys"]) == ("model_name", "pool", "replica")


@pytest.mark.parametrize("metric,tag_keys", [
    ("tandem_prefill_site_total", ("site", "model_name", "pool", "replica")),
    ("tandem_spec_decode_num_drafts", ("model_name", "pool", "replica")),
    ("tandem_spec_decode_num_draft_tokens", ("model_name", "pool", "replica")),
    ("tandem_spec_decode_num_accepted_tokens", ("model_name", "pool", "replica")),
    ("tandem_spec_decode_num_accepted_tokens_per_pos", ("model_name", "pool", "replica", "position")),
])
def test_engine_counters_name_their_model_and_replica(metric, tag_keys):
    """Two models or replicas behind one Prometheus never add up into one series."""
    assert tuple(metrics.METRICS[metric].info["tag_keys"]) == tag_keys


def test_spec_counters_are_recorded_with_the_pool_gauges_tags():
    gauges = metrics.PoolGauges("decode", "spec-labels")
    gauges({"running": 0, "waiting": 0, "blocks_used": 0, "num_blocks": 1, "prefix_queried_tokens": 0,
            "prefix_hit_tokens": 0, "preemptions": 0, "spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 6,
            "spec_decode_num_accepted_tokens": 4, "spec_decode_num_accepted_tokens_per_pos": [2, 1, 1]})
    text = metrics.prometheus_text()[0].decode()
    labels = f'model_name="spec-labels",pool="decode",replica="{gauges.tags["replica"]}"'
    assert f"tandem_spec_decode_num_draft_tokens_total{{{labels}}} 6.0" in text
    per_pos = f'model_name="spec-labels",pool="decode",position="0",replica="{gauges.tags["replica"]}"'  # sorted by name
    assert f"tandem_spec_decode_num_accepted_tokens_per_pos_total{{{per_pos}}} 2.0" in text
