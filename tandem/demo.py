"""The main job on one machine: local Ray, the served app (one prefill and one decode replica, CPU),
one streamed OpenAI request and one gRPC request printed, then a clean shutdown.

    tandem demo [--model PATH] [--prompt TEXT]
"""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from typing import Any

DEFAULT_PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: dict[str, Any], http_port: int, grpc_port: int, app_name: str = "tandem") -> None:
    """Start local Ray + Serve (HTTP and gRPC proxies on loopback) and deploy the app."""
    import ray
    from ray import serve

    from router.app import build_app

    if not ray.is_initialized():
        # Pools' ranks are Ray actors taking one CPU each; ask for enough slots even on a 2-core machine.
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options={"port": grpc_port,
                              "grpc_servicer_functions": ["router.proto.inference_pb2_grpc.add_InferenceServicer_to_server"]})
    serve.run(build_app(args), name=app_name, route_prefix="/", blocking=False)


def wait_healthy(base_url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
        time.sleep(0.5)
    raise TimeoutError(f"the app at {base_url} did not become healthy within {timeout_s:.0f}s: {last}")


def stream_openai(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    text = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True)
    for chunk in stream:
        if chunk.choices:
            piece = chunk.choices[0].text
            text.append(piece)
            print(piece, end="", flush=True)
    print()
    return "".join(text)


def call_grpc(grpc_port: int, app_name: str, model: str, prompt: str, max_tokens: int):
    import grpc

    from router.proto import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        # Serve's gRPC proxy routes by the `application` metadata key.
        return stub.Generate(request, metadata=(("application", app_name),), timeout=300)


def main(model: str | None = None, prompt: str = DEFAULT_PROMPT, max_tokens: int = 48) -> int:
    import ray
    from ray import serve

    from router.config import AppConfig

    args: dict[str, Any] = {"device": "cpu", "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}
    if model:
        args["model"] = model
    config = AppConfig.model_validate(args)
    http_port, grpc_port = free_port(), free_port()
    base_url = f"http://127.0.0.1:{http_port}"
    print(f"Starting Tandem on local Ray: model {config.model}, 1 prefill + 1 decode replica (CPU)")
    try:
        t0 = time.monotonic()
        start(args, http_port, grpc_port)
        wait_healthy(base_url)
        print(f"Serving at {base_url} (OpenAI) and 127.0.0.1:{grpc_port} (gRPC) after {time.monotonic() - t0:.1f}s\n")
        print(f"--- OpenAI /v1/completions, streamed (prompt {prompt!r}):\n{prompt}", end="")
        stream_openai(base_url, config.served_model_name, prompt, max_tokens)
        print(f"\n--- gRPC tandem.v1.Inference/Generate (prompt {prompt!r}):")
        reply = call_grpc(grpc_port, "tandem", config.served_model_name, prompt, max_tokens)
        print(prompt + reply.text)
        print(json.dumps({"finish_reason": reply.finish_reason, "prompt_tokens": reply.usage.prompt_tokens,
                          "completion_tokens": reply.usage.completion_tokens}))
        return 0
    finally:
        print("\nShutting down.")
        serve.shutdown()
        ray.shutdown()
