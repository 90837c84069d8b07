"""scripts/profile_mixed_step_host.py on the shipped tiny model: it finds mixed steps (decodes beside prefill
chunks), times them and prints the profile of their execute, whose rows include the runner's step."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_mixed_step_host.py"
SMALL = ["--num-requests", "12", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--min-prompt", "20",
         "--max-prompt", "60", "--min-output", "4", "--max-output", "8", "--min-seqs", "4", "--warmup", "0",
         "--steps", "2"]


def _run(*extra: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *SMALL, *extra], check=True, capture_output=True, text=True,
                          timeout=300)
    return done.stdout


def test_mixed_steps_are_timed_and_profiled():
    out = _run("--top", "200", "--profile-schedule")
    head = re.search(r"mixed steps: (\d+) \(mean (\d+) seqs, (\d+) tokens\)", out)
    assert head is not None, out
    steps, seqs, tokens = map(int, head.groups())
    assert steps == 2 and seqs >= 4 and tokens > seqs  # more tokens than sequences: a prefill chunk ran
    assert re.search(r"execute ms/step: mean \d+\.\d+", out)
    assert "model_runner.py" in out and "(_prepare_flat)" in out and "(_run_step)" in out
    assert "---- schedule:" in out and "(schedule)" in out


def test_no_profile_prints_only_the_timings():
    out = _run("--no-profile")
    assert "(no profiler)" in out and "---- execute" not in out
