"""The main job on one machine: local Ray, the served app (one prefill and one decode replica, CPU),
one streamed OpenAI request and one gRPC request printed, then a clean shutdown.

    tandem demo [--model PATH] [--prompt TEXT]
"""
from __future__ import annotations

import json
import time
from typing import Any

from parallel.net import free_port
from tandem.serving import ServeSpec, start, stop, wait_ready

DEFAULT_PROMPT = "def fibonacci(n):"


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


def main(model: str | None = None, prompt: str = DEFAULT_PROMPT, max_tokens: int = 48, verbose: bool = False) -> int:
    import ray

    from router.config import AppConfig

    args: dict[str, Any] = {"device": "cpu", "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}
    if model:
        args["model"] = model
    config = AppConfig.model_validate(args)
    spec = ServeSpec.from_args(args)
    spec.override(host="127.0.0.1", port=free_port(), grpc_port=free_port())
    print(f"Starting Tandem on local Ray: model {config.model}, 1 prefill + 1 decode replica (CPU)")
    try:
        start(spec, verbose=verbose)
        seconds = wait_ready(spec.local_url(), config.served_model_name, timeout_s=600)
        print(f"Serving at {spec.local_url()} (OpenAI) and 127.0.0.1:{spec.grpc_port} (gRPC) after {seconds:.1f}s\n")
        print(f"--- OpenAI /v1/completions, streamed (prompt {prompt!r}):\n{prompt}", end="")
        stream_openai(spec.local_url(), config.served_model_name, prompt, max_tokens)
        print(f"\n--- gRPC tandem.v1.Inference/Generate (prompt {prompt!r}):")
        reply = call_grpc(spec.grpc_port, "tandem", config.served_model_name, prompt, max_tokens)
        print(prompt + reply.text)
        print(json.dumps({"finish_reason": reply.finish_reason, "prompt_tokens": reply.usage.prompt_tokens,
                          "completion_tokens": reply.usage.completion_tokens}))
        return 0
    finally:
        print("\nShutting down.")
        stop()
        ray.shutdown()
