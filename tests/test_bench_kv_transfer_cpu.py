"""scripts/bench_kv_transfer.py over gloo (two CPU processes): the same code as on GPUs, as a check that its
agent variants run, move every block intact and are reported beside the raw baseline."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_kv_transfer as bench  # noqa: E402


def test_the_agent_with_each_min_messages_is_timed_and_verified(tmp_path):
    out = tmp_path / "kv.json"
    bench.main(["--device", "cpu", "--tokens", "32", "--layers", "4", "--kv-heads", "2", "--head-dim", "16",
                "--min-messages", "1,4", "--nccl-high-priority", "--copy-programs", "8", "--overlap-copy-programs", "8", "--variants", "m2o8,p0", "--in-flight", "3", "--iters", "1", "--warmup", "0", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["verified"] and row["min_messages"] == 1
    assert row["agent_ms"] > 0 and row["agent_m4_ms"] > 0 and row["raw_ms"] > 0
    assert row["agent_m4_over_raw"] == pytest.approx(row["agent_m4_ms"] / row["raw_ms"])
    # The second pair (high-priority NCCL streams on GPUs; on gloo the same transfer) is timed beside them.
    assert row["agent_hp_ms"] > 0 and row["agent_hp_over_raw"] == pytest.approx(row["agent_hp_ms"] / row["raw_ms"])
    # A capped row copy (GPU only; over gloo the same transfer) is timed too.
    assert row["agent_c8_ms"] > 0 and row["agent_c8_over_raw"] == pytest.approx(row["agent_c8_ms"] / row["raw_ms"])
    assert row["agent_o8_ms"] > 0  # and one capped only beside a message in flight
    assert row["agent_m2o8_ms"] > 0 and row["agent_m2o8_over_raw"] > 0  # and a mix given by --variants
    assert row["agent_p0_ms"] > 0  # and the peer copy's switch (gloo pairs never copy so: the same transfer)
    assert row["agent_x3_ms"] > 0 and row["agent_x3_over_raw"] > 0  # and three numbered transfers in flight at once


def test_profile_script_reports_both_ranks_host_time(tmp_path):
    """scripts/profile_kv_transfer.py over gloo: both ranks' transfers run under cProfile and the report names the
    agent's send and receive paths with a median per transfer."""
    import profile_kv_transfer as prof

    out = tmp_path / "profile.txt"
    prof.main(["--device", "cpu", "--tokens", "32", "--layers", "2", "--iters", "3", "--warmup", "1", "--top", "15",
               "--out", str(out)])
    report = out.read_text()
    assert "=== rank 0 (send): median" in report and "=== rank 1 (recv): median" in report
    assert re.search(r"transport\.py:\d+\(send\)", report) and re.search(r"transport\.py:\d+\(recv\)", report)
