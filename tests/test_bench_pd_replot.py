"""scripts/bench_pd_vs_colocated.py --replot: the table and the PNG (TTFT, TPOT, goodput against rate) from a
saved JSON, without starting anything."""
from __future__ import annotations

import json

import pytest


def _point(rate: float, goodput: float, within_20ms: float | None = None) -> dict:
    return {"label": f"{rate:g} req/s", "rate": rate, "summary": {
        "request_throughput": goodput, "goodput": goodput, "ttft_s": {"p50": 0.05}, "tpot_s": {"p50": 0.008},
        **({"goodput_by_tpot_ms": {"20": within_20ms}} if within_20ms is not None else {})}}


def _run(path, base: list[dict], pd: list[dict]):
    path.write_text(json.dumps({"meta": {}, "deployments": {
        "colocated": {"flags": [], "points": base, "vs_first": []},
        "pd": {"flags": ["--disaggregated"], "points": pd, "vs_first": []}}}))
    return str(path)


def test_replot_draws_the_saved_sweep(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from scripts.bench_pd_vs_colocated import main

    saved = _run(tmp_path / "run.json", [_point(2, 1.6), _point(4, 3.4)], [_point(2, 1.44), _point(4, 3.0)])
    assert main(["--replot", saved, "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "colocated" in out and "pd" in out and "0.90" in out  # pd's goodput at 2 req/s over colocated's


def test_runs_of_one_sweep_split_over_calls_merge_in_rate_order(tmp_path, capsys):
    """Rates 16 and 24 from one call, 2 and 4 from another: one curve per deployment, in rate order, each point's
    ratio against the baseline's point of its own rate; the tighter-TPOT goodput is drawn too."""
    pytest.importorskip("matplotlib")
    from scripts.bench_pd_vs_colocated import main, merge_runs

    late = _run(tmp_path / "late.json", [_point(16, 10.0, 8.0), _point(24, 12.0, 2.0)],
                [_point(16, 12.5, 12.5), _point(24, 15.0, 15.0)])
    early = _run(tmp_path / "early.json", [_point(2, 2.0, 2.0), _point(4, 4.0, 4.0)],
                 [_point(2, 2.0, 2.0), _point(4, 3.8, 3.8)])
    merged = merge_runs([json.loads(open(f).read()) for f in (late, early)])
    assert [p["rate"] for p in merged["pd"]["points"]] == [2, 4, 16, 24]
    assert [round(r["goodput"], 2) for r in merged["pd"]["vs_first"]] == [1.0, 0.95, 1.25, 1.25]
    assert main(["--replot", late, early, "--out", str(tmp_path / "both")]) == 0
    assert (tmp_path / "both.png").stat().st_size > 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pd")]
    assert [line.split()[1] for line in lines] == ["2", "4", "16", "24"]


def test_out_names_keep_their_dots():
    """`--out runs/gil_0.005` writes runs/gil_0.005.json, not runs/gil_0.json; a given .json or .png is replaced."""
    from pathlib import Path

    from scripts.bench_pd_vs_colocated import output_path

    assert output_path("runs/gil_0.005", ".json") == Path("runs/gil_0.005.json")
    assert output_path("runs/x.json", ".png") == Path("runs/x.png")
    assert output_path("runs/x", ".json") == Path("runs/x.json")
