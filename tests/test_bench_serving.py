"""scripts/bench_serving.py against a real server: the OpenAI app over a LocalBackend under uvicorn."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from router.openai_api import create_openai_app
from tests.serving import LiveServer, build_chat_model, make_backend

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    backend = make_backend(build_chat_model(tmp_path_factory.mktemp("models") / "bench-llama"))
    live = LiveServer(create_openai_app(backend))
    yield live
    live.call(backend.close)
    live.stop()


@pytest.mark.parametrize("sweep", [["--request-rates", "50,inf"], ["--concurrencies", "1,4"]], ids=["rates", "concurrency"])
def test_sweep_reports_latency_and_throughput(bench, server, tmp_path, sweep):
    out = tmp_path / "serving"
    rc = bench.main(["--base-url", server.url, *sweep, "--num-prompts", "8", "--max-duration", "60", "--warmup", "1",
                     "--input-len", "24", "--output-len", "12", "--length-dist", "uniform", "--max-token-id", "300",
                     "--ttft-slo", "5", "--tpot-slo", "1", "--out", str(out), "--save-requests"])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["model"]["id"] == "bench-llama" and len(report["points"]) == 2
    for point in report["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"]) == (8, 0), s["errors"]
        assert s["request_throughput"] > 0 and s["output_token_throughput"] > 0
        assert 0 < s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
        assert s["tpot_s"]["p50"] > 0 and s["itl_s"]["p99"] > 0
        assert s["goodput"] <= s["request_throughput"] and s["goodput_fraction"] == 1.0  # generous SLOs
        # ignore_eos: each request produced exactly its drawn output length.
        assert all(r["output_tokens"] == r["output_len"] for r in point["requests"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 10_000
    else:
        assert not out.with_suffix(".png").exists()


def test_failures_are_counted_not_fatal(bench, server, tmp_path):
    # Prompts of ids outside the vocabulary: every request is a 400, and the run says so.
    out = tmp_path / "bad"
    rc = bench.main(["--base-url", server.url, "--request-rates", "inf", "--num-prompts", "3", "--warmup", "0",
                     "--min-token-id", "400", "--max-token-id", "500", "--input-len", "8", "--output-len", "4",
                     "--out", str(out)])
    assert rc == 1
    [point] = json.loads(out.with_suffix(".json").read_text())["points"]
    assert point["summary"]["failed"] == 3 and any("HTTP 400" in e for e in point["summary"]["errors"])


def test_runs_without_matplotlib(bench, server, tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import matplotlib` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "noplot"
    rc = bench.main(["--base-url", server.url, "--concurrencies", "1", "--num-prompts", "2", "--warmup", "0",
                     "--input-len", "8", "--output-len", "4", "--max-token-id", "300", "--out", str(out)])
    assert rc == 0
    assert json.loads(out.with_suffix(".json").read_text())["points"][0]["summary"]["completed"] == 2
    assert not out.with_suffix(".png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_arrival_seconds_sizes_each_rate_and_extra_tpot_limits_count(bench, server, tmp_path):
    # 20 req/s for 0.3 s is 6 requests, 40 req/s is 12, capped by --num-prompts at 10; a TPOT limit no request
    # meets gives goodput 0 beside the main limit, which every request meets.
    out = tmp_path / "serving"
    rc = bench.main(["--base-url", server.url, "--request-rates", "20,40", "--arrival-seconds", "0.3",
                     "--num-prompts", "10", "--warmup", "0", "--input-len", "16", "--output-len", "6",
                     "--length-dist", "fixed", "--max-token-id", "300", "--ttft-slo", "30", "--tpot-slo", "5",
                     "--extra-tpot-slos", "5,0.000001", "--out", str(out)])
    assert rc == 0
    points = json.loads(out.with_suffix(".json").read_text())["points"]
    assert [p["summary"]["completed"] for p in points] == [6, 10]
    for p in points:
        s = p["summary"]
        assert s["goodput_by_tpot_ms"] == {"5000": s["goodput"], "0.001": 0.0}
        assert s["goodput"] > 0


def test_rate_arrivals_keep_their_schedule_when_the_loop_is_busy(bench, monkeypatch):
    # Each request blocks the event loop for 10 ms (a client busy with other streams' events; 40% of the 25 ms mean gap,
    # so a loaded CI box still keeps up): the arrivals stay at their drawn offsets (a sleep that ends late shortens the
    # next one) instead of each gap adding the lateness.
    import asyncio
    import time

    import numpy as np

    async def busy_send(session, args, prompt, max_tokens):
        time.sleep(0.010)
        return bench.Result(len(prompt), max_tokens, ok=True, ttft=0.0, e2e=0.010, output_tokens=1)

    monkeypatch.setattr(bench, "send", busy_send)
    args = bench.parse_args(["--base-url", "http://127.0.0.1:9", "--request-rates", "40"])
    workload = [([1, 2, 3], 4)] * 30
    results, _ = asyncio.run(bench.run_point(args, workload, 40.0, None, np.random.default_rng(7)))
    due = np.concatenate([[0.0], np.cumsum(np.random.default_rng(7).exponential(1 / 40.0, 29))])
    sent = np.sort([r.sent_s for r in results])
    assert len(sent) == 30
    late = sent - due
    assert late.max() < 0.1, late  # chained sleeps: about 10 ms later with each request, ~0.3 s by the last
