"""The OpenAI HTTP front end over a real LocalBackend: tiny model, in-process, no Ray.

Most tests go through FastAPI's TestClient (one event loop for the module); the last ones run the
app under uvicorn on a real socket, for the official `openai` client and for real disconnects.
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest
from fastapi.testclient import TestClient

from router.openai_api import create_openai_app
from tests.models import CORPUS
from tests.serving import ENGINE_KWARGS, LiveServer, build_chat_model, make_backend, slow_engine, wait_for, wait_idle
from tandem import LLM, SamplingParams

PROMPTS = [CORPUS[0], CORPUS[4]]
NAME = "chat-llama"  # the served model name: the model folder's name


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, show_progress=False, **ENGINE_KWARGS)


def _serve(backend, **app_kwargs):
    """A TestClient (its own event loop) over an app on `backend`; closes the backend on exit."""
    client = TestClient(create_openai_app(backend, **app_kwargs))
    client.__enter__()
    return client


def _close(client, backend):
    client.portal.call(backend.close)
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served(model):
    backend = make_backend(model)
    client = _serve(backend)
    yield client, backend
    _close(client, backend)


@pytest.fixture
def client(served):
    client, backend = served
    yield client
    # Every test leaves the engine empty: no request and no KV block outlives its response.
    _wait_idle(client, backend)


def _stats(client, backend) -> dict:
    return client.portal.call(backend.stats)


def _wait_idle(client, backend, timeout: float = 10.0) -> dict:
    return wait_idle(lambda: _stats(client, backend), timeout)


def _events(text: str) -> list[dict]:
    """SSE body -> JSON events; checks the framing and the closing [DONE]."""
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def _assert_error(r, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


def _ref(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


# ---------------------------------------------------------------- completions


@pytest.mark.parametrize("prompt", [PROMPTS[0], [5, 17, 42, 99, 7, 150]], ids=["text", "token_ids"])
def test_greedy_completion_matches_llm(client, llm, prompt):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = _ref(llm, prompt, max_tokens=12, temperature=0)
    [choice] = body["choices"]
    assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    assert body["object"] == "text_completion" and body["model"] == NAME
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    assert body["usage"]["total_tokens"] == len(ref.prompt_token_ids) + len(ref.token_ids)


def test_batch_prompts_and_n(client, llm):
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    refs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [o.text for o in refs]
    # A prompt is counted once however many choices it has.
    assert body["usage"]["prompt_tokens"] == len(refs[0].prompt_token_ids) + len(refs[2].prompt_token_ids)
    assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in refs)


def test_seeded_sampling_is_reproducible_and_matches_llm(client, llm):
    req = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 1.0, "seed": 1234}
    texts = [client.post("/v1/completions", json=req).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1] == _ref(llm, PROMPTS[1], max_tokens=10, temperature=1.0, seed=1234).text


@pytest.mark.parametrize("extra", [
    {"ignore_eos": True, "max_tokens": 24},
    {"min_tokens": 6, "max_tokens": 12},
    {"top_k": 5, "temperature": 0.8, "seed": 3},
    {"min_p": 0.1, "temperature": 1.0, "seed": 4},
    {"top_p": 0.5, "temperature": 1.0, "seed": 5},
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.5, "frequency_penalty": 0.5},
], ids=lambda e: ",".join(e))
def test_sampling_extras_match_llm(client, llm, extra):
    params = {"max_tokens": 12, "temperature": 0, **extra}
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], **params}).json()
    ref = _ref(llm, PROMPTS[0], **params)
    assert body["choices"][0]["text"] == ref.text
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)


def test_stop_token_ids_and_stop_strings(client, llm):
    ref = _ref(llm, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True)
    stop_id = ref.token_ids[5]
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                                                  "ignore_eos": True, "stop_token_ids": [stop_id]}).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == ref.token_ids.index(stop_id) + 1
    # A stop string taken from the greedy output ends the text just before its first occurrence.
    stop = ref.text[len(ref.text) // 2:][:2]
    req = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}
    body = client.post("/v1/completions", json=req).json()
    expected = _ref(llm, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    assert body["choices"][0]["text"] == expected.text and body["choices"][0]["finish_reason"] == expected.finish_reason
    assert stop not in body["choices"][0]["text"]


def test_completion_logprobs(client, llm):
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                                  "logprobs": 3}).json()
    lp = body["choices"][0]["logprobs"]
    ref = _ref(llm, PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ref.token_ids)
    assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    for sampled, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3
        assert sampled == pytest.approx(max(top.values()), abs=1e-5)  # greedy takes the most likely token
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stream_equals_non_stream_with_usage_chunk(client, endpoint):
    chat = endpoint.endswith("chat/completions")
    req = {"max_tokens": 16, "temperature": 0, "n": 2,
           **({"messages": [{"role": "user", "content": PROMPTS[1]}]} if chat else {"prompt": PROMPTS[1]})}
    full = client.post(endpoint, json=req).json()
    r = client.post(endpoint, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    *chunks, last = events
    texts, finish = ["", ""], [None, None]
    for ev in chunks:
        assert ev["object"] == ("chat.completion.chunk" if chat else "text_completion") and ev["usage"] is None
        [c] = ev["choices"]
        texts[c["index"]] += (c["delta"].get("content", "") if chat else c["text"])
        finish[c["index"]] = finish[c["index"]] or c["finish_reason"]
    if chat:
        first = [next(ev for ev in chunks if ev["choices"][0]["index"] == i) for i in (0, 1)]
        assert all(ev["choices"][0]["delta"]["role"] == "assistant" for ev in first)
    got = [c["message"]["content"] if chat else c["text"] for c in full["choices"]]
    assert texts == got
    assert finish == [c["finish_reason"] for c in full["choices"]]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert last["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    # Without include_usage: no usage anywhere.
    plain = _events(client.post(endpoint, json={**req, "stream": True}).text)
    assert all("usage" not in ev and ev["choices"] for ev in plain)


def test_stream_logprobs_cover_every_token(client):
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "logprobs": 1,
                                             "stream": True, "stream_options": {"include_usage": True}})
    events = _events(r.text)
    tokens = [t for ev in events[:-1] for t in ev["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == events[-1]["usage"]["completion_tokens"]


# ---------------------------------------------------------------- chat


def test_chat_uses_the_template_and_matches_llm_chat(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPTS[0]}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0}).json()
    ref = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0))
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ref.text}
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    # The content-parts form renders the same prompt.
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]}, messages[1]]
    again = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 10, "temperature": 0}).json()
    assert again["choices"][0]["message"]["content"] == ref.text


def test_chat_logprobs(client):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                                                       "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and len(item["top_logprobs"]) == 2
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"], abs=1e-5)


# ---------------------------------------------------------------- errors


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 300}, "max_tokens"),  # prompt + 300 > max_model_len 256
    ("/v1/completions", {"prompt": [1, 2, 300]}, "prompt"),  # vocabulary is [0, 300)
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, None),
    # unknown fields are accepted (tests/test_api_surface.py); known-but-unsupported ones are 400s
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 40},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "messages"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_openai_400_and_server_keeps_serving(client, endpoint, body, param):
    _assert_error(client.post(endpoint, json=body), 400, param)
    ok = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_invalid_json_is_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert "JSON" in _assert_error(r, 400)["message"]


def test_unknown_model_is_404(client):
    err = _assert_error(client.post("/v1/completions", json={"prompt": "x", "model": "gpt-5"}), 404, "model")
    assert err["code"] == "model_not_found"
    _assert_error(client.get("/v1/models/gpt-5"), 404)
    _assert_error(client.get("/v1/no-such-route"), 404)


def test_models_and_health(client):
    assert client.get("/health").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [NAME] and data[0]["max_model_len"] == 256
    assert client.get(f"/v1/models/{NAME}").json()["id"] == NAME


class _NotReady:
    """A backend that is still starting."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def ready(self) -> bool:
        return False


def test_not_ready_is_503(served):
    client = TestClient(create_openai_app(_NotReady(served[1])))
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert _assert_error(r, 503)["type"] == "service_unavailable" and r.headers["retry-after"] == "1"


def test_api_keys_401(served):
    client = TestClient(create_openai_app(_NotReady(served[1]), api_keys=["sk-one", "sk-two"]))
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-one"}, {"Authorization": "Basic sk-one"}):
        err = _assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
        _assert_error(client.get("/v1/models", headers=headers), 401)
    # 401 comes before the body is even parsed.
    _assert_error(client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401)
    assert client.get("/health").status_code == 503  # public: reports readiness without a key
    good = {"Authorization": "Bearer sk-two"}
    assert client.get("/v1/models", headers=good).status_code == 200
    _assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers=good), 503)  # past auth


@contextlib.contextmanager
def _recording_aborts(backend):
    """Records the request ids the front end aborts (the backend still aborts them)."""
    aborted: list[str] = []
    real_abort = backend.abort

    async def recording_abort(request_id: str) -> None:
        aborted.append(request_id)
        await real_abort(request_id)

    backend.abort = recording_abort
    try:
        yield aborted
    finally:
        del backend.abort


def test_disconnect_mid_stream_aborts_and_frees_blocks(served):
    client, backend = served
    with _recording_aborts(backend) as aborted, slow_engine(backend):
        req = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=req) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a discarded line iterator would close the response here
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert _stats(client, backend)["running"] == 1 and not aborted
        # Leaving the block closes the response mid-stream, as a client that goes away.
        stats = _wait_idle(client, backend, timeout=5.0)
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-")
    assert stats["blocks_used"] == 0


# ---------------------------------------------------------------- queue limits and timeouts


def test_full_queue_is_429_with_retry_after(model):
    backend = make_backend(model, max_num_seqs=1, max_waiting_requests=1)
    client = _serve(backend)
    try:
        with slow_engine(backend):
            long = {"prompt": PROMPTS[0], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
            results: list = []
            threads = [threading.Thread(target=lambda: results.append(client.post("/v1/completions", json=long)))
                       for _ in range(2)]
            threads[0].start()  # runs (max_num_seqs=1) ...
            wait_for(lambda: _stats(client, backend)["running"] == 1)
            threads[1].start()  # ... and this one waits (max_waiting_requests=1)
            wait_for(lambda: _stats(client, backend)["waiting"] == 1)
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            err = _assert_error(r, 429)
            assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
            _assert_error(r, 429)  # streaming too: the status comes before the stream starts
            for t in threads:
                t.join(timeout=60)
            assert [x.status_code for x in results] == [200, 200]
            assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            _wait_idle(client, backend)
    finally:
        _close(client, backend)


def test_request_timeout_is_504_and_aborts(model):
    backend = make_backend(model)
    client = _serve(backend, request_timeout_s=0.3)
    try:
        with slow_engine(backend):  # 200 tokens take >= 2 s
            long = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
            err = _assert_error(client.post("/v1/completions", json=long), 504)
            assert err["type"] == "timeout"
            _wait_idle(client, backend)
            # A stream that is already running reports the timeout in-band, then ends (or, on a machine
            # too loaded to produce the first token in time, answers 504 before streaming).
            r = client.post("/v1/completions", json={**long, "stream": True})
            if r.status_code == 200:
                assert _events(r.text)[-1]["error"]["type"] == "timeout"
            else:
                _assert_error(r, 504)
            _wait_idle(client, backend)
    finally:
        _close(client, backend)


# ---------------------------------------------------------------- a real socket (uvicorn)


@pytest.fixture(scope="module")
def live(model):
    backend = make_backend(model)
    server = LiveServer(create_openai_app(backend))
    yield server, backend
    server.call(backend.close)
    server.stop()


def test_openai_client_round_trip(live, llm):
    import openai

    server, _ = live
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    ref = _ref(llm, PROMPTS[0], max_tokens=8, temperature=0)
    assert oa.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0).choices[0].text == ref.text
    chunks = oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(chunks)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    assert [m.id for m in oa.models.list()] == [NAME]
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=NAME, prompt="x", max_tokens=-3)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x")


def _raw_post(port: int, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return s


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_socket_closed_mid_request_frees_blocks(live, stream):
    server, backend = live
    with _recording_aborts(backend) as aborted, slow_engine(backend):
        s = _raw_post(server.port, {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": stream})
        try:
            if stream:
                received = b""
                while b"data: " not in received:
                    received += s.recv(4096)
                assert received.startswith(b"HTTP/1.1 200")
            else:
                wait_for(lambda: server.call(backend.stats)["running"] == 1)
        finally:
            s.close()
        wait_for(lambda: server.call(backend.stats)["running"] == 0, timeout=5.0)
    assert len(aborted) == 1
    stats = server.call(backend.stats)
    assert stats["blocks_used"] == 0 and stats["waiting"] == 0
