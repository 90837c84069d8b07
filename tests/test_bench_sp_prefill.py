"""scripts/bench_sp_prefill.py end to end on CPU at tiny sizes: every layout and length gets a cell."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_sp1_and_sp2_cells_with_times(ray_session, tmp_path):
    from bench_sp_prefill import main

    out = tmp_path / "sp"
    assert main(["--model", str(REPO / "models" / "tandem-tiny"), "--device", "cpu", "--lengths", "48,160",
                 "--layouts", "sp1 sp2", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    for spec, gpus in (("sp1", 1), ("sp2", 2)):
        res = report["results"][spec]
        assert res["gpus"] == gpus
        for n in ("48", "160"):
            cell = res["lengths"][n]
            assert cell["seconds"] > 0 and len(cell["all_seconds"]) == 3 and cell["tok_per_s"] == pytest.approx(int(n) / cell["seconds"])


def test_a_layout_that_cannot_start_is_recorded(ray_session, tmp_path):
    from bench_sp_prefill import main

    out = tmp_path / "bad"
    # 64 ranks cannot be placed on this 2-CPU Ray: recorded as that layout's error, the others still run.
    assert main(["--model", str(REPO / "models" / "tandem-tiny"), "--device", "cpu", "--lengths", "32",
                 "--layouts", "sp1 sp64", "--out", str(out)]) == 1
    report = json.loads(out.with_suffix(".json").read_text())
    assert "seconds" in report["results"]["sp1"]["lengths"]["32"]
    assert report["results"]["sp64"]["error"].startswith("start-up:")
