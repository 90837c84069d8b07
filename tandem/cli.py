"""The `tandem` command line: `generate` (offline engine), `serve` and `demo` (the served app).

Engine flags are generated from the same pydantic models as the Python API."""
from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from workers.config import DEFAULT_MODEL, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig



def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    for cfg in (ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig):
        group = p.add_argument_group(cfg.__name__)
        for name, field in cfg.model_fields.items():
            flag = "--" + name.replace("_", "-")
            if name == "model":
                group.add_argument(flag, default=DEFAULT_MODEL, help="HF model folder (default: the shipped tandem-tiny)")
                continue
            ann = field.annotation
            args = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
            base = args[0]
            help_text = field.description or ""
            if base is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif typing.get_origin(base) is typing.Literal:
                group.add_argument(flag, choices=typing.get_args(base), default=None, help=help_text)
            else:
                group.add_argument(flag, type=base if base in (int, float) else str, default=None, help=help_text)


def _engine_kwargs(ns: argparse.Namespace) -> dict:
    names = [n for cfg in (ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig) for n in cfg.model_fields]
    return {n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None}


def cmd_generate(ns: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                                seed=ns.seed_sampling, stop=ns.stop or [], ignore_eos=ns.ignore_eos)
        llm = LLM(show_progress=False, **_engine_kwargs(ns))
    except (ValueError, ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = ns.prompt or ["def fibonacci(n):"]
    try:
        if ns.chat:
            outs = [llm.chat([{"role": "user", "content": p}], params) for p in prompts]
        else:
            outs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        if ns.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
        else:
            print(f"--- prompt: {prompt!r}\n{prompt if not ns.chat else ''}{out.text}\n--- finish_reason: {out.finish_reason}, "
                  f"{len(out.token_ids)} tokens")
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    from tandem.demo import main as demo

    return demo(model=ns.model, prompt=ns.prompt, max_tokens=ns.max_tokens)


def cmd_serve(ns: argparse.Namespace) -> int:
    """Run the served app in the foreground on the current (or a new local) Ray cluster until Ctrl-C."""
    import signal
    import threading

    import yaml
    from ray import serve

    from router.config import AppConfig
    from tandem.demo import start

    args = {}
    if ns.config:
        with open(ns.config) as f:
            loaded = yaml.safe_load(f) or {}
        # Accept a Serve config file (its first application's args) or a bare args mapping.
        args = loaded["applications"][0].get("args", {}) if "applications" in loaded else loaded
    try:
        AppConfig.model_validate(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start(args, ns.port, ns.grpc_port, ns.app_name)
    print(f"Tandem serving on http://127.0.0.1:{ns.port} (OpenAI) and 127.0.0.1:{ns.grpc_port} (gRPC); Ctrl-C stops")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: distributed LLM inference on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate text offline with the engine (no server).")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="Prompt text (repeat for a batch).")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="Per-request sampling seed.")
    gen.add_argument("--stop", action="append", help="Stop string (repeatable).")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="One JSON object per output line.")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="The main job: local Ray, the served app (1 prefill + 1 decode replica, CPU), "
                                       "one streamed OpenAI and one gRPC request, then shut down.")
    demo.add_argument("--model", default=None, help="HF model folder (default: the shipped tandem-tiny)")
    demo.add_argument("--prompt", default="def fibonacci(n):")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)

    srv = sub.add_parser("serve", help="Run the served app in the foreground (for clusters: serve deploy deploy/serve_config.yaml).")
    srv.add_argument("--config", help="A Serve config YAML (its first application's args) or a YAML of app args.")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=9000)
    srv.add_argument("--app-name", default="tandem")
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
