"""scripts/ring_timeline.py's report of the compiled ring kernels (registers, spills, shared memory, warps): read
from the handles the ring keeps for direct launches, one row per specialisation. The timeline itself needs a GPU."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import ring_timeline  # noqa: E402


def test_compiled_kernels_reports_each_kept_handle(monkeypatch):
    handles = {
        ("a",): SimpleNamespace(n_regs=231, n_spills=0, metadata=SimpleNamespace(shared=230424, num_warps=8)),
        ("b",): SimpleNamespace(n_regs=255, n_spills=116, metadata=SimpleNamespace(shared=98576, num_warps=4)),
    }
    monkeypatch.setattr(ring_timeline.rt, "_HANDLES", handles)
    assert ring_timeline.compiled_kernels() == [
        {"regs": 231, "spills": 0, "shared_bytes": 230424, "warps": 8},
        {"regs": 255, "spills": 116, "shared_bytes": 98576, "warps": 4},
    ]
    monkeypatch.setattr(ring_timeline.rt, "_HANDLES", {})
    assert ring_timeline.compiled_kernels() == []
