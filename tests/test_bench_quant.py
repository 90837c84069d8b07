"""scripts/bench_quant.py's CPU dry run: every variant loads (dummy weights quantized at load), decodes
and runs the offline batch in one call, with ratios against bf16 and greedy agreement on a real model."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_quant", ROOT / "scripts" / "bench_quant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_quant_dry_run(tmp_path):
    bench = _bench()
    out = tmp_path / "bq.json"
    model = str(ROOT / "models" / "tandem-tiny")
    report = bench.main(["--model", model, "--device", "cpu", "--variants", "bf16,w4a16,w4a16-awq,fp8,fp8-kv",
                         "--prompt-len", "8", "--gen-len", "3", "--num-requests", "3", "--mean-input", "6",
                         "--mean-output", "3", "--max-input", "12", "--max-output", "6", "--max-model-len", "64",
                         "--agreement-model", model, "--agreement-prompts", "2", "--agreement-prompt-len", "12",
                         "--agreement-gen-len", "4", "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == report["ratios"]
    res = report["results"]
    assert set(res) == {"bf16", "w4a16", "w4a16-awq", "fp8", "fp8-kv"}
    for variant, r in res.items():
        assert r["decode"]["gen_tokens"] == 3 and r["offline"]["output_tokens"] > 0, variant
        assert r["decode"]["ms_per_token"] > 0 and r["decode"]["fused_decode"] is False, variant  # CPU: no graphs
    assert res["bf16"]["linear_kernel"] == "plain"
    assert res["w4a16"]["linear_kernel"] == "reference dequantize"  # CPU: no Triton kernels
    assert res["fp8-kv"]["kv_dtype"] == "float8_e4m3fn"
    assert res["fp8-kv"]["kv_bytes_per_block"] * 4 == res["bf16"]["kv_bytes_per_block"]  # fp32 on CPU
    assert res["w4a16"]["weight_gib"] < res["bf16"]["weight_gib"]
    assert set(report["ratios"]) == {"w4a16", "w4a16-awq", "fp8", "fp8-kv"}
    agree = report["agreement"]
    assert agree["fp8-kv"]["requests"] == 2 and 0.0 <= agree["w4a16"]["token_agreement"] <= 1.0


def test_sync_variants_run_one_step_at_a_time(monkeypatch):
    """bf16-sync / w4a16-sync load their engine with TANDEM_RANK_LAUNCH_AHEAD=0 (the in-process engine then sends no
    step ahead, the A/B of its launch-ahead), and the caller's value comes back afterwards."""
    import os

    import torch

    from workers.launched_step import LAUNCH_AHEAD_ENV, launch_ahead_enabled

    bench = _bench()
    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    for variant in ("bf16-sync", "w4a16-sync"):
        assert bench.VARIANTS[variant] == bench.VARIANTS[variant.removesuffix("-sync")]
        with bench.variant_env(variant):
            assert not launch_ahead_enabled(torch.device("cuda"))
        assert os.environ[LAUNCH_AHEAD_ENV] == "1"


def test_w4a16_head_variant_quantizes_the_lm_head(tmp_path):
    """w4a16-head: the model folder's config.json gets GPTQ with `lm_head: true` (dummy weights quantized at load,
    the head included); the agreement run writes a real checkpoint with the head quantized by the project's tool."""
    from tests.models import tiny_model

    bench = _bench()
    model = tiny_model("llama", vocab_size=320)  # untied, a vocabulary that packs 8 codes a word
    report = bench.main(["--model", model, "--device", "cpu", "--variants", "bf16,w4a16,w4a16-head",
                         "--prompt-len", "8", "--gen-len", "3", "--num-requests", "0", "--max-model-len", "64",
                         "--agreement-model", model, "--agreement-prompts", "2", "--agreement-prompt-len", "12",
                         "--agreement-gen-len", "4", "--out", str(tmp_path / "bq.json")])
    res = report["results"]
    assert res["w4a16"]["lm_head_kernel"] == "plain"
    assert res["w4a16-head"]["lm_head_kernel"] == "reference dequantize"  # quantized; CPU runs it dequantized
    assert res["w4a16-head"]["linear_kernel"] == res["w4a16"]["linear_kernel"]
    assert res["w4a16-head"]["weight_gib"] < res["w4a16"]["weight_gib"]
    assert res["w4a16-head"]["decode"]["gen_tokens"] == 3
    assert report["agreement"]["w4a16-head"]["requests"] == 2
