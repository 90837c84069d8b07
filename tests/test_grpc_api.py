"""The gRPC front end over a real LocalBackend: grpc.aio servers in-process (one event loop in a
thread), called with the generated synchronous stubs. No Ray."""
from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time

import grpc
import pytest

from router.grpc_api import InferenceServicer, add_to_aio_server
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.models import CORPUS
from tests.serving import ENGINE_KWARGS, build_chat_model, make_backend, slow_engine, wait_for, wait_idle
from tandem import LLM, SamplingParams

NAME = "grpc-llama"
PROMPT = CORPUS[2]
KEY = [("authorization", "Bearer sk-grpc")]


class _Harness:
    """An event loop in a thread hosting grpc.aio servers (each its own port) and their backends."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[grpc.aio.Server] = []
        self.backends = []

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, servicer: InferenceServicer) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.serve_port(servicer)}")

    def serve_port(self, servicer: InferenceServicer) -> int:
        async def start():
            server = grpc.aio.server()
            add_to_aio_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            return port

        return self.run(start())

    def stats(self, backend) -> dict:
        return self.run(backend.stats())

    def close(self):
        for server in self.servers:
            self.run(server.stop(None))
        for backend in self.backends:
            self.run(backend.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, show_progress=False, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def harness():
    h = _Harness()
    yield h
    h.close()


@pytest.fixture(scope="module")
def backend(harness, model):
    b = make_backend(model)
    harness.backends.append(b)
    return b


@pytest.fixture(scope="module")
def stub(harness, backend):
    return pb_grpc.InferenceStub(harness.serve(InferenceServicer(backend)))


@pytest.fixture(autouse=True)
def _engine_left_empty(request, harness):
    yield
    if "backend" in request.fixturenames:  # every test leaves no request and no KV block behind
        _wait_idle(harness, request.getfixturevalue("backend"))


def _wait_idle(harness, backend, timeout: float = 10.0) -> dict:
    return wait_idle(lambda: harness.stats(backend), timeout)


def _code(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = fn(*args, **kwargs)
        if not isinstance(result, pb.GenerateResponse):
            list(result)  # a stream fails while it is read
    return e.value.code(), e.value.details()


# ---------------------------------------------------------------- the contract with Serve's gRPC proxy


def test_servicer_methods_have_the_shape_serve_calls():
    """Serve calls the ingress method named like the RPC with the request proto and `grpc_context`;
    server-streaming methods must be generators."""
    rpcs = {m.name: m for m in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    assert set(rpcs) == {"Generate", "GenerateStream"}
    assert inspect.iscoroutinefunction(InferenceServicer.Generate) and not rpcs["Generate"].server_streaming
    assert inspect.isasyncgenfunction(InferenceServicer.GenerateStream) and rpcs["GenerateStream"].server_streaming
    for name in rpcs:
        assert "grpc_context" in inspect.signature(getattr(InferenceServicer, name)).parameters
    assert pb.DESCRIPTOR.package == "tandem.v1"


def test_stubs_regenerate_when_the_proto_changes():
    import router.proto as stubs

    assert stubs.stale_reason() is None
    now = time.time()
    for path in stubs.GENERATED:  # as if the stubs were made a while ago ...
        os.utime(path, (now - 100, now - 100))
    os.utime(stubs.PROTO, (now - 50, now - 50))  # ... and the .proto edited since
    assert stubs.stale_reason() == "older than inference.proto"
    assert stubs.build() is True and stubs.stale_reason() is None
    assert stubs.build() is False  # current: nothing to do


# ---------------------------------------------------------------- results


@pytest.mark.parametrize("by_ids", [False, True], ids=["prompt", "prompt_token_ids"])
def test_generate_greedy_matches_llm(stub, llm, by_ids):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    req = pb.GenerateRequest(max_tokens=12, temperature=0, model=NAME,
                             **({"prompt_token_ids": ref.prompt_token_ids} if by_ids else {"prompt": PROMPT}))
    resp = stub.Generate(req)
    assert resp.text == ref.text and list(resp.token_ids) == ref.token_ids
    assert resp.finish_reason == ref.finish_reason and resp.model == NAME and resp.request_id
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_stream_equals_unary(stub):
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=20, temperature=0, ignore_eos=True, request_id="client-id-1")
    full = stub.Generate(req)
    parts = list(stub.GenerateStream(req))
    assert "".join(p.text for p in parts) == full.text
    assert [t for p in parts for t in p.token_ids] == list(full.token_ids)
    assert all(p.request_id == "client-id-1" for p in parts)
    assert [p.finish_reason for p in parts[:-1]] == [""] * (len(parts) - 1) and parts[-1].finish_reason == "length"
    assert not any(p.HasField("usage") for p in parts[:-1]) and parts[-1].usage == full.usage


def test_sampling_fields_reach_the_engine(stub, llm):
    cases = [
        (dict(temperature=1.0, seed=77, top_k=8), dict(temperature=1.0, seed=77, top_k=8)),
        (dict(temperature=0.9, seed=5, top_p=0.6, min_p=0.05), dict(temperature=0.9, seed=5, top_p=0.6, min_p=0.05)),
        (dict(temperature=0, repetition_penalty=1.4, min_tokens=4), dict(temperature=0, repetition_penalty=1.4, min_tokens=4)),
    ]
    for fields, params in cases:
        resp = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=10, **fields))
        assert resp.text == llm.generate(PROMPT, SamplingParams(max_tokens=10, **params))[0].text, fields
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    resp = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True,
                                            stop_token_ids=[ref.token_ids[4]]))
    assert resp.finish_reason == "stop" and len(resp.token_ids) == ref.token_ids.index(ref.token_ids[4]) + 1
    stop = ref.text[len(ref.text) // 2:][:2]
    resp = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert resp.text == expected.text and resp.finish_reason == expected.finish_reason


# ---------------------------------------------------------------- parity with /v1: chat, penalties, logprobs, n, structured output


def test_chat_messages_render_the_chat_template(stub, llm, model):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                                   return_dict=False)
    ref = llm.generate(list(ids), SamplingParams(max_tokens=10, temperature=0))[0]
    resp = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], max_tokens=10, temperature=0))
    assert list(resp.token_ids) == ref.token_ids and resp.usage.prompt_tokens == len(ids)


def test_penalties_reach_the_engine(stub, llm):
    fields = dict(temperature=0, presence_penalty=1.5, frequency_penalty=1.0, ignore_eos=True)
    resp = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, **fields))
    assert resp.text == llm.generate(PROMPT, SamplingParams(max_tokens=16, **fields))[0].text
    plain = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True))
    assert resp.text != plain.text  # the penalties changed the greedy path, so they were not dropped


def test_logprobs_unary_and_streamed_equal_the_engine(stub, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True))[0]
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    for entries in (stub.Generate(req).logprobs, [e for part in stub.GenerateStream(req) for e in part.logprobs]):
        assert [e.token_id for e in entries] == ref.token_ids
        for e, tok, expected in zip(entries, ref.token_ids, ref.logprobs):
            assert e.logprob == pytest.approx(expected[tok], abs=1e-5)
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token_id == tok  # greedy: the best is the one taken
            assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert not stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4)).logprobs  # only when asked


def test_n_choices_seeded_unary_and_streamed(stub, llm):
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    resp = stub.Generate(req)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:  # choice j is the engine's run with seed + j
        assert c.text == llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + c.index,
                                                             ignore_eos=True))[0].text
    assert resp.text == resp.choices[0].text and resp.usage.completion_tokens == 24
    streamed = {i: "" for i in range(3)}
    for part in stub.GenerateStream(req):
        streamed[part.index] += part.text
    assert streamed == {c.index: c.text for c in resp.choices}


@pytest.mark.parametrize("fields,check", [
    (dict(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
    (dict(regex="[0-9]{3}-[a-z]{2}"), lambda text: __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", text)),
    (dict(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],'
                      ' "additionalProperties": false}'),
     lambda text: isinstance(__import__("json").loads(text)["a"], int)),
], ids=["choice", "regex", "json_schema"])
def test_structured_output_forces_the_shape(stub, fields, check):
    """A random tiny model follows none of these on its own: the grammar forces every sample into shape."""
    for seed in range(3):
        req = pb.GenerateRequest(prompt=PROMPT, max_tokens=40, temperature=1.0, seed=seed, **fields)
        resp = stub.Generate(req)
        assert resp.finish_reason == "stop" and check(resp.text), resp.text
        assert "".join(p.text for p in stub.GenerateStream(req)) == resp.text


def test_example_client_sends_chat_constraints_and_logprobs(harness, backend, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "grpc_client.py"
    spec = importlib.util.spec_from_file_location("grpc_client", path)
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    target = f"127.0.0.1:{harness.serve_port(InferenceServicer(backend))}"
    assert client.main(["--target", target, "--chat", "--prompt", "Pick one.", "--choice", "red", "--choice", "blue",
                        "--temperature", "1.0", "--seed", "3", "--logprobs", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() in ("red", "blue") and "finish_reason=stop" in err and "logprob" in err


@pytest.mark.parametrize("fields,hint", [
    (dict(prompt="x", regex="a", choice=["b"]), "one structured-output constraint"),
    (dict(prompt="x", json_schema="{not json"), "json_schema"),
    (dict(prompt="x", n=0), "n must be"),
    (dict(prompt="x", n=1000), "n must be"),
    (dict(prompt="x", logprobs=50), "logprobs"),
    (dict(prompt="x", messages=[pb.ChatMessage(role="user", content="hi")]), "exactly one"),
], ids=["two-constraints", "bad-schema", "n-0", "n-big", "logprobs-big", "prompt-and-messages"])
def test_parity_fields_reject_bad_values(stub, fields, hint):
    code, details = _code(stub.Generate, pb.GenerateRequest(**fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and hint in details, details


# ---------------------------------------------------------------- errors


BAD = [
    (dict(prompt="x", max_tokens=-1), "max_tokens"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=400), "max_tokens"),  # over max_model_len (256)
    (dict(prompt="x", temperature=-1.0), "temperature"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-3), "top_k"),
    (dict(prompt="x", stop=[""]), "stop"),
    (dict(prompt="x", max_tokens=2, min_tokens=3), "min_tokens"),
    (dict(prompt_token_ids=[1, 300]), "vocabulary"),
    (dict(prompt_token_ids=[-5]), "vocabulary"),
    (dict(prompt="x", prompt_token_ids=[1]), "exactly one"),
    (dict(), "exactly one"),
]


@pytest.mark.parametrize("fields,hint", BAD, ids=[f"{i}-{h}" for i, (_, h) in enumerate(BAD)])
def test_invalid_argument_and_server_keeps_serving(stub, fields, hint):
    for rpc in (stub.Generate, stub.GenerateStream):
        code, details = _code(rpc, pb.GenerateRequest(**fields))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and hint in details, details
    assert len(stub.Generate(pb.GenerateRequest(prompt="ok", max_tokens=2, ignore_eos=True)).token_ids) == 2


def test_unknown_model_is_not_found(stub):
    for rpc in (stub.Generate, stub.GenerateStream):
        code, details = _code(rpc, pb.GenerateRequest(prompt="x", model="gpt-5"))
        assert code == grpc.StatusCode.NOT_FOUND and NAME in details


class _NotReady:
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def ready(self) -> bool:
        return False


def test_auth_and_readiness(harness, backend):
    keyed = pb_grpc.InferenceStub(harness.serve(InferenceServicer(backend, api_keys=["sk-grpc"])))
    for md in ([], [("authorization", "Bearer nope")], [("authorization", "sk-grpc")]):
        for rpc in (keyed.Generate, keyed.GenerateStream):
            assert _code(rpc, pb.GenerateRequest(prompt="x"), metadata=md)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert keyed.Generate(pb.GenerateRequest(prompt="x", max_tokens=2), metadata=KEY).finish_reason
    starting = pb_grpc.InferenceStub(harness.serve(InferenceServicer(_NotReady(backend))))
    for rpc in (starting.Generate, starting.GenerateStream):
        assert _code(rpc, pb.GenerateRequest(prompt="x"))[0] == grpc.StatusCode.UNAVAILABLE


def test_full_queue_is_resource_exhausted(harness, model):
    small = make_backend(model, max_num_seqs=1, max_waiting_requests=1)
    harness.backends.append(small)
    stub = pb_grpc.InferenceStub(harness.serve(InferenceServicer(small)))
    long = pb.GenerateRequest(prompt=PROMPT, max_tokens=60, ignore_eos=True)
    with slow_engine(small):
        running, waiting = stub.Generate.future(long), None
        wait_for(lambda: harness.stats(small)["running"] == 1)
        waiting = stub.Generate.future(long)
        wait_for(lambda: harness.stats(small)["waiting"] == 1)
        for rpc in (stub.Generate, stub.GenerateStream):
            with pytest.raises(grpc.RpcError) as e:
                list(rpc(pb.GenerateRequest(prompt="x"))) if rpc is stub.GenerateStream else rpc(pb.GenerateRequest(prompt="x"))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
        assert len(running.result(timeout=60).token_ids) == len(waiting.result(timeout=60).token_ids) == 60
    _wait_idle(harness, small)


def test_deadlines(harness, backend):
    limited = pb_grpc.InferenceStub(harness.serve(InferenceServicer(backend, request_timeout_s=0.3)))
    long = pb.GenerateRequest(prompt=PROMPT, max_tokens=200, ignore_eos=True)
    with slow_engine(backend):  # 200 steps take >= 2 s
        for rpc in (limited.Generate, limited.GenerateStream):  # the server's request_timeout_s
            assert _code(rpc, long)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
            _wait_idle(harness, backend)
        unlimited = pb_grpc.InferenceStub(harness.serve(InferenceServicer(backend)))
        assert _code(unlimited.Generate, long, timeout=0.3)[0] == grpc.StatusCode.DEADLINE_EXCEEDED  # the client's
        _wait_idle(harness, backend)


def test_client_cancel_aborts_and_frees_blocks(harness, backend, stub):
    with slow_engine(backend):
        call = stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_tokens=200, ignore_eos=True))
        first = next(call)
        assert first.token_ids and harness.stats(backend)["running"] == 1
        call.cancel()
        assert call.code() == grpc.StatusCode.CANCELLED
        stats = _wait_idle(harness, backend, timeout=5.0)
    assert stats["blocks_used"] == 0


def test_server_side_abort_is_cancelled(harness, backend, stub):
    engine_ids: list[str] = []  # the engine's id is the server's own, not the client's label
    real_generate = backend.generate

    def recording_generate(req):
        engine_ids.append(req.request_id)
        return real_generate(req)

    backend.generate = recording_generate
    try:
        with slow_engine(backend):
            call = stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_tokens=200, ignore_eos=True,
                                                          request_id="to-abort"))
            next(call)
            assert engine_ids[0] != "to-abort"
            harness.run(backend.abort(engine_ids[0]))
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.CANCELLED and "aborted" in e.value.details()
    finally:
        del backend.generate
