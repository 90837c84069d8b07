"""The command line and the one engine config: every engine argument on every surface (`LLM(...)`,
the Serve YAML at the top level and per pool, the CLI), the generated help, `tandem serve`'s spec
from a Serve config, `tandem generate` and `tandem bench`, and that `tandem serve MODEL` answers the
OpenAI client on the first try once it prints ready."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from parallel.net import free_port
from router.config import SHARED_ONLY, AppConfig
from tandem import cli
from tandem.docs import BEGIN, END, engine_args_table
from tandem.flags import flag_name
from workers.config import DEFAULT_MODEL, ENGINE_FIELDS, EngineArgs, EngineConfig

ROOT = Path(__file__).resolve().parents[1]

# A valid value other than the default for every engine argument; a new argument fails
# test_every_argument_has_a_value until it is listed here, so it cannot skip the surfaces below.
VALUES: dict[str, typing.Any] = {
    "model": DEFAULT_MODEL + "/", "revision": "v1", "tokenizer": DEFAULT_MODEL, "dtype": "bfloat16", "device": "cpu", "max_model_len": 64,
    "load_format": "dummy", "seed": 7, "attention_backend": "torch", "enforce_eager": True, "cuda_graph_max_tokens": 512, "quantization": "auto",
    "kv_cache_dtype": "fp8", "generation_config": "vllm",
    "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel_size": 2, "expert_parallel_size": 2,
    "distributed_executor_backend": "ray", "disable_p2p_all_reduce": True, "rank_resources": {"tandem_gpu": 1.0},
    "sequence_parallel_attention": "ulysses", "gpus_per_rank": 0.75,
    "block_size": 8, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5, "cpu_kv_cache_bytes": 1 << 20,
    "num_gpu_blocks_override": 32, "kv_lease_seconds": 5.0, "kv_transfer_timeout_seconds": 7.0,
    "max_num_seqs": 8, "max_num_batched_tokens": 128, "max_waiting_requests": 16, "max_waiting_kv_ratio": 0.5,
    "max_queue_delay_s": 2.5, "async_scheduling": False, "pipeline_step_overlap": False,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
}


def _section_value(config: EngineConfig, name: str):
    for section in ("model", "parallel", "cache", "scheduler", "speculative"):
        part = getattr(config, section)
        if name in type(part).model_fields:
            return getattr(part, name)
    raise KeyError(name)


def _cli_tokens(name: str, value) -> list[str]:
    if isinstance(value, bool):
        return [flag_name(name) if value else "--no-" + flag_name(name)[2:]]
    return [flag_name(name), json.dumps(value) if isinstance(value, dict) else str(value)]


def test_every_argument_has_a_value():
    assert set(VALUES) == set(ENGINE_FIELDS)
    for name, value in VALUES.items():
        assert value != EngineArgs.model_fields[name].get_default(call_default_factory=True), name


@pytest.mark.parametrize("name", ENGINE_FIELDS)
def test_engine_argument_on_every_surface(name):
    value = VALUES[name]
    # Python: LLM(...) builds its config with EngineConfig.from_kwargs.
    assert _section_value(EngineConfig.from_kwargs(**{"model": DEFAULT_MODEL, name: value}), name) == value
    # The Serve YAML, top level: both pools get it.
    app = AppConfig.model_validate(yaml.safe_load(yaml.safe_dump({name: value, "colocated": True})))
    for pool in ("prefill", "decode"):
        assert _section_value(app.engine_config(pool), name) == value
    # Per pool: only that pool, unless both pools must share it.
    if name in SHARED_ONLY:
        with pytest.raises(ValueError, match="shared by both pools"):
            AppConfig.model_validate({"prefill": {name: value}})
    else:
        app = AppConfig.model_validate(yaml.safe_load(yaml.safe_dump({"prefill": {name: value}})))
        assert _section_value(app.engine_config("prefill"), name) == value
        assert _section_value(app.engine_config("decode"), name) != value
    # The command line: `tandem serve` (colocated, so SP is allowed) and `tandem generate`.
    ns = cli.build_parser().parse_args(["serve", *_cli_tokens(name, value)])
    _, config = cli.serve_spec(ns)
    assert _section_value(config.engine_config("decode"), name) == value
    ns = cli.build_parser().parse_args(["generate", *_cli_tokens(name, value)])
    assert EngineArgs(**cli.collect(ns, ENGINE_FIELDS)).given() == {name: value}


def test_llm_takes_engine_arguments_and_names_unknown_ones(tiny_llama):
    from tandem import LLM, SamplingParams

    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=8, num_gpu_blocks_override=40, max_num_seqs=4,
              distributed_executor_backend="uni", enable_prefix_caching=False, show_progress=False)
    assert llm.llm_engine.block_manager.num_blocks == 40 and llm.llm_engine.config.scheduler.max_num_seqs == 4
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        LLM(tiny_llama, max_num_seq=4)


@pytest.fixture(scope="module")
def tiny_llama():
    from tests.models import tiny_model

    return tiny_model("llama")


def test_help_shows_type_choices_default_and_meaning_of_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {auto,float32,float16,bfloat16}" in text and "--rank-resources JSON" in text
    for name in ENGINE_FIELDS:
        info = EngineArgs.model_fields[name]
        start = re.search(re.escape(flag_name(name)) + "[ ,]", text[text.index("engine arguments"):]).start()
        entry = text[text.index("engine arguments") + start:][:400]
        assert "(default:" in entry, name
        assert " ".join(info.description.split()[:3]) in entry, name


def test_readme_holds_the_generated_argument_tables():
    readme = (ROOT / "README.md").read_text()
    assert readme[readme.index(BEGIN):readme.index(END) + len(END)] == engine_args_table(), \
        "README.md's argument tables are stale: paste the output of `python -m tandem.docs`"


def test_serve_spec_from_a_serve_config_keeps_its_options_and_every_application():
    ns = cli.build_parser().parse_args(["serve", "--config", str(ROOT / "deploy/serve_config.yaml")])
    spec, config = cli.serve_spec(ns)
    assert (spec.http_host, spec.http_port, spec.grpc_port) == ("0.0.0.0", 8000, 9000)
    assert spec.http_options["request_timeout_s"] == 900
    assert spec.tandem_app()["name"] == "tandem" and not config.colocated
    assert config.prefill.autoscaling_config["max_replicas"] == 4 and config.max_queue_delay_s == 5
    # Flags override the file: ports, and engine arguments of the Tandem app.
    ns = cli.build_parser().parse_args(["serve", "--config", str(ROOT / "deploy/serve_config.yaml"), "--port", "8123",
                                        "--host", "127.0.0.1", "--max-num-seqs", "32", "--replicas", "2"])
    spec, config = cli.serve_spec(ns)
    assert (spec.http_host, spec.http_port, spec.local_url()) == ("127.0.0.1", 8123, "http://127.0.0.1:8123")
    assert config.colocated and config.decode.num_replicas == 2 and config.engine_args("decode").max_num_seqs == 32


def test_serve_turns_rays_log_folding_off_before_ray_loads_when_traces_are_asked_for(tmp_path, monkeypatch):
    """Ray folds log lines that differ only in ids and numbers, which drops most `tandem.trace` lines; its
    switch is read when Ray is imported, which serve_spec does, so cmd_serve must set it before."""
    parse = cli.build_parser().parse_args
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "tandem", "import_path": "router.app:build_app",
                                                         "args": {"trace_requests": True}}]}))
    flat = tmp_path / "args.yaml"
    flat.write_text(yaml.safe_dump({"trace_requests": True}))
    assert cli._asks_for_traces(parse(["serve", "--trace-requests"]))
    assert cli._asks_for_traces(parse(["serve", "--config", str(config)]))
    assert cli._asks_for_traces(parse(["serve", "--config", str(flat)]))
    assert not cli._asks_for_traces(parse(["serve", "--config", str(config), "--no-trace-requests"]))
    assert not cli._asks_for_traces(parse(["serve"]))
    assert not cli._asks_for_traces(parse(["serve", "--config", str(ROOT / "deploy/serve_config.yaml")]))
    assert not cli._asks_for_traces(parse(["serve", "--config", str(tmp_path / "missing.yaml")]))

    seen = []

    def spec_seen(ns):
        seen.append(os.environ.get("RAY_DEDUP_LOGS"))
        raise cli.CommandError("stop here")

    monkeypatch.setattr(cli, "serve_spec", spec_seen)
    for argv, wanted in ((["serve"], None), (["serve", "--trace-requests"], "0")):
        monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
        with pytest.raises(cli.CommandError):
            cli.cmd_serve(parse(argv))
        assert seen.pop() == wanted
    monkeypatch.setenv("RAY_DEDUP_LOGS", "1")  # the user's own setting stays
    with pytest.raises(cli.CommandError):
        cli.cmd_serve(parse(["serve", "--trace-requests"]))
    assert seen.pop() == "1"


def test_serve_turns_ray_log_folding_off_before_ray_is_imported():
    """Ray reads RAY_DEDUP_LOGS once, at import: a fresh `tandem serve --trace-requests` must set it before
    anything imports Ray, the parser included (on 2 x H100 an import ahead of it left 18 of 60 trace lines)."""
    code = (
        "import sys\n"
        "import tandem.cli as cli\n"
        "def spec(ns):\n"
        "    import ray._private.ray_constants as c\n"
        "    print('folding', c.RAY_DEDUP_LOGS)\n"
        "    raise cli.CommandError('stop here')\n"
        "cli.serve_spec = spec\n"
        "cli.main(sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS"}
    for flag, wanted in (("--trace-requests", "folding False"), ("--no-trace-requests", "folding True")):
        out = subprocess.run([sys.executable, "-c", code, "serve", flag], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
        assert wanted in out.stdout, out.stdout + out.stderr


def test_serve_layout_flags():
    parse = cli.build_parser().parse_args
    _, config = cli.serve_spec(parse(["serve", DEFAULT_MODEL]))
    assert config.colocated and config.decode.num_replicas == 1
    _, config = cli.serve_spec(parse(["serve", "--disaggregated", "--prefill-replicas", "2",
                                      "--prefill-args", '{"tensor_parallel_size": 2}', "--decode-args",
                                      '{"max_num_seqs": 64}']))
    assert not config.colocated and config.prefill.num_replicas == 2 and config.decode.num_replicas == 1
    assert config.engine_args("prefill").parallel_config().tensor_parallel_size == 2
    assert config.engine_args("decode").max_num_seqs == 64 and config.engine_args("prefill").max_num_seqs == 256
    spec, config = cli.serve_spec(parse(["serve"]))  # defaults as vLLM's
    assert (spec.http_host, spec.http_port, spec.grpc_port) == ("0.0.0.0", 8000, 9000)


@pytest.mark.parametrize("argv, message", [
    (["serve", "/no/such/model"], "no config.json"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs"),
    (["serve", "--decode-args", '{"max_num_seq": 3}'], "did you mean 'max_num_seqs'"),
    (["serve", "--prefill-replicas", "2"], "need --disaggregated"),
    (["serve", "--disaggregated", "--decode-args", '{"sequence_parallel_size": 2}'], "give it to the prefill pool"),
    (["serve", "--disaggregated", "--prefill-args", '{"dtype": "float16"}'], "shared by both pools"),
    (["serve", "--config", "/no/such.yaml"], "--config"),
    (["serve", "--expert-parallel-size", "3", "--tensor-parallel-size", "2"], "expert_parallel_size"),
    (["serve", DEFAULT_MODEL, "--model", "/elsewhere"], "give the model once"),
    (["generate", "--max-num-batched-tokens", "-1"], "max_num_batched_tokens"),
    (["serve", "--disaggregated", "--kv-transfers-in-flight", "0"], "kv_transfers_in_flight"),
    (["serve", "--disaggregated", "--kv-transfers-in-flight", "9"], "kv_transfers_in_flight"),
])
def test_bad_input_is_one_error_line_and_status_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_kv_transfers_in_flight_from_flag_and_yaml_reaches_the_decode_replica(monkeypatch):
    """A served field (not an engine one): its default and bounds are the decode replica's own, a bad value is refused
    naming it, and the decode pool builds its replica with the value given."""
    from engine import disagg
    from router import pools

    assert AppConfig().kv_transfers_in_flight == disagg.TRANSFERS_IN_FLIGHT_DEFAULT == 1
    disagg.check_transfers_in_flight(disagg.TRANSFERS_IN_FLIGHT_MAX)
    assert AppConfig(kv_transfers_in_flight=disagg.TRANSFERS_IN_FLIGHT_MAX).kv_transfers_in_flight == 8
    for bad in (0, -3, disagg.TRANSFERS_IN_FLIGHT_MAX + 1, 2.5, "many"):
        with pytest.raises(ValidationError, match="kv_transfers_in_flight"):
            AppConfig(kv_transfers_in_flight=bad)
    from_yaml = AppConfig.model_validate(yaml.safe_load(f"model: {DEFAULT_MODEL}\nkv_transfers_in_flight: 4\n"))
    assert from_yaml.kv_transfers_in_flight == 4
    _, config = cli.serve_spec(cli.build_parser().parse_args(["serve", "--disaggregated", "--kv-transfers-in-flight", "8"]))
    assert config.kv_transfers_in_flight == 8

    built: dict = {}

    class Replica:  # records what the pool passes; no engine
        def __init__(self, engine, prefill, replica_id=None, **kw):
            built.update(kw)
            self.async_engine = type("AsyncEngine", (), {})()

    monkeypatch.setattr(pools, "_engine", lambda config, pool: None)
    monkeypatch.setattr(pools, "DecodeReplica", Replica)
    pools.DecodePool(config.to_args(), prefill=None)  # the args the Serve deployment gets
    assert built["kv_transfers_in_flight"] == 8


def test_bad_flag_value_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--dtype", "float8"])
    assert e.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err


def test_generate_json(capsys):
    rc = cli.main(["generate", "--device", "cpu", "--max-tokens", "4", "--ignore-eos", "--json", "--prompt", "def f():",
                   "--prompt", "import os"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [x["prompt"] for x in lines] == ["def f():", "import os"]
    assert all(len(x["token_ids"]) == 4 and x["finish_reason"] == "length" for x in lines)


def test_bench_lists_runs_and_refuses_unknown(capsys):
    assert cli.main(["bench"]) == 0
    listing = capsys.readouterr().out
    assert "offline" in listing and "serving" in listing and "step_dispatch" in listing
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert "no benchmark 'no_such_bench'" in capsys.readouterr().err
    assert cli.main(["bench", "serving", "--help"]) == 0
    assert "usage: tandem bench serving" in capsys.readouterr().out


@pytest.mark.slow
def test_tandem_serve_answers_the_first_request_after_ready():
    from openai import OpenAI

    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", str(ROOT / "models/tandem-tiny"), "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", str(grpc_port), "--device", "cpu", "--max-num-seqs", "8",
           "--ready-timeout", "300"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Tandem ready"):
                break
        assert lines and lines[-1].startswith("Tandem ready"), "".join(lines[-40:])
        assert f"http://127.0.0.1:{port}/v1" in lines[-1]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tandem-tiny", prompt="def f():", max_tokens=5, temperature=0.0)
        assert out.choices[0].text and out.usage.completion_tokens == 5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
