"""The one-shot P2P all-reduce (parallel/p2p_allreduce.py) on two GPUs, through scripts/bench_allreduce.py:
every sum is checked, eager and from a CUDA graph, below and above its size limit (NCCL takes over);
and where each rank sees only its own GPU (as Ray started ranks before) it is refused and NCCL runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.parametrize("visible", ["all", "one"])
def test_sums_are_exact_and_p2p_only_where_ranks_see_each_other(tmp_path, visible):
    from bench_allreduce import main

    out = tmp_path / "ar.json"
    assert main(["--world-size", "2", "--device", "cuda", "--visible", visible, "--sizes", "8K,1M,8M",
                 "--iters", "5", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows and all(r["correct"] for r in rows)
    methods = {r["method"] for r in rows}
    if visible == "all":
        assert methods == {"nccl", "p2p"} and report["meta"]["p2p_limit_bytes"] == 4 << 20
    else:
        assert methods == {"nccl"} and "p2p_error" in report["meta"]
