"""The tiles of the GEMVs that take pushed partials (parallel/kernels/gemv.py `take_tile`): by default qkv's longer
tile and gate/up's `tile_config` one; TANDEM_GEMV_TAKE_TILE gives one tile for both or one per shape ({"qkv": ...,
"gate_up": ...}, either left out keeps `tile_config`'s); bad values fail by name."""
from __future__ import annotations

import json

import pytest

from parallel.kernels.gemv import TAKE_QKV_TILE, TAKE_TILE_ENV, take_tile

QKV = {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 3}
GATE_UP = {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 5}


def test_unset_gives_qkv_its_longer_tile_and_gate_up_the_plain_one(monkeypatch):
    monkeypatch.delenv(TAKE_TILE_ENV, raising=False)
    assert take_tile() == TAKE_QKV_TILE == QKV and take_tile(silu=True) is None


def test_one_tile_serves_both_shapes(monkeypatch):
    monkeypatch.setenv(TAKE_TILE_ENV, json.dumps(QKV))
    assert take_tile() == QKV and take_tile(silu=True) == QKV


def test_a_tile_per_shape(monkeypatch):
    monkeypatch.setenv(TAKE_TILE_ENV, json.dumps({"qkv": QKV, "gate_up": GATE_UP}))
    assert take_tile() == QKV and take_tile(silu=True) == GATE_UP
    monkeypatch.setenv(TAKE_TILE_ENV, json.dumps({"qkv": QKV}))
    assert take_tile() == QKV and take_tile(silu=True) is None


@pytest.mark.parametrize("raw", ['{"BLOCK_N": 8}', "[8, 512]", "qkv", '{"qkv": {"BLOCK_N": 8}}', '{"o": {}}', "{}"])
def test_bad_values_fail_by_name(monkeypatch, raw):
    monkeypatch.setenv(TAKE_TILE_ENV, raw)
    with pytest.raises(ValueError, match=TAKE_TILE_ENV):
        take_tile()
