"""Issue 19 item 1 under real Ray Serve: `n` > 1 and prompt lists through the disaggregated app
(Router -> DecodePool -> PrefillPool, every prompt handed off). Before each fanned-out stream had a
Serve request of its own, the children of one client request shared its internal request id and
Serve's request router served them about one per 10 s. One Ray start for the module."""
from __future__ import annotations

import json
import time

import pytest

from parallel.net import free_port
from tests.models import CORPUS
from tests.serving import ENGINE_KWARGS, build_chat_model, shutdown_serve

pytestmark = pytest.mark.slow

NAME = "fanout-llama"
# Far under the 10 s a stalled child took per step of Serve's retry: 16 children would need minutes.
LIMIT_S = 60.0


@pytest.fixture(scope="module")
def url(tmp_path_factory, shared_ray):
    from ray import serve

    from router.app import build_app

    model = build_chat_model(tmp_path_factory.mktemp("models") / NAME)
    port = free_port()
    try:  # Serve on the session's Ray (tests/conftest.py)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": model, "colocated": False, "local_prefill_max_tokens": 0, "local_prefill_when_idle": False,
                "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}, **ENGINE_KWARGS}
        serve.run(build_app(args), name="tandem", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown_serve()


def _post(url: str, body: dict):
    import httpx2

    t0 = time.monotonic()
    r = httpx2.post(f"{url}/v1/completions", json=body, timeout=LIMIT_S)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("prompt,n", [(CORPUS[0], 16), ([CORPUS[i % 5] for i in range(32)], 1)], ids=["n16", "list32"])
def test_n_and_prompt_lists_are_served_promptly(url, prompt, n, stream):
    r, seconds = _post(url, {"prompt": prompt, "n": n, "max_tokens": 4, "ignore_eos": True, "stream": stream})
    assert r.status_code == 200, r.text
    expected = (len(prompt) if isinstance(prompt, list) else 1) * n
    if stream:
        frames = [json.loads(f[6:]) for f in r.text.split("\n\n") if f.startswith("data: {")]
        finished = {c["index"] for f in frames for c in f["choices"] if c["finish_reason"]}
    else:
        finished = {c["index"] for c in r.json()["choices"] if c["finish_reason"] == "length"}
    assert finished == set(range(expected)), f"{len(finished)} of {expected} choices finished in {seconds:.1f}s"
