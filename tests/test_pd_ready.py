"""Issue 24, defect 4a: once the disaggregated app reports RUNNING, its first request succeeds.

The router used to start asking the decode pool for its limits at the first request and answer that
request 503 "the model is not ready to serve yet". Now the router's Serve health check (which Serve
runs before the replica counts as started) waits for both pools, and a request that comes before the
pools answered waits for them, bounded.

- In process, no Ray: `DisaggregatedBackend` over a stand-in for the decode pool's handle (a
  LocalBackend behind it) whose `info` answers late, under the OpenAI app.
- Under Ray Serve (slow): `serve.run` of the disaggregated app, then at once one request.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import pytest
import ray
from fastapi.testclient import TestClient

from parallel.net import free_port
from router.config import AppConfig
from router.disaggregated import DisaggregatedBackend
from router.openai_api import create_openai_app
from tests.serving import ENGINE_KWARGS, build_chat_model, make_backend, shutdown_serve

NAME = "pd-ready"
INFO_DELAY_S = 1.0  # how long the stand-in decode pool takes to answer `info` (still loading its model)


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Stream:
    """A `DeploymentResponseGenerator` stand-in: an async iterator, `cancel()` closes it."""

    def __init__(self, agen: AsyncIterator):
        self.agen = agen

    def __aiter__(self) -> AsyncIterator:
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


class FakeDecodeHandle:
    """The decode pool's handle as `DisaggregatedBackend` uses it, over an in-process LocalBackend.
    `info` answers after `info_delay_s`, like a pool whose replica is still loading its model."""

    def __init__(self, local, info_delay_s: float):
        self.local = local
        self.info_delay_s = info_delay_s
        self.info_calls = 0
        self.info = _Method(self._info)
        self.generate = _Method(lambda req: _Stream(self.local.generate(req)))

    async def _info(self) -> dict:
        self.info_calls += 1
        await asyncio.sleep(self.info_delay_s)
        return {"max_model_len": self.local.max_model_len, "vocab_size": self.local.vocab_size}

    def options(self, **_: Any) -> "FakeDecodeHandle":
        return self


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


def _disaggregated(model: str, info_delay_s: float, **kw) -> DisaggregatedBackend:
    config = AppConfig(model=model, served_model_name=NAME, **ENGINE_KWARGS)
    return DisaggregatedBackend(config, FakeDecodeHandle(make_backend(model), info_delay_s), **kw)


def test_first_request_waits_for_the_pools_instead_of_503(model):
    backend = _disaggregated(model, INFO_DELAY_S)
    with TestClient(create_openai_app(backend)) as client:
        start = time.monotonic()
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert time.monotonic() - start >= INFO_DELAY_S * 0.9  # it did wait for the pool's answer
        assert r.json()["usage"]["completion_tokens"] == 4
        assert client.get("/health").status_code == 200
        client.portal.call(backend.decode.local.close)
    assert backend.decode.info_calls == 1  # asked once, then remembered


def test_pools_that_never_answer_get_503_after_the_bound(model):
    backend = _disaggregated(model, info_delay_s=3600.0, ready_wait_s=0.5)
    with TestClient(create_openai_app(backend)) as client:
        start = time.monotonic()
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 2})
        waited = time.monotonic() - start
    assert r.status_code == 503
    assert 0.4 <= waited < 10


def test_failed_info_is_retried_by_the_next_caller(model):
    backend = _disaggregated(model, INFO_DELAY_S)
    answers = iter([ConnectionError("decode replica restarting"), None])
    real = backend.decode.info.remote

    async def flaky() -> dict:
        error = next(answers)
        if error is not None:
            raise error
        return await real()

    backend.decode.info.remote = flaky

    async def probe() -> tuple[bool, bool]:
        return await backend.wait_ready(5.0), await backend.wait_ready(5.0)

    assert asyncio.run(probe()) == (False, True)


@pytest.mark.slow
def test_first_request_after_serve_run_succeeds(model, shared_ray):
    """`serve.run` returns once the app is RUNNING: its very first request must be answered, not 503."""
    import httpx2
    from ray import serve

    from router.app import build_app

    http_port = free_port()
    try:  # Serve on the session's Ray (tests/conftest.py)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = {"model": model, "served_model_name": NAME, **ENGINE_KWARGS, "max_num_seqs": 4,
                "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}
        serve.run(build_app(args), name="tandem", route_prefix="/")
        r = httpx2.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60,
                        json={"model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # router/kv_peers.py: the prefill replica announced its ranks, and the decode replica built its KV pair with
        # it on its own, before any handoff (this request was prefilled on the idle decode replica).
        (prefill_id, handles, _), pair_id = _announced_peer_and_pair()
        assert _within(30, lambda: ray.get(handles[0].kv.remote("has_group", pair_id))), f"{pair_id} not warmed"
    finally:
        shutdown_serve()
    from router import kv_peers
    assert kv_peers.peers(kv_peers.peers_kv(), "tandem") == []  # withdrawn at the graceful shutdown


def _announced_peer_and_pair() -> tuple[tuple, str]:
    """The one announced prefill replica (replica id, rank handles, shards) and its pair id with the one decode replica."""
    from router import kv_peers

    assert _within(30, lambda: kv_peers.peers(kv_peers.peers_kv(), "tandem")), "no prefill replica announced"
    (peer,) = kv_peers.peers(kv_peers.peers_kv(), "tandem")
    (decode,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#DecodePool#" in a["name"]]
    return peer, f"{peer[0]}->decode-{decode.split('#')[-1]}"


def _within(seconds: float, ok) -> bool:
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
