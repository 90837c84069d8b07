"""One `GET /metrics` page for a whole Serve application: every live replica's registry, merged.

Each process records into its own `router.metrics.REGISTRY`, but a scrape reaches one ingress replica,
and the pools of a disaggregated app (Router -> DecodePool -> PrefillPool) have no HTTP port at all. So
every replica process publishes its registry's text every `PUBLISH_INTERVAL_S` seconds to Ray's internal
KV (the GCS), under `<application>/<replica id>` in the `NAMESPACE` namespace, with a wall-clock stamp
(`start_publishing`, called once per process by each deployment's constructor). The replica that answers
`/metrics` reads its own registry live and the others' latest pages, skips pages older than
`STALE_AFTER_S` (a replica that died or was scaled down), deletes those older than `FORGET_AFTER_S`, and
merges them (`merge_expositions`): one HELP/TYPE per family, and a `replica` label added to every sample
that lacks one (front-end metrics), so no two replicas' series collide. Prometheus then aggregates
across replicas with `sum by (...)` as it would over separate targets.

Nothing reads Ray's metrics port. Outside Serve (tests, the standalone server) the page is this
process's registry, as before. The stamps are wall clock, compared across hosts: a node whose clock is
off by more than `STALE_AFTER_S` would have its pages skipped (NTP keeps them within milliseconds).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

import prometheus_client as prom
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import REGISTRY, prometheus_text, replica_label

log = logging.getLogger(__name__)

NAMESPACE = "tandem_metrics"
PUBLISH_INTERVAL_S = 2.0
STALE_AFTER_S = 5 * PUBLISH_INTERVAL_S  # several missed publishes: the replica is gone (or stuck)
FORGET_AFTER_S = 300.0  # a page this old is deleted from the KV by whichever replica reads it

_publisher: threading.Thread | None = None
_publisher_lock = threading.Lock()


class KeyValue(Protocol):
    """The part of Ray's internal KV the page needs (`RayKV`; tests pass an in-memory one)."""

    def keys(self, prefix: str) -> list[str]: ...

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


class RayKV:
    """Ray's internal KV (the GCS) in one namespace (`NAMESPACE` unless given). Its calls block: run them off the
    event loop."""

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        return [k.decode() for k in internal_kv._internal_kv_list(prefix, namespace=self.namespace)]

    def get(self, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=self.namespace)

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=self.namespace)


def serve_identity() -> tuple[str, str] | None:
    """(application, replica label) of the Serve replica this process runs; None outside Serve."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not in a Serve replica (Serve raises when asked outside one)
        return None
    replica = replica_label()
    return (ctx.app_name, replica) if replica != "local" else None


def page_key(app: str, replica: str) -> str:
    return f"{app}/{replica}"


def encode_page(replica: str, text: str, now: float) -> bytes:
    return json.dumps({"replica": replica, "time": now, "text": text}).encode()


def publish_once(kv: KeyValue, app: str, replica: str) -> None:
    """Write this process's registry as the replica's latest page."""
    text = prom.generate_latest(REGISTRY).decode()
    kv.put(page_key(app, replica), encode_page(replica, text, time.time()))


def _publish_loop(kv: KeyValue, app: str, replica: str) -> None:
    failing = False
    while True:
        try:
            publish_once(kv, app, replica)
            failing = False
        except Exception as e:  # noqa: BLE001 - the GCS briefly away: try again next interval, log once
            if not failing:
                log.warning("could not publish this replica's metrics to Ray's KV: %r", e)
            failing = True
        time.sleep(PUBLISH_INTERVAL_S)


def start_publishing(kv: KeyValue | None = None) -> bool:
    """Publish this process's registry periodically, once per process (later calls do nothing); a no-op
    outside a Serve replica. True when a publisher runs."""
    global _publisher
    identity = serve_identity()
    if identity is None:
        return False
    with _publisher_lock:
        if _publisher is None:
            _publisher = threading.Thread(target=_publish_loop, args=(kv or RayKV(), *identity),
                                          name="tandem-metrics-publisher", daemon=True)
            _publisher.start()
    return True


def live_pages(kv: KeyValue, app: str, own_replica: str, now: float) -> dict[str, str]:
    """The other replicas' latest pages (replica -> text) of `app`, skipping stale ones and deleting
    long-stale ones. This replica's own page is left out: the caller has its registry live."""
    pages = {}
    for key in kv.keys(page_key(app, "")):
        raw = kv.get(key)
        if raw is None:  # deleted since listed
            continue
        try:
            page = json.loads(raw)
            replica, stamp, text = page["replica"], float(page["time"]), page["text"]
        except (ValueError, KeyError, TypeError):
            log.warning("dropping an unreadable metrics page %s", key)
            kv.delete(key)
            continue
        age = now - stamp
        if age > FORGET_AFTER_S:
            kv.delete(key)
        if replica != own_replica and age <= STALE_AFTER_S:
            pages[replica] = text
    return pages


class _Families:
    """A fixed list of metric families, in the shape `prom.generate_latest` collects from."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_expositions(pages: Mapping[str, str]) -> bytes:
    """Several processes' Prometheus text pages (replica -> text) as one page: each family once (the HELP
    and TYPE of the first page that has it), its samples from every page, a `replica` label added to
    samples without one. A family whose type differs from the first page's (a rolling update that
    changed it) keeps the first page's samples only."""
    families: dict[str, Metric] = {}
    seen: set[tuple] = set()
    for replica, text in pages.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            if merged.type != family.type:
                log.warning("metric %s is a %s on replica %s but a %s elsewhere: its samples there are left out",
                            family.name, family.type, replica, merged.type)
                continue
            for sample in family.samples:
                labels = sample.labels if "replica" in sample.labels else {**sample.labels, "replica": replica}
                series = (sample.name, tuple(sorted(labels.items())))
                if series not in seen:  # two pages naming the same replica: its first page wins
                    seen.add(series)
                    merged.samples.append(sample._replace(labels=labels))
    return prom.generate_latest(_Families(families.values()))


def application_page(kv: KeyValue | None = None) -> tuple[bytes, str]:
    """The page `GET /metrics` serves, and its content type: every live replica of this Serve application
    merged, or, outside Serve, this process's registry. Blocks on Ray's KV: call it off the event loop."""
    identity = serve_identity()
    if identity is None:
        return prometheus_text()
    app, replica = identity
    own = prom.generate_latest(REGISTRY).decode()
    try:
        others = live_pages(kv or RayKV(), app, replica, time.time())
    except Exception as e:  # noqa: BLE001 - the GCS unreachable: this replica's metrics are still worth serving
        log.warning("could not read the other replicas' metrics from Ray's KV: %r", e)
        others = {}
    return merge_expositions({replica: own, **others}), prom.CONTENT_TYPE_LATEST
