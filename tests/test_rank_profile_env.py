"""TANDEM_RANK_PROFILE: a served rank profiles its own steps and logs each window's summary."""
from __future__ import annotations

import json
import logging

import pytest

from workers.rank_profile import LoggedRankProfile, logged_profile


def test_unset_means_no_profile():
    assert logged_profile(0, {}) is None
    assert logged_profile(0, {"TANDEM_RANK_PROFILE": " "}) is None


@pytest.mark.parametrize("value", ["x", "1:2:3", "-1", "2:-5", "1.5"])
def test_a_malformed_value_is_refused_by_name(value):
    with pytest.raises(ValueError, match="TANDEM_RANK_PROFILE"):
        logged_profile(0, {"TANDEM_RANK_PROFILE": value})


def test_each_window_is_logged_with_its_step_kinds_sizes_and_percentiles(caplog):
    profile = logged_profile(3, {"TANDEM_RANK_PROFILE": "0:4"})
    assert isinstance(profile, LoggedRankProfile) and profile.log_every == 4 and profile.gpu_every == 0
    with caplog.at_level(logging.WARNING, logger="workers.rank_profile"):
        for i in range(10):  # two full windows of four steps, and two steps of a third
            kind = "mixed" if i % 4 == 0 else "decode-graph"
            assert profile.step(kind, 0.001, 0.0, lambda: i * 2, tokens=100 if kind == "mixed" else 8, seqs=8) == i * 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank profile ")]
    assert len(lines) == 2 and len(profile.rows) == 2
    first = json.loads(lines[0].removeprefix("rank profile "))
    assert first["rank"] == 3 and first["window"] == 1 and first["steps"] == 4
    by = first["by_kind"]
    assert by["mixed"]["steps"] == 1 and by["decode-graph"]["steps"] == 3
    assert by["mixed"]["mean_tokens"] == 100 and by["decode-graph"]["mean_tokens"] == 8 and by["decode-graph"]["mean_seqs"] == 8
    assert 0 <= by["decode-graph"]["ms_execute_p50"] <= by["decode-graph"]["ms_execute_p90"]


def test_a_traced_step_names_ops_not_python_frames(tmp_path, monkeypatch):
    """A step that writes a trace records Python frames; a frame that waits (here, sleeps) has a long self time,
    and the step's table of host ops must still name the ops (it failed on a loaded CI host with the frames in)."""
    import time

    import torch

    from workers.rank_profile import RankProfile

    monkeypatch.setenv("TANDEM_PROFILE_TRACE_DIR", str(tmp_path))
    profile = RankProfile(0, gpu_every=1)
    x, w = torch.randn(8, 64), torch.randn(64, 64)

    def run():
        time.sleep(0.05)
        return torch.nn.functional.linear(x, w).softmax(-1)

    try:
        profile.step("mixed", 0.0, 0.0, run, tokens=8, seqs=1)
        profile.summary()  # reads the step's profiler
    finally:
        profile.gc.remove()
    top = profile.rows[0]["top_host"]
    assert list(tmp_path.iterdir()), "the step wrote no trace, so it recorded no Python frames"
    assert any(name.startswith("aten::") for name in top) and all(name.startswith("aten::") for name in top), top


def test_python_frames_are_told_apart_on_a_torch_without_the_flag():
    """torch 2.11 (the GPU hosts) has no `is_python_function` on its events: the names tell the frames."""
    from types import SimpleNamespace

    from workers.rank_profile import _is_python_frame

    assert _is_python_frame(SimpleNamespace(key="cluster/rank_worker.py(166): _run"))
    assert _is_python_frame(SimpleNamespace(key="<built-in method sleep of module object>"))
    assert not _is_python_frame(SimpleNamespace(key="aten::copy_"))
    assert not _is_python_frame(SimpleNamespace(key="x.py(1): f", is_python_function=False))  # the flag wins


def test_a_sampled_step_is_read_at_summary_not_in_its_own_time(tmp_path, monkeypatch):
    """Parsing a profiled step's events takes far longer than the step: it is left for `summary`, so neither the
    step's recorded time nor the next step waits for it. Traces are still capped per kind, though written later."""
    import torch

    from workers import rank_profile
    from workers.rank_profile import RankProfile

    monkeypatch.setenv("TANDEM_PROFILE_TRACE_DIR", str(tmp_path))
    reads: list[int] = []
    read = RankProfile._read_profiler
    monkeypatch.setattr(RankProfile, "_read_profiler", lambda self, row: (reads.append(row["n"]), read(self, row)))
    profile = RankProfile(0, gpu_every=1)  # every step sampled
    x, w = torch.randn(8, 64), torch.randn(64, 64)
    try:
        for _ in range(rank_profile.TRACES_PER_KIND + 2):
            profile.step("mixed", 0.0, 0.0, lambda: torch.nn.functional.linear(x, w), tokens=8, seqs=1)
        assert reads == [] and not list(tmp_path.iterdir())
        assert all("profiler" in r and "kernels" not in r for r in profile.rows)
        d = profile.summary()["mixed"]
    finally:
        profile.gc.remove()
    steps = list(range(rank_profile.TRACES_PER_KIND + 2))
    assert reads == steps and all("profiler" not in r for r in profile.rows)
    assert d["sampled_steps"] == len(steps) and any(name.startswith("aten::") for name in d["ms_top_host"])
    traces = sorted(q.name for q in tmp_path.iterdir())
    assert traces == [f"rank0-mixed-step{n}-8tok.json.gz" for n in range(rank_profile.TRACES_PER_KIND)]
    profile.summary()  # a second summary reads nothing again
    assert reads == steps


def test_unread_profilers_are_bounded():
    """A profiler holds its step's events; past MAX_UNREAD of them the profile reads them at once (a served rank
    profiling every step of a 500-step window would otherwise hold 500)."""
    import torch

    from workers import rank_profile
    from workers.rank_profile import RankProfile

    profile = RankProfile(0, gpu_every=1)
    x = torch.randn(4, 8)
    try:
        for i in range(rank_profile.MAX_UNREAD + 1):
            profile.step("decode", 0.0, 0.0, lambda: x.sum(), tokens=1, seqs=1)
            assert len(profile.unread) == (i + 1 if i < rank_profile.MAX_UNREAD else 0)
        assert all("profiler" not in r and "top_host" in r for r in profile.rows)
        assert profile.summary()["decode"]["sampled_steps"] == rank_profile.MAX_UNREAD + 1
    finally:
        profile.gc.remove()
