#!/usr/bin/env python3
"""Example client of Tandem's gRPC API (`tandem.v1.Inference`, router/proto/inference.proto).

    python scripts/grpc_client.py --prompt "def fibonacci(n):" --max-tokens 48
    python scripts/grpc_client.py --target my-cluster:9000 --stream --api-key "$TANDEM_API_KEY"
    python scripts/grpc_client.py --token-ids 12 34 56 --temperature 0.8 --seed 7
    python scripts/grpc_client.py --chat --prompt "Name a prime." --choice 2 --choice 3 --choice 5
    python scripts/grpc_client.py --prompt "A person as JSON:" --json-schema '{"type": "object"}' --logprobs 2

Streams print text as it arrives; both modes end with the finish reason and token usage. A failed
call prints its gRPC status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) and exits with 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.proto import inference_pb2 as pb  # noqa: E402
from router.proto import inference_pb2_grpc as pb_grpc  # noqa: E402


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=args.model or "", max_tokens=args.max_tokens, stop=args.stop or [],
                             ignore_eos=args.ignore_eos)
    if args.token_ids:
        req.prompt_token_ids.extend(args.token_ids)
    elif args.chat:  # the prompt as the user's turn, rendered by the model's chat template
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    if args.json_schema:
        req.json_schema = args.json_schema
    if args.regex:
        req.regex = args.regex
    req.choice.extend(args.choice or [])
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    return req


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:9000", help="host:port of Serve's gRPC proxy")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--token-ids", type=int, nargs="+", help="send token ids instead of --prompt")
    p.add_argument("--model", help="served model name (default: the server's)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="send --prompt as a chat's user message (chat template)")
    p.add_argument("--json-schema", help="structured output: a JSON schema the output must match")
    p.add_argument("--regex", help="structured output: a regular expression the output must match")
    p.add_argument("--choice", action="append", help="structured output: one allowed output (repeatable)")
    p.add_argument("--logprobs", type=int, help="print each token's logprob with this many alternatives")
    p.add_argument("--stream", action="store_true", help="GenerateStream instead of Generate")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="default: $TANDEM_API_KEY")
    p.add_argument("--application", help="Serve application name, when the cluster serves several")
    p.add_argument("--timeout", type=float, default=300.0, help="call deadline in seconds")
    args = p.parse_args(argv)

    metadata = []
    if args.api_key:
        metadata.append(("authorization", f"Bearer {args.api_key}"))
    if args.application:
        metadata.append(("application", args.application))
    req = build_request(args)
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        try:
            if args.stream:
                last = None
                for last in stub.GenerateStream(req, metadata=metadata, timeout=args.timeout):
                    print(last.text, end="", flush=True)
                print()
            else:
                last = stub.Generate(req, metadata=metadata, timeout=args.timeout)
                print(last.text)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.logprobs is not None and not args.stream:
        for e in last.logprobs:
            top = ", ".join(f"{t.token_id}:{t.logprob:.3f}" for t in e.top_logprobs)
            print(f"  token {e.token_id} logprob {e.logprob:.4f}  [{top}]", file=sys.stderr)
    u = last.usage
    print(f"--- finish_reason={last.finish_reason} prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
          f"cached_tokens={u.cached_tokens}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
