"""Running a script under Triton's interpreter (TRITON_INTERPRET=1), for the kernel tests on CPU. A
subprocess, since the variable must be set before the kernels are defined."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: float = 900) -> str:
    """Run `script` (Python source) with TRITON_INTERPRET=1 from the repository root; its stdout. A failure
    fails the calling test with the script's stderr; without Triton the test is skipped."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
