"""Which batch-1 kernel a 4-bit layer gets at load (parallel/quant/tinygemm.py `choose_w4`), the parts decided without
a GPU: the shipped gemv_w4 TABLE has no tile faster than tinygemm, so the default is tinygemm on every Llama-3.1-8B
shape (no measurement, nothing compiled); TANDEM_W4_GEMV=0 never takes gemv_w4, =1 takes the table's tile (or the
default tile) for shapes gemv_w4 fits; shapes it does not fit (inner_k_tiles 4, group 64) never. The graph-timed
decision for a table tile called faster: tests/gpu/test_gemv_w4.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from parallel.kernels import gemv_w4 as w4  # noqa: E402
from parallel.quant import tinygemm as tg  # noqa: E402

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def _weight(n: int, k: int, gs: int = 128, ikt: int = 8) -> tg.Int4PackWeight:
    """Only the fields choose_w4 reads before any measurement (shape, group, inner_k_tiles)."""
    return tg.Int4PackWeight(torch.zeros(1, dtype=torch.int32), torch.zeros(1), gs, ikt, n, k)


def test_default_keeps_tinygemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tg.W4_ENV, raising=False)
    for n, k in SHAPES:
        assert w4.table_config(n, k) is None  # measured slower than tinygemm
        assert tg.choose_w4(_weight(n, k)) is None


def test_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tg.W4_ENV, "1")
    for n, k in SHAPES:
        assert tg.choose_w4(_weight(n, k)) == w4.TABLE[(n, k)][0]
    assert tg.choose_w4(_weight(1024, 2048)) == w4.DEFAULT  # not in the table
    assert tg.choose_w4(_weight(4096, 4096, gs=64)) is None and tg.choose_w4(_weight(4096, 4096, ikt=4)) is None
    monkeypatch.setenv(tg.W4_ENV, "0")
    assert all(tg.choose_w4(_weight(n, k)) is None for n, k in SHAPES)
