"""scripts/bench_step_dispatch.py's in-process stage timing runs and times each stage of the round trip."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stage_timing_names_every_stage_of_the_round_trip():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench_step_dispatch import stage_us
    finally:
        sys.path.pop(0)
    stages = stage_us(seqs=8, iters=20)
    assert list(stages) == ["encode", "decode", "answer", "pack", "pickle", "unpack"]
    assert all(v > 0 for v in stages.values())


def test_stages_command_line():
    out = subprocess.run([sys.executable, "scripts/bench_step_dispatch.py", "--stages", "--iters", "20", "--seqs", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "encode" in out.stdout and "total" in out.stdout
