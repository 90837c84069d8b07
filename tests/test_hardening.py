"""Issue 19, items 2-4: request limits checked before tokenizing, text work off the event loop, metrics
on the API port, honest bind addresses and warnings, no internals in client-facing errors, and
engine request ids made by the server. In-process: FastAPI's TestClient, uvicorn, grpc.aio; no Ray."""
from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.request

import grpc
import pytest
from fastapi.testclient import TestClient
from ray.exceptions import RayTaskError

from router.grpc_api import InferenceServicer
from router.openai_api import create_openai_app
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from router.protocol import BackendUnavailable
from tests.models import CORPUS
from tests.serving import LiveServer, build_chat_model, make_backend, slow_engine, wait_idle
from tests.test_grpc_api import _code, _Harness

NAME = "guard-llama"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


@pytest.fixture(scope="module")
def backend(model):
    backend = make_backend(model)
    yield backend
    # closed by whichever loop the last user ran on; the engine thread stops with the process otherwise


@pytest.fixture(scope="module")
def client(backend):
    with TestClient(create_openai_app(backend)) as client:
        yield client
        client.portal.call(backend.close)


@pytest.fixture(scope="module")
def harness():
    h = _Harness()
    yield h
    h.close()


@pytest.fixture(scope="module")
def grpc_backend(harness, model):
    backend = make_backend(model)
    harness.backends.append(backend)
    return backend


@pytest.fixture(scope="module")
def stub(harness, grpc_backend):
    return pb_grpc.InferenceStub(harness.serve(InferenceServicer(grpc_backend)))


class _SpyTokenizer:
    """The backend's tokenizer, recording `encode` calls and optionally blocking in them (a huge prompt)."""

    def __init__(self, inner, block_s: float = 0.0):
        self._inner, self.block_s = inner, block_s
        self.encoded = 0
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text, *args, **kwargs):
        self.encoded += 1
        self.entered.set()
        time.sleep(self.block_s)  # blocking, as a slow tokenizer is: it holds whichever thread calls it
        return self._inner.encode(text, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.encoded += 1
        self.entered.set()
        time.sleep(self.block_s)
        return self._inner.apply_chat_template(*args, **kwargs)


@contextlib.contextmanager
def spy_tokenizer(backend, block_s: float = 0.0):
    real = backend.tokenizer
    spy = backend.tokenizer = _SpyTokenizer(real, block_s)
    try:
        yield spy
    finally:
        backend.tokenizer = real


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------- item 2: limits before tokenizing


def test_oversized_body_is_413_before_parsing(client, backend):
    big = "a" * (5 * 1024 * 1024)  # over the default 4 MiB
    with spy_tokenizer(backend) as spy:
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": big, "max_tokens": 1})
        assert _error(r, 413)["code"] == "request_too_large"
        assert time.monotonic() - t0 < 5 and spy.encoded == 0
        # A chunked body (no Content-Length) is cut off too.
        chunks = (big[i:i + 65536].encode() for i in range(0, len(big), 65536))
        r = client.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert _error(r, 413)["code"] == "request_too_large" and spy.encoded == 0
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_over_the_character_limit_is_400_without_tokenizing(client, backend, endpoint):
    text = "word " * 2000  # 10000 characters > 32 x max_model_len (256): cannot fit, never encoded
    body = {"prompt": [CORPUS[0], text]} if endpoint == "completions" else \
        {"messages": [{"role": "user", "content": text}]}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    with spy_tokenizer(backend) as spy:
        err = _error(client.post(path, json={**body, "max_tokens": 1}), 400)
        assert spy.encoded == 0
    assert "characters" in err["message"] and err["param"] == ("prompt" if endpoint == "completions" else "messages")


def test_limits_are_configurable(backend):
    from router.guards import RequestLimits

    with TestClient(create_openai_app(backend, limits=RequestLimits(max_body_bytes=2000, max_prompt_chars=100))) as c:
        assert _error(c.post("/v1/completions", json={"prompt": "x" * 3000}), 413)["code"] == "request_too_large"
        assert "at most 100" in _error(c.post("/v1/completions", json={"prompt": "x" * 150}), 400)["message"]
        assert c.post("/v1/completions", json={"prompt": "x" * 50, "max_tokens": 1}).status_code == 200


def test_tokenizing_does_not_block_health_or_other_requests(model):
    backend = make_backend(model)
    server = LiveServer(create_openai_app(backend))
    try:
        with spy_tokenizer(backend, block_s=2.0) as spy:
            body = json.dumps({"prompt": CORPUS[1], "max_tokens": 1}).encode()
            slow = threading.Thread(target=lambda: urllib.request.urlopen(urllib.request.Request(
                f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}), timeout=30).read())
            slow.start()
            assert spy.entered.wait(10)
            t0 = time.monotonic()
            with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
                assert r.status == 200
            with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as r:
                assert r.status == 200
            assert time.monotonic() - t0 < 1.0, "the event loop waited on a tokenizer"
            slow.join(30)
    finally:
        server.call(backend.close)
        server.stop()


def test_grpc_limits_before_tokenizing(harness, grpc_backend, stub):
    from router.guards import RequestLimits

    with spy_tokenizer(grpc_backend) as spy:
        code, details = _code(stub.Generate, pb.GenerateRequest(prompt="word " * 2000, max_tokens=1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "characters" in details and spy.encoded == 0
        small = pb_grpc.InferenceStub(harness.serve(InferenceServicer(grpc_backend, limits=RequestLimits(max_body_bytes=1000))))
        code, _ = _code(small.Generate, pb.GenerateRequest(prompt="x" * 2000, max_tokens=1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and spy.encoded == 0


def test_grpc_tokenizing_does_not_block_other_calls(grpc_backend, stub):
    with spy_tokenizer(grpc_backend, block_s=2.0) as spy:
        slow = stub.Generate.future(pb.GenerateRequest(prompt=CORPUS[1], max_tokens=1))
        assert spy.entered.wait(10)
        t0 = time.monotonic()
        fast = stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 17, 42], max_tokens=1), timeout=10)
        assert fast.finish_reason and time.monotonic() - t0 < 1.0, "the event loop waited on a tokenizer"
        assert slow.result(timeout=30).finish_reason


# ---------------------------------------------------------------- item 3: metrics, binds, warnings


def _samples(text: str, name: str) -> dict[str, float]:
    """Every sample of metric `name` in a Prometheus text page: {label text: value}."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M)}


def test_vllm_named_metrics_move_with_traffic_and_rest_at_zero(client, backend):
    """vLLM's names (tandem_ for vllm:) with model_name (and pool, replica on the engine's): the counters grow
    by what the requests did, and the engine's gauges are back at 0 once they finish."""
    before = client.get("/metrics").text
    prompt = CORPUS[1]
    for _ in range(2):  # the second run of the same prompt hits the prefix cache
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True}).json()
    n_prompt = body["usage"]["prompt_tokens"]
    wait_idle(lambda: client.portal.call(backend.stats))
    after = client.get("/metrics").text

    def total(text: str, name: str) -> float:  # this app's samples (other tests' engines share the registry)
        return sum(v for k, v in _samples(text, name).items() if f'model_name="{backend.model_name}"' in k)

    assert total(after, "tandem_prompt_tokens_total") - total(before, "tandem_prompt_tokens_total") == 2 * n_prompt
    assert total(after, "tandem_generation_tokens_total") - total(before, "tandem_generation_tokens_total") == 10
    assert total(after, "tandem_prefix_cache_queries_total") > total(before, "tandem_prefix_cache_queries_total")
    assert total(after, "tandem_prefix_cache_hits_total") > total(before, "tandem_prefix_cache_hits_total")
    assert total(after, "tandem_inter_token_latency_seconds_count") >= total(before, "tandem_inter_token_latency_seconds_count") + 8
    for name in ("tandem_time_to_first_token_seconds_count", "tandem_e2e_request_latency_seconds_count",
                 "tandem_request_time_per_output_token_seconds_count"):
        assert total(after, name) == total(before, name) + 2, name
    ours = f'model_name="{backend.model_name}",pool="colocated",replica="local"'  # this process: no Serve replica
    for gauge in ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_perc",
                  "tandem_kv_blocks_used"):
        assert _samples(after, gauge)[ours] == 0.0, gauge  # at rest
    assert "tandem_num_preemptions_total" in after


def test_metrics_on_the_api_port(client, backend):
    assert client.post("/v1/completions", json={"prompt": CORPUS[0], "max_tokens": 2}).status_code == 200
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert re.search(r'^tandem_requests_total\{[^}]*status="ok"[^}]*\} [1-9]', r.text, re.M)
    assert "tandem_time_to_first_token_seconds_bucket" in r.text and "tandem_kv_blocks_used" in r.text
    keyed = TestClient(create_openai_app(backend, api_keys=["sk-m"]))
    assert _error(keyed.get("/metrics"), 401)["code"] == "invalid_api_key"
    assert "tandem_requests_total" in keyed.get("/metrics", headers={"Authorization": "Bearer sk-m"}).text


def test_cli_prints_what_is_bound_and_warns_without_keys():
    from tandem.serving import ServeSpec, bound_addresses, exposure_warnings, ready_line

    local = ServeSpec.from_args({})
    local.override(host="127.0.0.1", port=8001, grpc_port=9001)
    # Serve's gRPC proxy binds every interface whatever the HTTP host: said, not hidden.
    assert bound_addresses(local) == {"http": "127.0.0.1:8001", "grpc": "*:9001"}
    line = ready_line(local, 1.0)
    assert "http://127.0.0.1:8001/v1" in line and "*:9001" in line and "127.0.0.1:9001" not in line
    [warning] = exposure_warnings(local, [])
    assert "gRPC" in warning and "*:9001" in warning
    public = ServeSpec.from_args({})
    assert len(exposure_warnings(public, [])) == 2 and "0.0.0.0:8000" in exposure_warnings(public, [])[0]
    assert exposure_warnings(public, ["sk"]) == []


# ---------------------------------------------------------------- item 4: errors and request ids

_SECRET = ("Traceback (most recent call last):\n  File \"/home/ray/anaconda3/lib/python3.11/site-packages/ray/x.py\", "
           "line 3\nactor died: pid=4242, ip=10.1.2.3, actor_id=0123456789abcdef0123456789abcdef")


def _ray_wrapped(cause: Exception) -> Exception:
    """What a Ray handle raises for an exception in a replica: the cause's type, a remote traceback's text."""
    return RayTaskError("DecodePool.generate", _SECRET, cause, pid=4242, ip="10.1.2.3",
                        actor_id="0123456789abcdef0123456789abcdef").as_instanceof_cause()


class _Failing:
    """A backend whose requests fail with `exc` after `after` outputs."""

    def __init__(self, inner, exc: Exception, after: int = 0):
        self._inner, self.exc, self.after = inner, exc, after

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, req):
        n = 0
        async for out in self._inner.generate(req):
            if n == self.after:
                raise self.exc
            n += 1
            yield out


FAILURES = {"ray_value_error": _ray_wrapped(ValueError("bad prompt at /srv/models/x.py pid=4242")),
            "replica_died": BackendUnavailable(f"decode replica failed during request r-1: {_SECRET}"),
            "unexpected": RuntimeError(f"boom in /home/ray/app/router/pools.py: {_SECRET}")}


def _assert_clean(message: str) -> None:
    for leak in ("Traceback", "/home", "/srv", ".py", "4242", "10.1.2.3", "0123456789abcdef", "actor_id"):
        assert leak not in message, f"{leak!r} leaked: {message}"
    assert "request id" in message


@pytest.mark.parametrize("kind", sorted(FAILURES))
@pytest.mark.parametrize("after", [0, 1], ids=["before_first_token", "mid_stream"])
def test_http_errors_show_no_internals(backend, kind, after):
    failing = _Failing(backend, FAILURES[kind], after)
    with TestClient(create_openai_app(failing)) as c:
        r = c.post("/v1/completions", json={"prompt": CORPUS[0], "max_tokens": 8, "ignore_eos": True})
        assert r.status_code in (400, 500, 503)
        _assert_clean(r.json()["error"]["message"])
        r = c.post("/v1/completions", json={"prompt": CORPUS[0], "max_tokens": 8, "ignore_eos": True, "stream": True})
        text = r.text if r.status_code == 200 else r.json()["error"]["message"]
        _assert_clean(text)
        wait_idle(lambda: c.portal.call(backend.stats))


@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_grpc_errors_show_no_internals(harness, grpc_backend, kind):
    stub = pb_grpc.InferenceStub(harness.serve(InferenceServicer(_Failing(grpc_backend, FAILURES[kind]))))
    for rpc in (stub.Generate, stub.GenerateStream):
        code, details = _code(rpc, pb.GenerateRequest(prompt=CORPUS[0], max_tokens=4))
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        _assert_clean(details)


def test_grpc_client_ids_are_labels_not_engine_ids(harness, grpc_backend, stub):
    """Two clients (or one, twice) may use the same request_id at once: each gets its own request."""
    with slow_engine(grpc_backend):
        first = stub.GenerateStream(pb.GenerateRequest(prompt=CORPUS[0], max_tokens=30, ignore_eos=True,
                                                       request_id="shared-id"))
        head = next(first)
        second = stub.Generate(pb.GenerateRequest(prompt=CORPUS[1], max_tokens=3, request_id="shared-id"), timeout=30)
        rest = list(first)
    assert second.request_id == "shared-id" and second.finish_reason
    assert all(p.request_id == "shared-id" for p in [head, *rest]) and rest[-1].finish_reason
    wait_idle(lambda: harness.stats(grpc_backend))


# ---------------------------------------------------------------- item 1: n > 1 and prompt lists


class _RecordingServeContext:
    """A backend recording the Serve request context each `generate` runs in (Serve's handle calls read it)."""

    def __init__(self, inner):
        self._inner = inner
        self.internal_ids: list[str] = []
        self.batch_sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, req):
        from ray.serve.context import _get_serve_request_context

        self.internal_ids.append(_get_serve_request_context()._internal_request_id)
        return self._inner.generate(req)

    def generate_batch(self, reqs):
        from ray.serve.context import _get_serve_request_context

        self.internal_ids.append(_get_serve_request_context()._internal_request_id)
        self.batch_sizes.append(len(reqs))
        return self._inner.generate_batch(reqs)


def _as_serve_request(app, internal_id: str):
    """The app as a Serve replica runs it: each request inside a Serve request context of its own."""
    from ray.serve import context as serve_context

    async def asgi(scope, receive, send):
        serve_context._serve_request_context.set(serve_context._RequestContext(request_id="client-visible",
                                                                              _internal_request_id=internal_id))
        await app(scope, receive, send)

    return asgi


@pytest.mark.parametrize("body", [{"prompt": CORPUS[0], "n": 4}, {"prompt": [CORPUS[0], CORPUS[1], CORPUS[2]]}],
                         ids=["n", "prompt_list"])
def test_fanout_children_are_separate_serve_requests(backend, body):
    """Serve's request router indexes pending requests by their internal id: children of one client
    request that share it stall one another (issue 19 item 1). The choices now go as one batched call
    (router/fanout.py), which carries an id of its own."""
    recording = _RecordingServeContext(backend)
    with TestClient(_as_serve_request(create_openai_app(recording), "parent-id")) as c:
        r = c.post("/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.text
    ids = recording.internal_ids
    assert recording.batch_sizes == [len(r.json()["choices"])] and len(r.json()["choices"]) > 1
    assert len(ids) == 1 and "parent-id" not in ids


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("body", [{"prompt": CORPUS[0], "n": 16}, {"prompt": [CORPUS[i % 5] for i in range(32)]},
                                  {"prompt": [CORPUS[1], CORPUS[3]], "n": 8}], ids=["n16", "list32", "list2_n8"])
def test_large_n_and_prompt_lists_complete(client, backend, body, stream):
    r = client.post("/v1/completions", json={**body, "max_tokens": 4, "ignore_eos": True, "stream": stream}, timeout=60)
    assert r.status_code == 200, r.text
    expected = len(body["prompt"]) * body.get("n", 1) if isinstance(body["prompt"], list) else body["n"]
    if stream:
        frames = [json.loads(f[6:]) for f in r.text.split("\n\n") if f.startswith("data: {")]
        finished = {c["index"] for f in frames for c in f["choices"] if c["finish_reason"]}
    else:
        finished = {c["index"] for c in r.json()["choices"] if c["finish_reason"] == "length"}
    assert finished == set(range(expected))
    wait_idle(lambda: client.portal.call(backend.stats))
