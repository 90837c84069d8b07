"""scripts/step_profile.py and the in-process executor's launch-ahead. With ranks=False (bench_offline.py
--step-times) the driver's step table alone, the executor unprofiled. With a rank profile the in-process executor
still launches every step but those the profile samples under torch.profiler, as a rank loop does, and records the
launched ones when their tokens are in (before 2026-11-30 a profile stopped its launch-ahead altogether, which
slowed the one-GPU baseline of every profiled comparison). The launch-ahead is forced on for CPU here
(TANDEM_RANK_LAUNCH_AHEAD=1), as tests/test_rank_launch_ahead.py does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.launched_step import LAUNCH_AHEAD_ENV

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("ranks,gpu_every", [(False, 0), (True, 0), (True, 1)],
                         ids=["driver-only", "rank-profile", "every-step-sampled"])
def test_profiles_keep_the_in_process_launch_ahead(ranks: bool, gpu_every: int, monkeypatch):
    sys.path.insert(0, str(SCRIPTS))
    from step_profile import StepProfile
    from tandem import LLM, SamplingParams
    from tests.models import tiny_model

    monkeypatch.setenv(LAUNCH_AHEAD_ENV, "1")
    llm = LLM(tiny_model("llama", num_hidden_layers=2), device="cpu", show_progress=False)
    try:
        executor = llm.llm_engine.executor
        prof = StepProfile(llm.llm_engine, gpu_every=gpu_every, ranks=ranks)
        outs = llm.generate([[1, 2, 3, 4, 5] * 4] * 3, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        summary, table = prof.summary(), prof.table()
        launched = executor.launches["launched"]
    finally:
        llm.shutdown()
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert summary["host"]["mixed"]["steps"] == 1 and summary["host"]["decode"]["steps"] == 5
    assert "driver (ms per step)" in table
    if not ranks:  # the decode steps were launched, not run whole; no rank table
        assert launched >= 4 and summary["ranks"] == [] and "rank kind" not in table
        return
    rank = summary["ranks"][0]  # every step recorded, launched or run whole
    assert rank["mixed"]["steps"] == 1 and rank["decode"]["steps"] == 5 and "rank kind" in table
    if gpu_every == 1:  # every step sampled under torch.profiler: all run whole
        assert launched == 0 and rank["decode"]["sampled_steps"] == 5
    else:
        assert launched >= 4 and rank["decode"]["ms_execute"] > 0


def test_step_times_and_profile_steps_are_one_or_the_other(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_offline.py"), "--step-times", "--profile-steps", "5",
                          "--skip-hf", "--out", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "give one of them" in run.stderr
