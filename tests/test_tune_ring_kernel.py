"""scripts/tune_ring_kernel.py on CPU at tiny shapes (--device cpu --dry-run: the ring kernel under Triton's
interpreter, in a subprocess since the interpreter must be on before the kernels are defined): every
(length, SP, config) cell gets a time, a ratio to SP=1 and an error within tolerance, and the summary ranks
every config."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_times_and_checks_every_config(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "tune.json"
    configs = ["16,16,4,1", "32,16,4,1,pack"]
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_RING_KERNEL"}
    done = subprocess.run([sys.executable, "scripts/tune_ring_kernel.py", "--device", "cpu", "--dry-run", "--lengths",
                           "37", "--sp", "2", "--configs", ";".join(configs), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["configs"] == configs and report["dtype"] == "fp32"
    (cell,) = report["results"]
    assert cell["tokens"] == 37 and cell["sp1"]["baseline_s"] > 0
    for config in configs:
        res = cell["sp"]["2"][config]
        assert [r["rank"] for r in res["ranks"]] == [0, 1] and res["slowest_s"] > 0
        assert res["ratio"] == res["slowest_s"] / cell["sp1"]["baseline_s"] and res["goal"] == 0.55
        assert res["max_abs_err"] < 1e-4 and res["within_bf16_tol"] and res["issue_ms"] > 0
        assert res["stream_ratio"] == res["slowest_stream_s"] / cell["sp1"]["baseline_stream_s"]
    assert sorted(r["config"] for r in report["summary"]) == sorted(configs)
    assert sorted(r["config"] for r in report["summary_streamed"]) == sorted(configs)
    assert all(r["worst_ratio_over_goal"] is not None for r in report["summary"])
    assert "configs by worst ratio/goal" in done.stdout


def test_bad_config_is_refused_before_timing():
    done = subprocess.run([sys.executable, "scripts/tune_ring_kernel.py", "--device", "cpu", "--dry-run", "--configs",
                           "128,64,8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "BLOCK_M,BLOCK_N,warps,stages" in done.stderr


def test_splits_cross_every_config_and_the_split_steps_show(tmp_path):
    """--splits: each config once per split-K count (its own split field replaced); a forced split's steps run
    as pieces (slots > 0 in step_tables), split=1's never, and both stay exact."""
    pytest.importorskip("triton")
    out = tmp_path / "tune.json"
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_RING_KERNEL"}
    done = subprocess.run([sys.executable, "scripts/tune_ring_kernel.py", "--device", "cpu", "--dry-run", "--lengths",
                           "45", "--sp", "2", "--configs", "16,16,4,1,split=3", "--splits", "1,2,auto", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["configs"] == ["16,16,4,1,split=1", "16,16,4,1,split=2", "16,16,4,1"] and report["sms"] == 1
    res = report["results"][0]["sp"]["2"]
    for config in report["configs"]:
        assert res[config]["within_bf16_tol"] and res[config]["max_abs_err"] < 1e-4
        assert len(res[config]["step_tables"]) == 2
    assert all(t[1] == 0 for t in res["16,16,4,1,split=1"]["step_tables"])
    assert any(t[1] > 0 for t in res["16,16,4,1,split=2"]["step_tables"])
    # Split, a step has more rows (pieces), each with fewer key tiles at most.
    for one, two in zip(res["16,16,4,1,split=1"]["step_tables"], res["16,16,4,1,split=2"]["step_tables"]):
        assert two[0] >= one[0] and two[3] <= one[3] and (two[1] == 0 or two[3] < one[3])
    assert "*" in done.stdout  # the split steps are marked in the table


def test_with_splits():
    sys.path.insert(0, str(ROOT / "scripts"))
    from tune_ring_kernel import with_splits

    assert with_splits(["128,128,8,3,pack", "64,64,4,2,split=4"], None) == ["128,128,8,3,pack", "64,64,4,2,split=4"]
    assert with_splits(["128,128,8,3,pack", "64,64,4,2,split=4"], "1,auto") == [
        "128,128,8,3,pack,split=1", "128,128,8,3,pack", "64,64,4,2,split=1", "64,64,4,2"]


def test_flags_cross_every_config():
    sys.path.insert(0, str(ROOT / "scripts"))
    from tune_ring_kernel import with_flags

    assert with_flags(["128,128,8,3,pack"], None) == ["128,128,8,3,pack"]
    assert with_flags(["128,128,8,3,pack", "128,64,8,3,early"], "none,early,early+pdl") == [
        "128,128,8,3,pack", "128,128,8,3,pack,early", "128,128,8,3,pack,early,pdl",
        "128,64,8,3,early", "128,64,8,3,early,pdl"]
