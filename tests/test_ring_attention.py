"""Ring attention (SP prefill) and sharded-KV decode attention against full single-process SDPA."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from parallel.ring_attention import (
    TokenShard,
    attention_with_lse,
    blockwise_attention_with_lse,
    decode_attention_partial,
    merge_into,
    ring_attention,
    sharded_decode_attention,
    zigzag_chunks,
    zigzag_positions,
)
import parallel.ring_attention as ring_mod
from parallel.state import Group, sp_group
from tests.multiprocess import run_ranks
from workers.kv_layout import block_owner

D = 16
SCALE = D**-0.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """q [Tq, Hq, D] at positions q_pos over keys k/v [L, Hkv, D] at positions 0..L-1, causal."""
    mask = q_pos[:, None] >= torch.arange(k.shape[0])[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=SCALE, enable_gqa=True)
    return out.transpose(0, 1)


def make_seqs(lens: list[int], hq: int, hkv: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, D, generator=g) for h in (hq, hkv, hkv)) for n in lens]


# ---- single process ----
def test_zigzag_covers_every_position_once():
    for sp in (1, 2, 3, 4):
        for n in (0, 1, 2 * sp - 1, 2 * sp, 37, 64):
            chunks = zigzag_chunks(n, sp)
            assert len(chunks) == 2 * sp and max(map(len, chunks)) - min(map(len, chunks)) <= 1
            held = [p for r in range(sp) for p in zigzag_positions(n, sp, r)]
            assert sorted(held) == list(range(n))
            assert all(zigzag_positions(n, sp, r) == sorted(zigzag_positions(n, sp, r)) for r in range(sp))


def test_attention_with_lse_and_merge_match_sdpa():
    q, k, v = make_seqs([12], hq=4, hkv=2, seed=0)[0]
    pos = torch.arange(12)
    mask = pos[:, None] >= pos[None, :]
    out, lse = attention_with_lse(q, k, v, SCALE, mask)
    torch.testing.assert_close(out, reference(q, k, v, pos), rtol=1e-5, atol=1e-5)
    # The same attention as two partials over disjoint key sets, merged by LSE (the first is empty for row 0).
    acc_out, acc_lse = torch.zeros_like(out), torch.full(lse.shape, float("-inf"))
    for keys in (torch.arange(5, 12), torch.arange(0, 5)):
        o, l = attention_with_lse(q, k[keys], v[keys], SCALE, mask[:, keys])
        merge_into(acc_out, acc_lse, o, l)
    torch.testing.assert_close(acc_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse, lse, rtol=1e-5, atol=1e-5)


def _rank_positions(n: int, sp: int, rank: int, block: int) -> list[int]:
    """The positions of [0, n) in the blocks rank `rank` owns under the block-owned KV layout."""
    return [p for p in range(n) if block_owner(p // block, sp) == rank]


def _dense(q, k, v, q_pos, k_pos):
    """The whole [Tq, Tk] score matrix, masked by position (None: no mask): the reference."""
    mask = None if q_pos is None else torch.tensor(q_pos)[:, None] >= torch.tensor(k_pos)[None, :]
    return attention_with_lse(q, k, v, SCALE, mask)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (5, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("tiles", [(3, 5), (4, 4), (128, 512), (1, 1)])
def test_blockwise_matches_dense_for_interleaved_causal_layouts(hq: int, hkv: int, tiles: tuple[int, int]):
    """Queries of one rank against the keys of every rank (block-owned layout, 3-token blocks, SP=3):
    uneven chunk lengths, tiles that do not divide them, queries that precede every key (lse -inf)."""
    n, sp, blk = 47, 3, 3
    q_all, k_all, v_all = make_seqs([n], hq, hkv, seed=hq + hkv)[0]
    for qr in range(sp):
        q_pos = _rank_positions(n, sp, qr, blk)
        for kr in range(sp):
            k_pos = _rank_positions(n, sp, kr, blk)
            args = (q_all[q_pos], k_all[k_pos], v_all[k_pos])
            out, lse = blockwise_attention_with_lse(*args, SCALE, q_pos, k_pos, tiles)
            ref_out, ref_lse = _dense(*args, q_pos, k_pos)
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
            assert out.dtype == lse.dtype == torch.float32


@pytest.mark.parametrize("tiles", [(2, 3), (7, 16)])
def test_blockwise_non_causal_and_empty_sides(tiles: tuple[int, int]):
    q, k, v = make_seqs([13], hq=8, hkv=2, seed=4)[0]
    out, lse = blockwise_attention_with_lse(q, k[:11], v[:11], SCALE, tiles=tiles)
    ref_out, ref_lse = _dense(q, k[:11], v[:11], None, None)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # No keys at all: nothing to attend to, merges as nothing.
    out, lse = blockwise_attention_with_lse(q, k[:0], v[:0], SCALE, list(range(13)), [], tiles)
    assert (out == 0).all() and torch.isneginf(lse).all()
    # No queries.
    out, lse = blockwise_attention_with_lse(q[:0], k, v, SCALE, tiles=tiles)
    assert out.shape == (0, 8, D) and lse.shape == (0, 8)
    # Every key in the future of every query: all skipped, no nan.
    out, lse = blockwise_attention_with_lse(q[:4], k[:4], v[:4], SCALE, [0, 1, 2, 3], [10, 11, 12, 13], tiles)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_blockwise_partials_merge_exactly_in_any_order():
    """The ring's merge: one query set over keys split into uneven parts, merged in a shuffled order,
    equals attention over all the keys at once (out and lse)."""
    n = 40
    q, k, v = make_seqs([n], hq=4, hkv=2, seed=5)[0]
    pos = list(range(n))
    ref_out, ref_lse = _dense(q, k, v, pos, pos)
    parts = [pos[i:j] for i, j in [(0, 3), (3, 17), (17, 18), (18, 40)]]
    random.Random(0).shuffle(parts)
    acc_out, acc_lse = torch.zeros_like(ref_out), torch.full(ref_lse.shape, float("-inf"))
    for part in parts:
        o, l = blockwise_attention_with_lse(q, k[part], v[part], SCALE, pos, part, (5, 6))
        merge_into(acc_out, acc_lse, o, l)
    torch.testing.assert_close(acc_out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_blockwise_scores_never_exceed_one_tile(monkeypatch):
    """O(chunk) memory: however long the chunk, the only score tensor is one tile, and tiles wholly in
    the queries' future are never computed (about half of a causal square)."""
    shapes = []
    real = ring_mod._tile_scores

    def spy(qt, kt, scale):
        out = real(qt, kt, scale)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(ring_mod, "_tile_scores", spy)
    n, tiles, hq, hkv = 1000, (64, 128), 4, 2
    q, k, v = make_seqs([n], hq, hkv, seed=6)[0]
    pos = list(range(n))
    out, _ = blockwise_attention_with_lse(q, k, v, SCALE, pos, pos, tiles)
    torch.testing.assert_close(out, reference(q, k, v, torch.arange(n)), rtol=1e-5, atol=1e-5)
    assert max(s[1] for s in shapes) <= (hq // hkv) * tiles[0] and max(s[2] for s in shapes) <= tiles[1]
    computed = sum(s[1] * s[2] for s in shapes) // (hq // hkv)
    assert computed < 0.6 * n * n  # causal: the upper triangle's tiles are skipped


def test_ring_attention_one_rank_is_plain_causal_attention():
    lens = [1, 7, 20]
    seqs = make_seqs(lens, hq=4, hkv=1, seed=1)
    shard = TokenShard([list(range(n)) for n in lens])
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    out = ring_attention(q, k, v, shard, [shard], SCALE, Group())
    ref = torch.cat([reference(qi, ki, vi, torch.arange(len(qi))) for qi, ki, vi in seqs])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- multi-process ----
LENS = [1, 3, 4, 5, 17, 64, 37]  # shorter than 2 * sp, not divisible by 2 * sp, divisible


def _check_ring(rank: int, hq: int, hkv: int, dtype: torch.dtype, tiles: tuple[int, int] | None = None) -> None:
    group = sp_group()
    sp = group.size
    seqs = make_seqs(LENS, hq, hkv, seed=hq * 10 + hkv)
    shards = [TokenShard([zigzag_positions(n, sp, r) for n in LENS]) for r in range(sp)]
    mine = shards[rank]
    local = [[t[pos] for t in s] for s, pos in zip(seqs, mine.positions)]
    q, k, v = (torch.cat([x[i] for x in local]).to(dtype) for i in range(3))
    out = ring_attention(q, k, v, mine, shards, SCALE, group, tiles)
    ref = torch.cat([reference(sq[pos], sk, sv, torch.tensor(pos, dtype=torch.long))
                     for (sq, sk, sv), pos in zip(seqs, mine.positions)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def _check_ring_queries_after_cached_prefix(rank: int) -> None:
    """Keys cover whole sequences, queries only their tails (a chunked prefill over a cached prefix)."""
    group = sp_group()
    sp = group.size
    seqs = make_seqs(LENS, 4, 2, seed=7)
    shards = [TokenShard([zigzag_positions(n, sp, r) for n in LENS]) for r in range(sp)]
    starts = [n // 2 for n in LENS]
    q_shard = TokenShard([[p for p in pos if p >= s] for pos, s in zip(shards[rank].positions, starts)])
    q = torch.cat([sq[pos] for (sq, _, _), pos in zip(seqs, q_shard.positions)])
    k = torch.cat([sk[pos] for (_, sk, _), pos in zip(seqs, shards[rank].positions)])
    v = torch.cat([sv[pos] for (_, _, sv), pos in zip(seqs, shards[rank].positions)])
    out = ring_attention(q, k, v, q_shard, shards, SCALE, group)
    ref = torch.cat([reference(sq[pos], sk, sv, torch.tensor(pos, dtype=torch.long))
                     for (sq, sk, sv), pos in zip(seqs, q_shard.positions)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _check_sharded_decode(rank: int) -> None:
    """KV spread block-wise over the ranks (some hold none of a short sequence); one query per sequence."""
    group = sp_group()
    sp, block = group.size, 4
    lens = [1, 5, 9, 33]
    seqs = make_seqs(lens, 8, 2, seed=3)
    q = torch.stack([sq[-1] for sq, _, _ in seqs])  # [B, Hq, D]: the last token queries everything
    mine = [[p for p in range(n) if (p // block) % sp == rank] for n in lens]
    width = max(1, max(map(len, mine)))
    keys = torch.zeros(len(lens), 2, width, D)
    values = torch.zeros_like(keys)
    for b, ((_, sk, sv), pos) in enumerate(zip(seqs, mine)):
        keys[b, :, : len(pos)] = sk[pos].transpose(0, 1)
        values[b, :, : len(pos)] = sv[pos].transpose(0, 1)
    kv_lens = torch.tensor([len(p) for p in mine])
    out = sharded_decode_attention(q, keys, values, kv_lens, SCALE, group)
    ref = torch.stack([reference(sq[-1:], sk, sv, torch.tensor([n - 1]))[0] for (sq, sk, sv), n in zip(seqs, lens)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # A rank's partial over no keys is empty (lse -inf) and merges as nothing.
    _, lse = decode_attention_partial(q, keys, values, kv_lens, SCALE)
    assert torch.isneginf(lse[kv_lens == 0]).all()


def _all_checks(rank: int) -> None:
    _check_ring(rank, hq=4, hkv=4, dtype=torch.float32)
    _check_ring(rank, hq=4, hkv=2, dtype=torch.float32)  # GQA
    _check_ring(rank, hq=4, hkv=2, dtype=torch.float32, tiles=(3, 5))  # several tiles per chunk pair
    _check_ring(rank, hq=6, hkv=1, dtype=torch.bfloat16)  # MQA, low precision
    _check_ring_queries_after_cached_prefix(rank)
    _check_sharded_decode(rank)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_ring_and_sharded_decode_match_full_attention(sp: int):
    run_ranks(_all_checks, sp)


@pytest.mark.parametrize("sp", [2, 4])
def test_block_owned_layout_balances_causal_work_per_rank_and_ring_step(sp: int, monkeypatch):
    """Causal load balance from the existing KV layout: blocks are owned zig-zag with period 2 * sp
    (rank r holds blocks r and 2sp-1-r of every period: two mirrored chunks per period), so at every
    ring step each rank's queries against the keys in hand cost the same. Counted as the score
    elements the tiles actually compute (masked straddling tiles included), for a prompt that is not
    a multiple of the period; a contiguous split, for contrast, is ~(2 * sp - 1)x imbalanced."""
    n, blk, tiles = 2051, 8, (32, 64)
    computed = [0]
    real = ring_mod._tile_scores

    def spy(qt, kt, scale):
        computed[0] += qt.shape[0] * qt.shape[1] * kt.shape[1]
        return real(qt, kt, scale)

    monkeypatch.setattr(ring_mod, "_tile_scores", spy)
    q_all, k_all, v_all = make_seqs([n], hq=2, hkv=1, seed=8)[0]

    def work(q_pos: list[int], k_pos: list[int]) -> int:
        computed[0] = 0
        blockwise_attention_with_lse(q_all[q_pos], k_all[k_pos], v_all[k_pos], SCALE, q_pos, k_pos, tiles)
        return computed[0]

    def rank_step_work(layout: list[list[int]]) -> list[list[int]]:
        """[ring step i][rank r]: at step i rank r holds the keys of rank r - i."""
        return [[work(layout[r], layout[(r - i) % sp]) for r in range(sp)] for i in range(sp)]

    w = rank_step_work([_rank_positions(n, sp, r, blk) for r in range(sp)])
    totals = [sum(step[r] for step in w) for r in range(sp)]
    assert max(totals) / min(totals) < 1.05, totals
    assert all(max(step) / min(step) < 1.1 for step in w), w
    c = rank_step_work([list(range(r * n // sp, (r + 1) * n // sp)) for r in range(sp)])
    contiguous = [sum(step[r] for step in c) for r in range(sp)]
    assert max(contiguous) / min(contiguous) > 2.5, contiguous


@pytest.mark.parametrize("lens,sp", [((16384,), 4), ((30, 40, 3), 3), ((1000, 77), 4), ((5,), 3)])
def test_fused_layout_puts_every_other_rank_key_in_position_order(lens, sp):
    """RingConfig.fuse: the other ranks' keys as one position-ordered shard, and each block's scatter into it by
    runs of R rows (R = the layout's 16-token block for a whole prompt) lands every row where its position is."""
    from workers.sp_plan import owned_positions

    shards = [TokenShard([owned_positions(0, n, r, sp, 16) for n in lens]) for r in range(sp)]
    others = shards[1:]
    fused, runs = ring_mod._fused_layout(shards[0], others, torch.device("cpu"))
    assert fused.positions == [sorted(p for s in others for p in s.positions[b]) for b in range(len(lens))]
    if lens == (16384,):
        assert min(run for run, _ in runs) == 16
    landed = torch.full((fused.num_tokens,), -1)
    for shard, (run, index) in zip(others, runs):
        src = torch.tensor([p for pos in shard.positions for p in pos], dtype=torch.long)
        assert index.numel() * run == src.numel()
        for i, d in enumerate(index.tolist()):
            assert (landed[d * run:(d + 1) * run] == -1).all()  # no row written twice
            landed[d * run:(d + 1) * run] = src[i * run:(i + 1) * run]
    assert landed.tolist() == [p for pos in fused.positions for p in pos]
    assert ring_mod._fused_layout(shards[0], others, torch.device("cpu")) is ring_mod._fused_layout(
        shards[0], others, torch.device("cpu"))  # cached: every layer reuses it
