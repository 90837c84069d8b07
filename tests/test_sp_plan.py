"""Sequence-parallel bookkeeping without processes: per-rank block pools and each rank's share of a step."""
from __future__ import annotations

import pytest
import torch

from parallel.state import Group
from engine.block_manager import BlockManager
from workers.kv_layout import block_owner
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ScheduledSeq
from engine.sequence import Sequence
from workers.sp_plan import owned_positions, plan_sp_step, sample_owner

BS = 4


def test_block_owner_zigzags_over_the_ranks():
    assert [block_owner(i, 2) for i in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]
    assert [block_owner(i, 3) for i in range(7)] == [0, 1, 2, 2, 1, 0, 0]
    assert all(block_owner(i, 1) == 0 for i in range(5))


def test_pools_hand_out_each_block_index_from_its_owner():
    bm = BlockManager(num_blocks=12, block_size=BS, num_pools=2)  # pools [0, 6) and [6, 12)
    seq = Sequence("a", list(range(30)), SamplingParams())
    bm.grow(seq, 30)  # 8 blocks: owners 0 1 1 0 0 1 1 0
    assert [b // 6 for b in seq.block_table] == [block_owner(i, 2) for i in range(8)]
    assert bm.num_free_blocks == 4
    bm.check_invariants()
    # Pool 0 has 2 blocks left and pool 1 has 2: a 5-block sequence needs 3 from pool 0.
    other = Sequence("b", list(range(100, 118)), SamplingParams())
    assert not bm.can_grow(other, 18)
    assert bm.can_grow(other, 16)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(other, 18)
    bm.free_seq(seq)
    assert bm.num_free_blocks == 12
    bm.check_invariants()


def test_prefix_cache_hits_stay_in_the_owners_pool():
    bm = BlockManager(num_blocks=16, block_size=BS, num_pools=2)
    tokens = list(range(50, 70))
    first = Sequence("a", tokens, SamplingParams())
    bm.grow(first, 20)
    first.num_computed_tokens = 20
    bm.cache_full_blocks(first)
    second = Sequence("b", tokens + [1, 2], SamplingParams())
    bm.match_prefix(second)
    assert second.block_table == first.block_table[:5]
    bm.grow(second, second.num_uncomputed_tokens)
    assert [b // 8 for b in second.block_table] == [block_owner(i, 2) for i in range(len(second.block_table))]
    bm.check_invariants()


def test_can_ever_hold_counts_per_pool():
    bm = BlockManager(num_blocks=6, block_size=BS, num_pools=2)  # 3 + 3
    assert bm.can_ever_hold(6 * BS)  # owners 0 1 1 0 0 1: 3 each
    assert not bm.can_ever_hold(6 * BS + 1)


def scheduled(seq_id: str, tokens: list[int], start: int, n: int, table: list[int], sample: bool) -> ScheduledSeq:
    return ScheduledSeq(seq_id, tokens[start : start + n], start, table, sample, SamplingParams(), 0)


def test_each_token_is_planned_on_exactly_one_rank_with_a_local_slot():
    n, per_rank = 2, 10
    bm = BlockManager(num_blocks=n * per_rank, block_size=BS, num_pools=n)
    plans, seqs = [], []
    for seq_id, length, start, count in [("prefill", 13, 0, 13), ("chunk", 30, 8, 6), ("decode", 22, 21, 1)]:
        seq = Sequence(seq_id, list(range(1000, 1000 + length)), SamplingParams())
        bm.grow(seq, start + count)
        seqs.append(scheduled(seq_id, seq.token_ids, start, count, list(seq.block_table), sample=seq_id != "chunk"))
    for rank in range(n):
        plans.append(plan_sp_step(seqs, BS, per_rank, Group(ranks=[0, 1], rank=rank), torch.device("cpu")))
    for b, s in enumerate(seqs):
        held = []
        for rank, (token_ids, positions, meta, _) in enumerate(plans):
            start, end = meta.query_start_loc[b].item(), meta.query_start_loc[b + 1].item()
            pos = positions[start:end].tolist()
            assert pos == owned_positions(s.start_pos, s.context_len, rank, n, BS)
            assert token_ids[start:end].tolist() == [s.token_ids[p - s.start_pos] for p in pos]
            for p, slot in zip(pos, meta.slot_mapping[start:end].tolist()):
                assert slot == (s.block_table[p // BS] - rank * per_rank) * BS + p % BS
            held += pos
        assert sorted(held) == list(range(s.start_pos, s.context_len))
    # Prefill chunks go around the ring with all of each rank's keys; the decode query lives on one rank.
    for rank, (_, _, meta, sample_rows) in enumerate(plans):
        ring, decode = meta.sp.ring, meta.sp.decode
        assert [kv.positions[1] for kv in ring.kv_shards] == [owned_positions(0, 14, r, n, BS) for r in range(n)]
        assert ring.kv_slots.shape[0] == ring.kv_shards[rank].num_tokens
        assert decode.kv_lens.tolist() == [len(owned_positions(0, 22, rank, n, BS))]
        owns_decode = block_owner(21 // BS, n) == rank
        assert decode.q_rows.numel() == int(owns_decode) and decode.width == 1
        assert len(sample_rows) == sum(sample_owner(s, BS, n) == rank for s in seqs if s.sample)


def test_ulysses_plan_lays_out_every_ranks_queries_and_keys_alike_on_each_rank():
    n, per_rank = 2, 10
    bm = BlockManager(num_blocks=n * per_rank, block_size=BS, num_pools=n)
    seqs = []
    for seq_id, length, start, count in [("prefill", 13, 0, 13), ("chunk", 30, 8, 6), ("decode", 22, 21, 1)]:
        seq = Sequence(seq_id, list(range(1000, 1000 + length)), SamplingParams())
        bm.grow(seq, start + count)
        seqs.append(scheduled(seq_id, seq.token_ids, start, count, list(seq.block_table), sample=True))
    layouts = []
    for rank in range(n):
        _, _, meta, _ = plan_sp_step(seqs, BS, per_rank, Group(ranks=[0, 1], rank=rank), torch.device("cpu"),
                                     ulysses=True)
        layouts.append(meta.sp.ring.ulysses)
        assert meta.sp.decode is not None  # decode keeps its LSE-merged path
        ring_only = plan_sp_step(seqs, BS, per_rank, Group(ranks=[0, 1], rank=rank), torch.device("cpu"))[2]
        assert ring_only.sp.ring.ulysses is None
    a, b = layouts
    assert a.q_counts == b.q_counts == [len(owned_positions(0, 13, r, n, BS)) + len(owned_positions(8, 14, r, n, BS))
                                        for r in range(n)]
    assert a.q_shard.positions == b.q_shard.positions == [list(range(13)), list(range(8, 14))]
    assert a.kv_shard.positions == [list(range(13)), list(range(14))]
    assert torch.equal(a.q_order, b.q_order) and torch.equal(a.kv_order, b.kv_order)
