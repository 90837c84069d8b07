"""scripts/bench_sp_rank.py on CPU at tiny shapes (--dry-run): every length x SP size gets a cell with a time
per rank, an error against SP=1 attention within bf16 tolerance, the ratio and the issue's goal."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


def test_dry_run_reports_every_cell(tmp_path):
    from bench_sp_rank import main

    out = tmp_path / "sp_rank.json"
    assert main(["--device", "cpu", "--dry-run", "--lengths", "37,64", "--sp", "2,4,3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"] == {"heads": 4, "kv_heads": 2, "head_dim": 16} and report["block_size"] == 4
    for n, cell in zip((37, 64), report["results"]):
        assert cell["tokens"] == n and cell["sp1"]["baseline"] == "sdpa" and cell["sp1"]["baseline_s"] > 0
        for sp in (2, 4, 3):
            res = cell["sp"][str(sp)]
            assert [c["rank"] for c in res["ranks"]] == list(range(sp))
            assert sum(c["query_tokens"] for c in res["ranks"]) == n
            assert res["slowest_s"] == max(c["seconds"] for c in res["ranks"]) > 0
            assert res["ratio"] == res["slowest_s"] / cell["sp1"]["baseline_s"]
            assert res["goal"] == {2: 0.55, 4: 0.3}.get(sp) and res["within_bf16_tol"]
            assert 0 <= res["max_abs_err"] < 2e-2
            # Ulysses where 4 query / 2 KV heads divide: SP=2 only.
            assert ("ulysses" in res) == (sp == 2)
        u = cell["sp"]["2"]["ulysses"]
        assert u["seconds"] > 0 and u["ratio"] == u["seconds"] / cell["sp1"]["baseline_s"]
        assert 0 <= u["max_abs_err"] < 2e-2


def test_bad_arguments_exit():
    import pytest
    from bench_sp_rank import main

    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--dry-run", "--heads", "5", "--kv-heads", "2"])


def test_interleaved_rounds_time_every_cell_under_the_same_clocks():
    """--order interleaved: every cell once per round, the order reversed every other round, then the streamed
    rounds; sequential: one cell's runs after another's. A clock that slows with each call (a warming GPU) then
    slows every interleaved cell alike, and only the later cells of a sequential run."""
    from bench_sp_rank import measure

    calls, clock = [], {"t": 0.0}

    def cell(name):
        def fn():
            calls.append(name)
            clock["t"] += 1
            time.sleep(1e-4 * clock["t"])  # each call slower than the one before
        return fn

    names = ["sp1", "sp2/rank0", "sp2/rank1"]
    res = measure({n: cell(n) for n in names}, "cpu", 4, 2, "interleaved", {"sp1", "sp2/rank0"})
    timed = calls[:12]
    assert timed == names + names[::-1] + names + names[::-1]
    streamed = calls[12:]
    assert streamed == ["sp1"] * 2 + ["sp2/rank0"] * 2 + ["sp2/rank0"] * 2 + ["sp1"] * 2 + \
        ["sp1"] * 2 + ["sp2/rank0"] * 2 + ["sp2/rank0"] * 2 + ["sp1"] * 2
    assert set(res) == set(names) and "stream_s" in res["sp1"] and "stream_s" not in res["sp2/rank1"]
    assert all(r["min_s"] <= r["s"] <= r["max_s"] for r in res.values())
    # Same clocks: no cell's median is more than a round's drift from another's.
    spread = max(r["s"] for r in res.values()) / min(r["s"] for r in res.values())
    calls.clear()
    clock["t"] = 0.0
    seq = measure({n: cell(n) for n in names}, "cpu", 4, 2, "sequential", {"sp1"})
    assert calls[:8] == ["sp1"] * 8 and calls[8:12] == ["sp2/rank0"] * 4  # timed 4, then streamed 4 (reps)
    assert seq["sp2/rank1"]["s"] / seq["sp1"]["s"] > spread  # the last cell pays the slowest clocks
