"""scripts/bench_allreduce.py on CPU (gloo, two forked ranks): a row per size with a time and a bandwidth."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_sizes_parse_with_units():
    from bench_allreduce import parse_size

    assert [parse_size(s) for s in ("8K", "2M", "512", "1.5KB")] == [8192, 2 << 20, 512, 1536]


@pytest.mark.slow
def test_cpu_run_writes_a_row_per_size(tmp_path, capsys):
    from bench_allreduce import main

    out = tmp_path / "ar.json"
    assert main(["--world-size", "2", "--device", "cpu", "--sizes", "8K,64K", "--iters", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [8192, 65536]
    assert all(r["eager_us"] > 0 and r["eager_bus_gbps"] > 0 and r["graph_us"] is None for r in rows)
    assert all(r["method"] == "nccl" and r["correct"] for r in rows)  # p2p is CUDA-only; every sum checked
    assert "eager us" in capsys.readouterr().out
