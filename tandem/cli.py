"""The `tandem` command line: `serve`, `generate`, `demo` and `bench`.

Engine flags are generated from `workers.config.EngineArgs` and the served app's from
`router.config.AppConfig` (tandem/flags.py), so every engine argument has the same name, default and
validation here as in `LLM(...)` and the Serve YAML.

    tandem serve models/tandem-tiny --max-num-seqs 64            # colocated, OpenAI on :8000, gRPC on :9000
    tandem serve MODEL --disaggregated --prefill-args '{"tensor_parallel_size": 2}'
    tandem serve --config deploy/serve_config.yaml                # a Serve config, as `serve deploy` reads it
    tandem generate --model MODEL --prompt "def f():"
    tandem bench offline --help
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pydantic import ValidationError

from tandem.flags import add_field_flag, add_model_flags, collect
from workers.config import ENGINE_FIELDS, SECTIONS, EngineArgs

SECTION_TITLES = {"model": "model", "parallel": "parallelism (per replica)", "cache": "KV cache",
                  "scheduler": "batching and queues", "speculative": "speculative decoding"}
SERVED_FIELDS = ("served_model_name", "api_keys", "api_keys_env", "request_timeout_s", "local_prefill_max_tokens",
                 "local_prefill_when_idle", "router_prefill", "prefill_lane", "kv_push_pieces", "kv_transfers_in_flight", "router_replicas", "stream_items_per_s", "max_request_body_bytes", "max_prompt_chars", "trace_requests",
                 "sse_keepalive_s", "tool_call_parser", "max_queued_requests")


class CommandError(Exception):
    """A bad command line or config: printed as `error: ...`, exit status 2."""


def describe(e: Exception) -> str:
    """One readable line per problem, naming the argument (pydantic's own text is multi-line)."""
    if not isinstance(e, ValidationError):
        return str(e)
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" if where else msg)
    return "; ".join(lines)


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for section, model in SECTIONS.items():
        group = parser.add_argument_group(f"engine arguments: {SECTION_TITLES[section]}")
        add_model_flags(group, EngineArgs, [n for n in model.model_fields if n not in skip])


# ---- generate
def cmd_generate(ns: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            seed=ns.sampling_seed, stop=ns.stop or [], ignore_eos=ns.ignore_eos)
    given = collect(ns, ENGINE_FIELDS)
    if _starts_private_ray(given):
        from tandem.serving import use_private_ray_token

        use_private_ray_token()  # the local Ray of the ranks leaves no ~/.ray/auth_token behind (tandem/serving.py)
    args = EngineArgs(**given)
    llm = LLM(**{**args.given(), "model": args.model}, show_progress=False)
    prompts = ns.prompt or ["def fibonacci(n):"]
    try:
        outs = [llm.chat([{"role": "user", "content": p}], params) for p in prompts] if ns.chat \
            else llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        if ns.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))
        else:
            print(f"--- prompt: {prompt!r}\n{'' if ns.chat else prompt}{out.text}\n"
                  f"--- finish_reason: {out.finish_reason}, {len(out.token_ids)} tokens")
    return 0


def _starts_private_ray(given: dict[str, Any]) -> bool:
    """Whether `generate` with these engine flags starts a local Ray: ranks as Ray actors, no $RAY_ADDRESS."""
    sizes = [given.get(f"{kind}_parallel_size") or 1 for kind in ("tensor", "pipeline", "sequence", "expert")]
    ray_ranks = given.get("distributed_executor_backend") == "ray" or any(size > 1 for size in sizes)
    return ray_ranks and not os.environ.get("RAY_ADDRESS")


# ---- serve
def serve_spec(ns: argparse.Namespace):
    """The Serve spec a `tandem serve` command line describes (validated, nothing started)."""
    import yaml

    from router.config import AppConfig
    from tandem.serving import ServeSpec

    args = {**collect(ns, ENGINE_FIELDS), **collect(ns, SERVED_FIELDS)}
    if ns.model_positional is not None:
        if "model" in args and args["model"] != ns.model_positional:
            raise CommandError("give the model once: as the positional MODEL or as --model")
        args["model"] = ns.model_positional
    args.update(_layout(ns))
    if ns.config:
        try:
            with open(ns.config) as f:
                loaded = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise CommandError(f"--config {ns.config}: {e}") from None
        if not isinstance(loaded, dict):
            raise CommandError(f"--config {ns.config}: expected a Serve config or a mapping of app args")
        spec = ServeSpec.from_file_content(loaded)
    else:
        spec = ServeSpec.from_args({})
    spec.override(getattr(ns, "host", None), getattr(ns, "port", None), getattr(ns, "grpc_port", None), args)
    config = AppConfig.model_validate(spec.tandem_app()["args"])
    config.engine_config("decode")  # the model folder must exist here: this machine runs the replicas
    return spec, config


def _layout(ns: argparse.Namespace) -> dict[str, Any]:
    """Pool sizes and per-pool overrides from the layout flags (none given: leave the config's)."""
    prefill_args, decode_args = getattr(ns, "prefill_args", None), getattr(ns, "decode_args", None)
    pool_flags = [ns.prefill_replicas, ns.decode_replicas, prefill_args]
    if not ns.disaggregated and any(v is not None for v in pool_flags):
        raise CommandError("--prefill-replicas, --decode-replicas and --prefill-args need --disaggregated")
    if ns.disaggregated and ns.replicas is not None:
        raise CommandError("--replicas sizes a colocated app; with --disaggregated give --prefill-replicas "
                           "and --decode-replicas")
    if ns.disaggregated:
        return {"colocated": False,
                "prefill": {**(prefill_args or {}), "num_replicas": ns.prefill_replicas or 1},
                "decode": {**(decode_args or {}), "num_replicas": ns.decode_replicas or 1}}
    if ns.config and ns.replicas is None and decode_args is None:
        return {}  # the config's own layout
    return {"colocated": True, "decode": {**(decode_args or {}), "num_replicas": ns.replicas or 1}}


def _asks_for_traces(ns: argparse.Namespace) -> bool:
    """Whether `--trace-requests` or the --config file's app args turn `trace_requests` on. Read without
    validating (serve_spec does that): an unreadable file is serve_spec's error to report."""
    if getattr(ns, "trace_requests", None) is not None:
        return bool(ns.trace_requests)
    if not ns.config:
        return False
    import yaml

    try:
        with open(ns.config) as f:
            loaded = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(loaded, dict):
        return False
    apps = loaded.get("applications")
    arg_sets = [a.get("args") for a in apps if isinstance(a, dict)] if isinstance(apps, list) else [loaded]
    return any(isinstance(args, dict) and args.get("trace_requests") is True for args in arg_sets)


def cmd_serve(ns: argparse.Namespace) -> int:
    """Run the served app in the foreground on the current (or a new local) Ray cluster until Ctrl-C."""
    import signal
    import threading

    if _asks_for_traces(ns):
        # Ray folds log lines that differ only in their ids and numbers ("[repeated 6x across cluster]"),
        # which drops most per-request trace lines on their way to this terminal. Its switch is read once,
        # when Ray is imported, so `main` sets it before building the parser (which imports Ray); here for
        # callers of cmd_serve alone, where Ray is not imported yet. A value the user set stays.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")

    from tandem.serving import check_ports_free, exposure_warnings, ready_line, start, stop as stop_serve, wait_ready
    spec, config = serve_spec(ns)
    if not os.environ.get("RAY_ADDRESS"):
        check_ports_free(spec)  # this machine runs the proxies; on a cluster they may run elsewhere
    keys = sorted(config.resolved_api_keys())
    for line in exposure_warnings(spec, keys):
        print(line, file=sys.stderr)
    layout = "colocated" if config.colocated else "disaggregated (prefill + decode pools)"
    print(f"Starting Tandem: model {config.model} as {config.served_model_name!r}, {layout}", flush=True)
    start(spec, verbose=ns.verbose)
    try:
        seconds = wait_ready(spec.local_url(), config.served_model_name, ns.ready_timeout, keys[0] if keys else None)
        print(ready_line(spec, seconds), flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        stop.wait()
    finally:
        print("Shutting down.", flush=True)
        stop_serve()
    return 0


# ---- demo and bench
def cmd_demo(ns: argparse.Namespace) -> int:
    from tandem.demo import main as demo

    return demo(model=ns.model, prompt=ns.prompt, max_tokens=ns.max_tokens, verbose=ns.verbose)


def cmd_bench(ns: argparse.Namespace) -> int:
    from tandem import bench

    if ns.name is None:
        print(f"usage: tandem bench NAME [ARGS...]; `tandem bench NAME --help` for its flags\n\n{bench.listing()}")
        return 0
    return bench.run(ns.name, ns.args)


# ---- parser
def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="Generate text offline with the engine (no server).",
                         description="Generate text offline with the engine (no server).")
    add_engine_flags(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--prompt", action="append", help="Prompt text; repeat for a batch (default: 'def fibonacci(n):')")
    s.add_argument("--chat", action="store_true", help="Wrap each prompt as a user message in the chat template.")
    s.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt (default: 64)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="Top-k sampling; 0 = off (default: 0)")
    s.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed (default: unset)")
    s.add_argument("--stop", action="append", help="Stop string; repeatable (default: none)")
    s.add_argument("--ignore-eos", action="store_true", help="Generate max-tokens even past end-of-sequence.")
    s.add_argument("--json", action="store_true", help="One JSON object per output line.")
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    from router.config import AppConfig

    srv = sub.add_parser("serve", help="Serve a model: OpenAI HTTP and gRPC, in the foreground on local Ray.",
                         description="Serve a model with the OpenAI HTTP API and gRPC, in the foreground on the "
                         "current (or a new local) Ray cluster, until Ctrl-C. Colocated replicas by default; "
                         "--disaggregated splits prefill and decode into pools. For clusters: serve deploy "
                         "deploy/serve_config.yaml.")
    srv.add_argument("model_positional", nargs="?", metavar="MODEL",
                     help="Hugging Face model folder (default: the shipped tandem-tiny)")
    net = srv.add_argument_group("server")
    net.add_argument("--config", help="A Serve config YAML (as `serve deploy` reads it: http/gRPC options and "
                     "every application) or a YAML of app args; flags given here override it.")
    net.add_argument("--host", default=argparse.SUPPRESS, help="HTTP bind address (default: 0.0.0.0, or the config's)")
    net.add_argument("--port", type=int, default=argparse.SUPPRESS, help="HTTP port (default: 8000)")
    net.add_argument("--grpc-port", type=int, default=argparse.SUPPRESS, help="gRPC port (default: 9000)")
    net.add_argument("--ready-timeout", type=float, default=900.0, help="Seconds to wait for the first "
                     "successful request before giving up (default: 900)")
    net.add_argument("--verbose", action="store_true", help="Ray and Serve logs at INFO (default: warnings only)")
    app = srv.add_argument_group("served app")
    add_model_flags(app, AppConfig, SERVED_FIELDS)
    layout = srv.add_argument_group("layout")
    layout.add_argument("--replicas", type=int, help="Colocated replicas, each a whole engine (default: 1)")
    layout.add_argument("--disaggregated", action="store_true", help="Prefill and decode in separate pools, "
                        "KV handed from one to the other.")
    layout.add_argument("--prefill-replicas", type=int, help="Prefill pool replicas (default: 1)")
    layout.add_argument("--decode-replicas", type=int, help="Decode pool replicas (default: 1)")
    add_field_flag(layout, "prefill_args", _pool_args_field("prefill"))
    add_field_flag(layout, "decode_args", _pool_args_field("decode"))
    add_engine_flags(srv)
    srv.set_defaults(func=cmd_serve)


def _pool_args_field(pool: str):
    from pydantic.fields import FieldInfo

    return FieldInfo(default=None, annotation=dict, description=f"Engine arguments of the {pool} pool's replicas only, "
                 "as JSON, e.g. '{\"tensor_parallel_size\": 2}'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: distributed LLM inference on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    demo = sub.add_parser("demo", help="The main job: local Ray, the served app (1 prefill + 1 decode replica, CPU), "
                          "one streamed OpenAI and one gRPC request, then shut down.")
    demo.add_argument("--model", default=None, help="HF model folder (default: the shipped tandem-tiny)")
    demo.add_argument("--prompt", default="def fibonacci(n):", help="(default: 'def fibonacci(n):')")
    demo.add_argument("--max-tokens", type=int, default=48, help="(default: 48)")
    demo.add_argument("--verbose", action="store_true", help="Ray and Serve logs at INFO (default: warnings only)")
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="Run a benchmark of scripts/ (`tandem bench` lists them).",
                           add_help=False)
    bench.add_argument("name", nargs="?", help="The benchmark (scripts/bench_NAME.py)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="Its own arguments (NAME --help shows them)")
    bench.set_defaults(func=cmd_bench)
    return parser


def _unfold_traces_early(argv: list[str]) -> None:
    """`tandem serve` with traces on: RAY_DEDUP_LOGS=0 before the parser is built, since building it imports Ray
    (router/config.py validates Serve's own config types), which reads the switch once (see cmd_serve)."""
    if not argv or argv[0] != "serve":
        return
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--trace-requests", action=argparse.BooleanOptionalAction, default=None)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv[1:])
    if _asks_for_traces(known):
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _unfold_traces_early(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (CommandError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
