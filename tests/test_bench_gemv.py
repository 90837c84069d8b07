"""scripts/bench_gemv.py's TP shapes: what one TP rank holds of each Llama-3.1-8B layer (`--tp`)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_gemv import SHAPES, rank_shape  # noqa: E402


def test_a_tp_rank_holds_column_shards_of_n_and_row_shards_of_k():
    got = {name.split()[-1]: rank_shape(name, *SHAPES[name], 2) for name in SHAPES if name.startswith("llama-3.1-8b")}
    assert got == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
                   "lm_head": (64128, 4096)}
    assert rank_shape("llama-3.1-8b down", 4096, 14336, 1) == (4096, 14336)
