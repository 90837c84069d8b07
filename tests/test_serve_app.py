"""The colocated app under real Ray Serve: HTTP through Serve's proxy and gRPC through Serve's gRPC
proxy (the servicer methods called as Serve calls them). One Ray start for the module."""
from __future__ import annotations

import json

import grpc
import pytest

from parallel.net import free_port
from tests.models import CORPUS
from tests.serving import ENGINE_KWARGS, build_chat_model, wait_idle

pytestmark = pytest.mark.slow

NAME = "serve-llama"
KEY = "sk-serve"
AUTH = [("authorization", f"Bearer {KEY}")]


@pytest.fixture(scope="module")
def app(tmp_path_factory, shared_ray):
    from ray import serve

    from router.app import build_app

    model = build_chat_model(tmp_path_factory.mktemp("models") / NAME)
    http_port, grpc_port = free_port(), free_port()
    try:  # Serve on the session's Ray (tests/conftest.py)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options={"port": grpc_port,
                                  "grpc_servicer_functions": ["router.proto.inference_pb2_grpc.add_InferenceServicer_to_server"]})
        args = {"model": model, "colocated": True, "api_keys": [KEY], **ENGINE_KWARGS}
        serve.run(build_app(args), name="tandem", route_prefix="/")
        yield {"http": f"http://127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}",
               "handle": serve.get_app_handle("tandem")}
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def stub(app):
    from router.proto import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(app["grpc"]) as channel:
        yield pb_grpc.InferenceStub(channel)


def _stats(app) -> dict:
    return app["handle"].engine_stats.remote().result(timeout_s=30)


def _wait_idle(app, timeout: float = 15.0) -> dict:
    return wait_idle(lambda: _stats(app), timeout, fields=("blocks_used", "running"), interval=0.05)


def test_http_and_grpc_agree(app, stub):
    import httpx2
    from router.proto import inference_pb2 as pb

    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": CORPUS[3], "max_tokens": 10, "temperature": 0}
    r = httpx2.post(f"{app['http']}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    req = pb.GenerateRequest(model=NAME, prompt=CORPUS[3], max_tokens=10, temperature=0)
    assert stub.Generate(req, metadata=AUTH).text == text
    assert "".join(m.text for m in stub.GenerateStream(req, metadata=AUTH)) == text
    streamed = httpx2.post(f"{app['http']}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60)
    frames = [f for f in streamed.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    assert "".join(json.loads(f[6:])["choices"][0]["text"] for f in frames[:-1]) == text


def test_errors_through_the_proxies(app, stub):
    import httpx2
    from router.proto import inference_pb2 as pb

    r = httpx2.post(f"{app['http']}/v1/completions", json={"prompt": "x"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx2.post(f"{app['http']}/v1/completions", json={"prompt": "x", "max_tokens": -2},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert httpx2.get(f"{app['http']}/health", timeout=60).status_code == 200
    cases = [(pb.GenerateRequest(prompt="x", max_tokens=-2), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
             (pb.GenerateRequest(prompt="x", model="other"), AUTH, grpc.StatusCode.NOT_FOUND),
             (pb.GenerateRequest(prompt="x"), [], grpc.StatusCode.UNAUTHENTICATED)]
    for req, md, code in cases:
        for rpc in (stub.Generate, stub.GenerateStream):
            with pytest.raises(grpc.RpcError) as e:
                result = rpc(req, metadata=md)
                list(result) if rpc is stub.GenerateStream else None
            assert e.value.code() == code, e.value.details()


def test_grpc_cancel_frees_blocks(app, stub):
    from router.proto import inference_pb2 as pb

    # Long enough (max_model_len 256) that the cancel arrives well before the end.
    call = stub.GenerateStream(pb.GenerateRequest(prompt="x", max_tokens=240, ignore_eos=True), metadata=AUTH)
    next(call)
    call.cancel()
    assert _wait_idle(app)["blocks_used"] == 0
