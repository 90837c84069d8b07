"""scripts/bench_sp_prefill.py end to end on CPU at tiny sizes: every layout and length gets a cell,
each layout in its own process by default."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = pytest.mark.slow
TINY = str(REPO / "models" / "tandem-tiny")


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    """The session's Ray (tests/conftest.py, 6 CPUs), which the benchmark's layout processes join
    (RAY_ADDRESS) instead of starting their own."""
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = shared_ray
    yield
    if previous is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = previous


def test_sp1_and_sp2_cells_with_times_each_layout_in_its_own_process(ray_session, tmp_path):
    from bench_sp_prefill import main

    out = tmp_path / "sp"
    assert main(["--model", TINY, "--device", "cpu", "--lengths", "48,160", "--layouts", "sp1 sp2", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    for spec, gpus in (("sp1", 1), ("sp2", 2)):
        res = report["results"][spec]
        assert res["gpus"] == gpus
        for n in ("48", "160"):
            cell = res["lengths"][n]
            assert cell["seconds"] > 0 and len(cell["all_seconds"]) == 3 and cell["tok_per_s"] == pytest.approx(int(n) / cell["seconds"])
    # The engines ran in two processes, neither this one: the first engine's memory cannot reach the second.
    processes = {report["results"][spec]["process"] for spec in ("sp1", "sp2")}
    assert len(processes) == 2 and os.getpid() not in processes


def test_a_layout_that_cannot_start_is_recorded(ray_session, tmp_path):
    from bench_sp_prefill import main

    out = tmp_path / "bad"
    # 64 ranks cannot be placed on this 6-CPU Ray: recorded as that layout's error, the others still run.
    # In this process (--no-isolate), the mode that keeps every layout's engine here.
    assert main(["--model", TINY, "--device", "cpu", "--lengths", "32", "--layouts", "sp1 sp64", "--no-isolate",
                 "--out", str(out)]) == 1
    report = json.loads(out.with_suffix(".json").read_text())
    assert "seconds" in report["results"]["sp1"]["lengths"]["32"]
    assert report["results"]["sp1"]["process"] == os.getpid()
    assert report["results"]["sp64"]["error"].startswith("start-up:")


def test_a_layout_process_that_dies_keeps_its_finished_cells(tmp_path, monkeypatch):
    """A layout's process killed after its first length (a hard crash, say): that cell is kept, the
    unfinished length says the process died, and the exit code is in the message."""
    import bench_sp_prefill as bench

    partial = {"results": {"sp2": {"gpus": 2, "lengths": {"48": {"seconds": 1.0}}}}}
    script = (f"import json, pathlib, sys; pathlib.Path(sys.argv[1]).with_suffix('.json').write_text({json.dumps(json.dumps(partial))}); "
              "sys.exit(7)")
    monkeypatch.setattr(bench, "child_command", lambda args, spec, out: [sys.executable, "-c", script, str(out)])
    args = bench.parse_args(["--model", TINY, "--device", "cpu", "--lengths", "48,160", "--layouts", "sp2"])
    result = bench.run_isolated("sp2", args)
    assert result["lengths"]["48"] == {"seconds": 1.0}
    assert "exited with code 7 before this length finished" in result["lengths"]["160"]["error"]
    monkeypatch.setattr(bench, "child_command", lambda args, spec, out: [sys.executable, "-c", "import sys; sys.exit(9)"])
    assert bench.run_isolated("sp2", args) == {"gpus": 2, "error": "the layout's process exited with code 9 before the engine started"}
