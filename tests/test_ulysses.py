"""Ulysses sequence parallelism (parallel/ulysses.py): the layout bookkeeping without processes, and the
all-to-all attention on 2 and 4 gloo ranks against plain causal attention, over the block-owned layout
the engine uses, with ragged batches, GQA and queries after a cached prefix."""
from __future__ import annotations

import pytest
import torch

from parallel.ring_attention import TokenShard
from parallel.state import Group, sp_group
from parallel.ulysses import (
    _merge_order, head_to_sequence_shards, heads_divide, sequence_to_head_shards, ulysses_attention, ulysses_layout,
    ulysses_rank_attention,
)
from tests.multiprocess import run_ranks
from tests.test_ring_attention import SCALE, make_seqs, reference
from workers.sp_plan import owned_positions

BLOCK = 4


def test_heads_divide():
    assert heads_divide(32, 8, 2) and heads_divide(32, 8, 8)
    assert not heads_divide(32, 8, 16)  # KV heads do not divide
    assert not heads_divide(6, 2, 4)


def test_merge_order_sorts_rank_major_rows_by_sequence_and_position():
    shards = [TokenShard([[0, 1, 6], [2]]), TokenShard([[2, 3, 4, 5], [0, 1]])]
    # Rank-major arrival: rows 0-2 (rank 0, seq 0), 3 (rank 0, seq 1), 4-7 (rank 1, seq 0), 8-9 (rank 1, seq 1).
    order, merged = _merge_order(shards)
    assert order.tolist() == [0, 1, 4, 5, 6, 7, 2, 8, 9, 3]
    assert merged.positions == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2]]


def test_layout_counts_and_one_rank_group_is_a_copy():
    q_shards = [TokenShard([[0, 1]]), TokenShard([[2]])]
    kv_shards = [TokenShard([[0, 1, 3]]), TokenShard([[2]])]
    layout = ulysses_layout(q_shards, kv_shards, torch.device("cpu"))
    assert layout.q_counts == [2, 1] and layout.kv_counts == [3, 1]
    assert layout.kv_order.tolist() == [0, 1, 3, 2]
    x = torch.randn(3, 2, 4, 8)
    assert torch.equal(sequence_to_head_shards(x, [3], Group()), x)
    with pytest.raises(ValueError, match="one query shard and one key shard per rank"):
        ulysses_layout(q_shards, kv_shards[:1], torch.device("cpu"))


# ---- multi-process ----
LENS = [1, 3, 4, 5, 17, 64, 37]


def _shards(lens: list[int], starts: list[int], sp: int) -> tuple[list[TokenShard], list[TokenShard]]:
    """Each rank's queries (positions >= start) and keys (all positions), owned block-wise as the engine does."""
    q = [TokenShard([owned_positions(s, n, r, sp, BLOCK) for n, s in zip(lens, starts)]) for r in range(sp)]
    kv = [TokenShard([owned_positions(0, n, r, sp, BLOCK) for n in lens]) for r in range(sp)]
    return q, kv


def _check_ulysses(rank: int, hq: int, hkv: int, dtype: torch.dtype, starts: list[int]) -> None:
    group = sp_group()
    seqs = make_seqs(LENS, hq, hkv, seed=hq * 10 + hkv)
    q_shards, kv_shards = _shards(LENS, starts, group.size)
    layout = ulysses_layout(q_shards, kv_shards, torch.device("cpu"))
    mine_q, mine_kv = q_shards[rank], kv_shards[rank]
    q = torch.cat([sq[pos] for (sq, _, _), pos in zip(seqs, mine_q.positions)]).to(dtype)
    k = torch.cat([sk[pos] for (_, sk, _), pos in zip(seqs, mine_kv.positions)]).to(dtype)
    v = torch.cat([sv[pos] for (_, _, sv), pos in zip(seqs, mine_kv.positions)]).to(dtype)
    out = ulysses_attention(q, k, v, layout, SCALE, group, tiles=(8, 16))
    ref = torch.cat([reference(sq[pos], sk, sv, torch.tensor(pos, dtype=torch.long))
                     for (sq, sk, sv), pos in zip(seqs, mine_q.positions)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def _check_round_trip(rank: int) -> None:
    """head_to_sequence_shards undoes sequence_to_head_shards, for uneven token counts (one rank may hold none)."""
    group = sp_group()
    counts = [3 * r for r in range(group.size)]  # rank 0 holds no tokens
    x = torch.arange(counts[rank] * 2 * 8 * 2, dtype=torch.float32).view(counts[rank], 2, 8, 2) + 1000 * rank
    y = sequence_to_head_shards(x, counts, group)
    assert y.shape == (sum(counts), 2, 8 // group.size, 2)
    assert torch.equal(head_to_sequence_shards(y, counts, group), x)


def _all_checks(rank: int) -> None:
    _check_round_trip(rank)
    prefill = [0] * len(LENS)
    after_prefix = [n // 2 for n in LENS]
    _check_ulysses(rank, hq=4, hkv=4, dtype=torch.float32, starts=prefill)
    _check_ulysses(rank, hq=8, hkv=4, dtype=torch.float32, starts=prefill)  # GQA
    _check_ulysses(rank, hq=8, hkv=4, dtype=torch.float32, starts=after_prefix)  # a chunk after cached context
    _check_ulysses(rank, hq=8, hkv=4, dtype=torch.bfloat16, starts=prefill)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_matches_full_attention(sp: int):
    run_ranks(_all_checks, sp)


def test_rank_work_on_one_device_is_the_heads_slice_of_full_attention():
    seqs = make_seqs([37], 8, 4, seed=5)
    q, k, v = seqs[0]
    ref = reference(q, k, v, torch.arange(37))
    for rank in range(2):
        out = ulysses_rank_attention(q, k, v, rank, 2, SCALE, tiles=(8, 16))
        torch.testing.assert_close(out, ref[:, rank * 4:(rank + 1) * 4], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divisible by SP size 3"):
        ulysses_rank_attention(q, k, v, 0, 3, SCALE)


def test_mode_choice():
    from parallel.ulysses import choose_ulysses

    assert choose_ulysses("ulysses", 32, 8, 2) and not choose_ulysses("ring", 32, 8, 2)
    assert not choose_ulysses("auto", 32, 8, 2)  # the ring: measured faster (docs/benchmarks.md)
    assert not choose_ulysses("ulysses", 32, 8, 1)  # no SP, nothing to choose
    with pytest.raises(ValueError, match="divisible by sequence_parallel_size=16"):
        choose_ulysses("ulysses", 32, 8, 16)
    assert not choose_ulysses("auto", 32, 8, 16)


def test_layout_marks_whole_prompts_for_the_prefill_kernel():
    fresh = ulysses_layout([TokenShard([[0, 1, 4]]), TokenShard([[2, 3]])],
                           [TokenShard([[0, 1, 4]]), TokenShard([[2, 3]])], torch.device("cpu"))
    assert fresh.prompts is not None and fresh.prompts.max_len == 5
    assert fresh.prompts.query_start.tolist() == [0, 5] and fresh.prompts.seq_lens.tolist() == [5]
    after_prefix = ulysses_layout([TokenShard([[4]]), TokenShard([[3]])],
                                  [TokenShard([[0, 1, 4]]), TokenShard([[2, 3]])], torch.device("cpu"))
    assert after_prefix.prompts is None  # queries after cached keys: the ring's position-masked step


INTERPRETED = r'''
import torch
from parallel.ring_attention import TokenShard, attention_with_lse
from parallel.ulysses import PromptBounds, _attend_all, ulysses_rank_attention
torch.manual_seed(0)
D = 16; S = D ** -0.5
for dtype in (torch.float32, torch.float16):
    lens = [37, 5, 70]
    qs = [torch.randn(n, 4, D).to(dtype) for n in lens]
    ks = [torch.randn(n, 2, D).to(dtype) for n in lens]
    vs = [torch.randn(n, 2, D).to(dtype) for n in lens]
    shard = TokenShard([list(range(n)) for n in lens])
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    got = _attend_all(q, torch.stack([k, v]), shard, shard, S, None, backend="triton",
                      prompts=PromptBounds.of(lens, q.device))
    want = torch.cat([attention_with_lse(a, b, c, S, torch.ones(n, n, dtype=torch.bool).tril())[0]
                      for a, b, c, n in zip(qs, ks, vs, lens)])
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    one = ulysses_rank_attention(qs[2], ks[2], vs[2], 1, 2, S, backend="triton")
    torch.testing.assert_close(one.float(), want[42:, 2:], rtol=tol, atol=tol)
print("ok")
'''


@pytest.mark.interpreted(INTERPRETED, timeout=600)
def test_whole_prompts_through_the_prefill_kernel_in_the_triton_interpreter():
    """Ulysses' fresh prompts run the engine's causal prefill kernel (on CPU through Triton's interpreter,
    in a process of its own: TRITON_INTERPRET must be set before the kernels are defined; tests/interpreter.py)."""
    from tests.interpreter import run_interpreted

    out = run_interpreted(INTERPRETED)
    assert out.strip().endswith("ok"), out[-500:]
