"""scripts/bench_sp_rank.py on CPU at tiny shapes (--dry-run): every length x SP size gets a cell with a time
per rank, an error against SP=1 attention within bf16 tolerance, the ratio and the issue's goal."""
from __future__ import annotations

import json
import sys
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
