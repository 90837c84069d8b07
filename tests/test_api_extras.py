"""vLLM's /tokenize, /detokenize and /version, the X-Request-Id header, and SSE keep-alive comments
while a stream's first tokens are still queued (the real engine on a tiny chat model)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from router.openai_api import create_openai_app
from tests.serving import LiveServer, build_chat_model, make_backend, slow_engine

NAME = "extras-llama"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


@pytest.fixture(scope="module")
def backend(model):
    return make_backend(model)


@pytest.fixture(scope="module")
def client(backend):
    with TestClient(create_openai_app(backend)) as c:
        yield c


def test_tokenize_and_detokenize_match_the_tokenizer(client, model):
    tok = AutoTokenizer.from_pretrained(model)
    r = client.post("/tokenize", json={"prompt": "def f(x):", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("def f(x):") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] == 256
    chat = client.post("/tokenize", json={"messages": HELLO}).json()
    assert chat["tokens"] == list(tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert chat["token_strs"] is None
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": tok.decode(body["tokens"])}
    bad = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = client.post("/tokenize", json={"prompt": "x", "messages": HELLO})
    assert both.status_code == 400 and "either" in both.json()["error"]["message"]
    assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_version(client):
    from importlib import metadata

    r = client.get("/version")
    assert r.status_code == 200 and r.json()["version"] == metadata.version("tandem")


def test_x_request_id_is_echoed_or_made(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    made = client.get("/health").headers["x-request-id"]
    assert len(made) == 32 and made != client.get("/health").headers["x-request-id"]
    refused = client.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "trace-43"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "trace-43"
    odd = client.get("/health", headers={"X-Request-Id": "a b"}).headers["x-request-id"]
    assert odd != "a b" and len(odd) == 32  # not a header value to echo: a new one


def test_sse_keep_alive_while_the_first_token_is_queued(backend):
    import httpx2

    live = LiveServer(create_openai_app(backend, sse_keepalive_s=0.1))
    body = {"prompt": "x", "max_tokens": 2, "stream": True, "temperature": 0}
    try:
        with slow_engine(backend, seconds_per_step=0.45):  # the first token takes > 4 keep-alive periods
            with httpx2.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
        first_data = next(k for k, line in enumerate(lines) if line.startswith("data:"))
        assert first_data >= 2 and all(line == ": keep-alive" for line in lines[:first_data])
        assert lines[-1] == "data: [DONE]" and not any(line.startswith(":") for line in lines[first_data:])
        # a fast first token: no comment at all (the default period is 5 s)
        fast = LiveServer(create_openai_app(backend))
        try:
            with httpx2.stream("POST", f"{fast.url}/v1/completions", json=body, timeout=30) as r:
                assert not any(line.startswith(":") for line in r.iter_lines())
        finally:
            fast.stop()
    finally:
        live.stop()


def test_keep_alive_stream_reports_a_late_error_in_band(backend):
    """Once the 200 went out with comments, an error before the first token arrives as an error event."""
    import httpx2

    live = LiveServer(create_openai_app(backend, sse_keepalive_s=0.05, request_timeout_s=0.3))
    body = {"prompt": "x", "max_tokens": 2, "stream": True}
    try:
        with slow_engine(backend, seconds_per_step=0.6):
            with httpx2.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
        assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2] and "timeout" in lines[-2]
    finally:
        live.stop()
