"""Tensor- and pipeline-parallel building blocks on 2-4 CPU processes (gloo), against one-process math.

Every rank builds the full weights from the same seed, loads its shard through the layers' own
`weight_loader`s, and checks its output against the unsharded computation.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab
from parallel.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.pp import recv_from_prev_stage, send_to_next_stage
from parallel.state import pp_group, tp_group
from tests.multiprocess import run_ranks
from workers.microbatch import split_by_sequence
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ScheduledSeq

pytestmark = pytest.mark.slow


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# ---- linear layers ----
def _check_column_and_row(rank: int) -> None:
    tp = tp_group().size
    x, w, b = _randn(5, 16, seed=0), _randn(24, 16, seed=1), _randn(24, seed=2)
    col = ColumnParallelLinear(16, 24, bias=True)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    n = 24 // tp
    full = F.linear(x, w, b)
    _close(col(x), full[:, rank * n : (rank + 1) * n])
    col.gather_output = True
    _close(col(x), full)

    # Row-parallel: each rank sees its slice of the input; the sum is the full product, bias once.
    w2, b2 = _randn(16, 24, seed=3), _randn(16, seed=4)
    row = RowParallelLinear(24, 16, bias=True)
    row.weight.weight_loader(row.weight, w2)
    row.bias.weight_loader(row.bias, b2)
    h = _randn(5, 24, seed=5)
    _close(row(h[:, rank * n : (rank + 1) * n]), F.linear(h, w2, b2))


def _check_merged(rank: int) -> None:
    tp = tp_group().size
    x, gate, up = _randn(3, 16, seed=10), _randn(32, 16, seed=11), _randn(32, 16, seed=12)
    layer = MergedColumnParallelLinear(16, [32, 32])
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    n = 32 // tp
    expected = torch.cat([F.linear(x, gate)[:, rank * n : (rank + 1) * n], F.linear(x, up)[:, rank * n : (rank + 1) * n]], dim=-1)
    _close(layer(x), expected)


def _check_qkv(rank: int, num_heads: int, num_kv_heads: int) -> None:
    """q heads split evenly; each rank holds the KV heads its q heads use (replicated when tp > kv)."""
    tp, d, hidden = tp_group().size, 4, 16
    x = _randn(3, hidden, seed=20)
    wq, wk, wv = _randn(num_heads * d, hidden, seed=21), _randn(num_kv_heads * d, hidden, seed=22), _randn(num_kv_heads * d, hidden, seed=23)
    bq, bk, bv = _randn(num_heads * d, seed=24), _randn(num_kv_heads * d, seed=25), _randn(num_kv_heads * d, seed=26)
    layer = QKVParallelLinear(hidden, d, num_heads, num_kv_heads, bias=True)
    for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    q, k, v = layer.split(layer(x))
    q_per_rank = num_heads // tp
    kv_per_rank = max(1, num_kv_heads // tp)
    assert layer.num_kv_heads == kv_per_rank
    first_q = rank * q_per_rank
    first_kv = first_q // (num_heads // num_kv_heads)  # the KV head the rank's first q head reads
    heads = lambda y, start, count: y[:, start * d : (start + count) * d]  # noqa: E731
    _close(q, heads(F.linear(x, wq, bq), first_q, q_per_rank))
    _close(k, heads(F.linear(x, wk, bk), first_kv, kv_per_rank))
    _close(v, heads(F.linear(x, wv, bv), first_kv, kv_per_rank))


def _linear_checks(rank: int) -> None:
    _check_column_and_row(rank)
    _check_merged(rank)
    tp = tp_group().size
    for num_kv_heads in (8, 4, 2, 1):  # kv > tp, kv == tp, kv < tp (replicated)
        if num_kv_heads >= tp and num_kv_heads % tp or num_kv_heads < tp and tp % num_kv_heads:
            continue
        _check_qkv(rank, 8, num_kv_heads)


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_layers_match_unsharded(tp: int):
    run_ranks(_linear_checks, tp, parallel={"tensor_parallel_size": tp})


# ---- vocabulary-parallel embedding and LM head ----
def _check_vocab(rank: int, vocab: int) -> None:
    tp, dim = tp_group().size, 8
    assert pad_vocab(vocab, tp) % tp == 0
    w = _randn(vocab, dim, seed=30)
    emb = VocabParallelEmbedding(vocab, dim)
    emb.weight.weight_loader(emb.weight, w)
    ids = torch.arange(vocab).flip(0)
    _close(emb(ids), F.embedding(ids, w))

    head = ParallelLMHead(vocab, dim)
    head.weight.weight_loader(head.weight, w)
    h = _randn(6, dim, seed=31)
    logits = head.compute_logits(h)
    if rank == 0:
        _close(logits, F.linear(h, w))
    else:
        assert logits is None
    _check_greedy(head, h, F.linear(h, w), rank)

    # All real logits negative: an unmasked zero padding column would win the argmax.
    w_pos = w.abs() + 0.1
    head.weight.weight_loader(head.weight, w_pos)
    h_neg = -(h.abs() + 0.1)
    _check_greedy(head, h_neg, F.linear(h_neg, w_pos), rank)

    # Two equal best rows on different ranks: the lower token id wins, as a full argmax picks it.
    w_tie = w * 0.01
    lo, hi = 0, vocab - 1
    w_tie[lo] = w_tie[hi] = w[0] / w[0].norm() * 3
    head.weight.weight_loader(head.weight, w_tie)
    h_tie = w_tie[lo].expand(2, dim).contiguous()
    result = head.greedy_tokens(h_tie)
    if rank == 0:
        assert result[0].tolist() == [lo, lo]
    assert head.greedy_tokens(h_tie, everywhere=True)[0].tolist() == [lo, lo]  # on every rank alike


def _check_greedy(head: ParallelLMHead, h: torch.Tensor, full_logits: torch.Tensor, rank: int) -> None:
    result = head.greedy_tokens(h)
    if rank != 0:
        assert result is None
    else:
        ids, logprobs = result
        assert ids.tolist() == full_logits.argmax(-1).tolist()
        _close(logprobs, torch.log_softmax(full_logits, -1).max(-1).values)
    # All-gathered (a TP-only replica's ranks fill their next step themselves): every rank the same tokens.
    ids, logprobs = head.greedy_tokens(h, everywhere=True)
    assert ids.tolist() == full_logits.argmax(-1).tolist()
    _close(logprobs, torch.log_softmax(full_logits, -1).max(-1).values)
    everyone = [torch.empty_like(ids) for _ in range(tp_group().size)]
    dist.all_gather(everyone, ids, group=tp_group().device_group)
    assert all(torch.equal(e, ids) for e in everyone)


def _vocab_checks(rank: int) -> None:
    tp = tp_group().size
    for vocab in (37, 40, 5) if tp == 4 else (37, 40):  # padded, divisible, a rank of padding only (5 over 4 ranks)
        _check_vocab(rank, vocab)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_lm_head(tp: int):
    run_ranks(_vocab_checks, tp, parallel={"tensor_parallel_size": tp})


# ---- pipeline transfers ----
_MICRO_BATCHES = [(3, torch.float32), (5, torch.bfloat16), (1, torch.float32)]


def _activations(m: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(tokens, 8, seed=100 + m).to(dtype), _randn(tokens, 8, seed=200 + m).to(dtype)


def _check_pp_send_recv(rank: int) -> None:
    """Stage 0 posts every micro-batch before stage 1 takes any (asynchronous sends must not block)."""
    pp = pp_group()
    if pp.is_first:
        pending = [send_to_next_stage(list(_activations(m, n, dt)), m, pp) for m, (n, dt) in enumerate(_MICRO_BATCHES)]
        for p in pending:
            p.wait()
    else:
        for m, (n, dt) in enumerate(_MICRO_BATCHES):
            hidden, residual = recv_from_prev_stage(m, pp, torch.device("cpu"))
            exp_h, exp_r = _activations(m, n, dt)
            assert hidden.dtype == dt and hidden.shape == (n, 8)
            torch.testing.assert_close(hidden, exp_h, rtol=0, atol=0)
            torch.testing.assert_close(residual, exp_r, rtol=0, atol=0)


def test_pp_send_recv_hidden_and_residual():
    run_ranks(_check_pp_send_recv, 2, parallel={"pipeline_parallel_size": 2})


def _check_tp_pp_grid(rank: int) -> None:
    """TP=2 x PP=2: stage 0 all-reduces in its TP group, each TP rank sends to its peer in stage 1."""
    tp, pp = tp_group(), pp_group()
    assert tp.ranks == ([0, 1] if rank < 2 else [2, 3]) and pp.ranks == [rank % 2, rank % 2 + 2]
    w, x = _randn(8, 16, seed=40), _randn(4, 16, seed=41)
    row = RowParallelLinear(16, 8)
    row.weight.weight_loader(row.weight, w)
    if pp.is_first:
        y = row(x[:, tp.rank * 8 : (tp.rank + 1) * 8])
        send_to_next_stage([y, y + 1], 0, pp).wait()
    else:
        hidden, residual = recv_from_prev_stage(0, pp, torch.device("cpu"))
        _close(hidden, F.linear(x, w))
        _close(residual, F.linear(x, w) + 1)


def test_tp_pp_grid_groups_and_transfer():
    run_ranks(_check_tp_pp_grid, 4, parallel={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})


# ---- micro-batching (one process) ----
def _seqs(lengths: list[int]) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"s{i}", [0] * n, 0, [], True, SamplingParams(), 0) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("lengths, parts, expected", [
    ([1, 1, 1, 1], 2, [[1, 1], [1, 1]]),  # decodes: even halves
    ([30, 1, 1, 1], 2, [[30], [1, 1, 1]]),  # a long prefill takes a micro-batch alone
    ([1, 1, 1, 30], 2, [[1, 1, 1], [30]]),
    ([5, 5], 4, [[5], [5]]),  # fewer sequences than stages: one each
    ([7], 3, [[7]]),  # one sequence is never split
    ([2, 2, 2, 2, 2, 2], 3, [[2, 2], [2, 2], [2, 2]]),
    ([1, 1, 1, 1, 9], 4, [[1, 1], [1], [1], [9]]),  # as many micro-batches as stages when there are enough sequences
])
def test_micro_batches_are_contiguous_and_balanced(lengths: list[int], parts: int, expected: list[list[int]]):
    seqs = _seqs(lengths)
    got = split_by_sequence(seqs, parts)
    assert [s for part in got for s in part] == seqs  # contiguous, in order, each sequence once
    assert [[s.num_tokens for s in part] for part in got] == expected


def test_one_rank_gather_returns_the_logits_uncopied():
    """On a one-rank group the LM head's logits are returned as they are (a one-part torch.cat copied them: a kernel
    of every batch-1 decode step)."""
    from parallel.comm import gather_last_dim_to_first
    from parallel.state import Group

    x = torch.randn(2, 8)
    assert gather_last_dim_to_first(x, Group(ranks=[0], rank=0)) is x
