"""One SP rank's ring attention on one device (`ring_rank_attention`), PyTorch path on CPU: every rank's
merged output over the ring equals full causal attention over the prompt, for the SP path's block-owned
layout and the zig-zag chunk layout, at SP=2 and 4."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parallel.ring_attention as ring_mod
from parallel.ring_attention import ring_rank_attention, split_for_ranks, zigzag_positions
from workers.sp_plan import owned_positions

D = 16
SCALE = D ** -0.5


def full_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
                                         is_causal=True, scale=SCALE, enable_gqa=True)
    return out.transpose(0, 1)


def _prompt(n: int, hq: int, hkv: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hq, D, generator=g).to(dtype), torch.randn(n, hkv, D, generator=g).to(dtype),
            torch.randn(n, hkv, D, generator=g).to(dtype))


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("layout", ["block-owned", "zigzag"])
@pytest.mark.parametrize("n", [61, 128])  # a prompt that is not a multiple of the layout's period, one that is
def test_every_rank_equals_full_causal_attention(sp: int, layout: str, n: int):
    q, k, v = _prompt(n, hq=8, hkv=2, seed=n + sp)
    if layout == "block-owned":  # what the SP path does: block i of the prompt lives on rank block_owner(i, sp)
        positions = [owned_positions(0, n, r, sp, 4) for r in range(sp)]
    else:
        positions = [zigzag_positions(n, sp, r) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    want = full_causal(q, k, v)
    got = torch.empty_like(want)
    for r in range(sp):
        out = ring_rank_attention(qs[r], blocks, shards, r, SCALE, tiles=(8, 16))
        assert out.dtype == q.dtype and out.shape == (len(positions[r]), 8, D)
        got[positions[r]] = out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_rank_within_bf16_tolerance():
    q, k, v = _prompt(96, hq=4, hkv=1, dtype=torch.bfloat16)
    positions = [owned_positions(0, 96, r, 2, 16) for r in range(2)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    out = ring_rank_attention(qs[1], blocks, shards, 1, SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), full_causal(q, k, v)[positions[1]], rtol=2e-2, atol=2e-2)


def test_cpu_runs_the_torch_tiles(monkeypatch):
    """On CPU the default is the PyTorch path (as before the Triton kernel existed); asking for Triton on CPU
    outside its interpreter is an error, not a silent fallback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = ring_mod._tile_scores
    monkeypatch.setattr(ring_mod, "_tile_scores", lambda *a: calls.append(1) or real(*a))
    q, k, v = _prompt(20, hq=2, hkv=1)
    qs, blocks, shards = split_for_ranks(q, k, v, [owned_positions(0, 20, r, 2, 4) for r in range(2)])
    ring_rank_attention(qs[0], blocks, shards, 0, SCALE)
    assert calls
    with pytest.raises(ValueError):
        ring_rank_attention(qs[0], blocks, shards, 0, SCALE, backend="triton")


def test_bad_layouts_and_arguments():
    q, k, v = _prompt(10, hq=2, hkv=1)
    with pytest.raises(ValueError):
        split_for_ranks(q, k, v, [[0, 1, 2], [2, 3, 4, 5, 6, 7, 8, 9]])  # position 2 twice
    with pytest.raises(ValueError):
        split_for_ranks(q, k, v, [[1, 0], list(range(2, 10))])  # not ascending
    qs, blocks, shards = split_for_ranks(q, k, v, [list(range(5)), list(range(5, 10))])
    with pytest.raises(ValueError):
        ring_rank_attention(qs[0], blocks, shards, 2, SCALE)
    with pytest.raises(ValueError):
        ring_rank_attention(qs[0], blocks, shards, 0, SCALE, backend="cuda")
