"""scripts/bench_pd_vs_colocated.py --replot: the table and the PNG (TTFT, TPOT, goodput against rate) from a
saved JSON, without starting anything."""
from __future__ import annotations

import json

import pytest


def _point(rate: float, goodput: float) -> dict:
    return {"label": f"{rate:g} req/s", "rate": rate, "summary": {
        "request_throughput": goodput, "goodput": goodput, "ttft_s": {"p50": 0.05}, "tpot_s": {"p50": 0.008}}}


def test_replot_draws_the_saved_sweep(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from scripts.bench_pd_vs_colocated import main

    base, pd = [_point(2, 1.6), _point(4, 3.4)], [_point(2, 1.5), _point(4, 3.0)]
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": {}, "deployments": {
        "colocated": {"flags": [], "points": base, "vs_first": [{"label": p["label"], "request_throughput": 1.0,
                                                                  "ttft_p50": 1.0, "tpot_p50": 1.0} for p in base]},
        "pd": {"flags": ["--disaggregated"], "points": pd, "vs_first": [{"label": p["label"], "request_throughput": 0.9,
                                                                         "ttft_p50": 1.0, "tpot_p50": 1.0} for p in pd]}}}))
    assert main(["--replot", str(saved), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "colocated" in out and "pd" in out and "0.90" in out


def test_out_names_keep_their_dots():
    """`--out runs/gil_0.005` writes runs/gil_0.005.json, not runs/gil_0.json; a given .json or .png is replaced."""
    from pathlib import Path

    from scripts.bench_pd_vs_colocated import output_path

    assert output_path("runs/gil_0.005", ".json") == Path("runs/gil_0.005.json")
    assert output_path("runs/x.json", ".png") == Path("runs/x.png")
    assert output_path("runs/x", ".json") == Path("runs/x.json")
