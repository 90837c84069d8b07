"""Ring attention (SP prefill) and sharded-KV decode attention against full single-process SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.ring_attention import (
    TokenShard,
    attention_with_lse,
    decode_attention_partial,
    merge_into,
    ring_attention,
    sharded_decode_attention,
    zigzag_chunks,
    zigzag_positions,
)
from parallel.state import Group, sp_group
from tests.multiprocess import run_ranks

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


def _check_ring(rank: int, hq: int, hkv: int, dtype: torch.dtype) -> None:
    group = sp_group()
    sp = group.size
    seqs = make_seqs(LENS, hq, hkv, seed=hq * 10 + hkv)
    shards = [TokenShard([zigzag_positions(n, sp, r) for n in LENS]) for r in range(sp)]
    mine = shards[rank]
    local = [[t[pos] for t in s] for s, pos in zip(seqs, mine.positions)]
    q, k, v = (torch.cat([x[i] for x in local]).to(dtype) for i in range(3))
    out = ring_attention(q, k, v, mine, shards, SCALE, group)
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
    _check_ring(rank, hq=6, hkv=1, dtype=torch.bfloat16)  # MQA, low precision
    _check_ring_queries_after_cached_prefix(rank)
    _check_sharded_decode(rank)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_ring_and_sharded_decode_match_full_attention(sp: int):
    run_ranks(_all_checks, sp)
