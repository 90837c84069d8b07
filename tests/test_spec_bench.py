"""scripts/bench_spec_decode.py end to end on CPU at tiny sizes (the GPU command's dry run): every section
is filled, speculation never changes a greedy output (the script asserts it), the numbers are sane."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


def test_dry_run_fills_every_section(tmp_path):
    from bench_spec_decode import main

    out = tmp_path / "spec"
    tiny = str(REPO / "models" / "tandem-tiny")
    assert main(["--model", tiny, "--device", "cpu", "--dry-run", "--out", str(out), "--draft", tiny,
                 "--sections", "step_cost,ngram_batch1,batch,draft_batch1,draft_natural"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    for b in ("1", "2"):
        cost = report["step_cost"][b]
        assert set(cost["ms"]) == {"0", "1", "2"} and all(v > 0 for v in cost["ms"].values())
        assert cost["ratio_to_decode"]["0"] == 1.0
        assert set(cost["implied_speedup"]) == {"0.5", "0.6", "0.7", "0.8", "0.9"}
    assert report["verification_graphs"] is None  # CPU: verification runs eagerly
    b1 = report["ngram_batch1"]
    assert b1["plain_tok_s"] > 0 and b1["ngram"]["2"]["tok_s"] > 0
    assert b1["ngram"]["2"]["agreement"]["identical"] == "1/1"  # fp32 on CPU: token-identical
    assert b1["plain"]["tokens_per_step"] == 1.0 and b1["plain"]["ms_per_step"] > 0  # one step per token
    ng = b1["ngram"]["2"]
    assert 1 <= ng["steps"] <= 12 and ng["tokens_per_step"] == round(12 / ng["steps"], 3) and ng["ms_per_step"] > 0
    emu = b1["emulated"]["0.8"]
    assert 0.3 < emu["acceptance"] <= 1.0 and emu["drafts"] > 0  # the emulated proposer is verified like any
    row = report["batch"]["3"]
    assert row["plain_tok_s"] > 0 and row["forced_on"]["drafts"] > 0
    assert row["policy"]["batch_size_limit"] == 24 // 5  # the CPU budget
    draft = report["draft_batch1"]["2"]  # the model as its own draft: every greedy draft is accepted
    assert draft["acceptance"] == 1.0 and draft["agreement"]["identical"] == "1/1"
    natural = report["draft_natural"]
    assert natural["draft_k2"]["acceptance"] == 1.0 and natural["draft_k2"]["agreement"]["identical"] == "8/8"
    assert natural["ngram_k2"]["batch1_tok_s"] > 0 and natural["plain"]["batched_tok_s"] > 0
