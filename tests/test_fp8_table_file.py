"""TANDEM_FP8_TABLE: the fastest tiles of a `bench_gemv.py --fp8 --sweep` JSON join gemv_quant.FP8_TABLE, over its
built-in entries, so one sweep on a GPU serves every engine after it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sweep_json(path: Path) -> None:
    rows = [{"shape": "llama-3.1-8b down", "n": 4096, "k": 14336, "kind": "residual",
             "best_config": {"BLOCK_N": 8, "KS": 128, "num_warps": 4, "num_stages": 1, "BLOCK_C": 8, "RED": True}},
            {"shape": "llama-3.1-8b o", "n": 4096, "k": 4096, "kind": "residual",
             "best_config": {"BLOCK_N": 4, "KS": 128, "num_warps": 4, "num_stages": 1, "BLOCK_C": 8, "RED": True}},
            {"shape": "not swept", "n": 1, "k": 1, "kind": "plain"}]  # a row without a sweep adds nothing
    path.write_text(json.dumps({"benchmark": "gemv_fp8", "results": rows}))


def test_a_sweep_file_adds_and_overrides_table_entries(tmp_path):
    sweep = tmp_path / "sweep.json"
    _sweep_json(sweep)
    code = ("from parallel.kernels import gemv_quant as gq; import json; "
            "print(json.dumps({f'{n},{k},{kind}': c for (n, k, kind), c in gq.FP8_TABLE.items()}))")
    env = {**os.environ, "TANDEM_FP8_TABLE": str(sweep), "PYTHONPATH": str(ROOT)}
    table = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True, cwd=ROOT).stdout)
    assert table["4096,14336,residual"]["BLOCK_N"] == 8  # the file's tiles
    assert table["4096,4096,residual"]["BLOCK_N"] == 4 and table["4096,4096,residual"]["KS"] == 128  # overrides
    assert table["6144,4096,paired"]["BLOCK_N"] == 4  # a built-in entry the file does not name stays
    assert "1,1,plain" not in table


def test_load_returns_the_entries_it_added(tmp_path):
    from parallel.kernels import gemv_quant as gq

    sweep = tmp_path / "sweep.json"
    _sweep_json(sweep)
    saved = dict(gq.FP8_TABLE)
    try:
        assert gq.load_fp8_table(str(sweep)) == 2
        assert gq.FP8_TABLE[(4096, 14336, "residual")]["KS"] == 128
    finally:
        gq.FP8_TABLE.clear()
        gq.FP8_TABLE.update(saved)


def test_the_quantized_paths_knobs_reach_rank_actors(monkeypatch):
    """Read at load on every rank: set in the driver, they must reach the Ray rank actors (TP, PD pools)."""
    from cluster.ray_runtime import rank_runtime_env

    knobs = {"TANDEM_FP8_TABLE": "/tmp/sweep.json", "TANDEM_FUSED_QUANT": "0", "TANDEM_FP8_FUSED_ACT": "0",
             "TANDEM_FP8_FAST_ACCUM": "1"}
    for k, v in knobs.items():
        monkeypatch.setenv(k, v)
    env = rank_runtime_env()["env_vars"]
    assert {k: env.get(k) for k in knobs} == knobs
