"""Ulysses sequence parallelism (after DeepSpeed-Ulysses): trade the sequence split for a head split
around attention, so each rank runs ordinary causal attention over ALL the tokens for 1/n of the heads.

Before attention each SP rank holds its own tokens (a sequence shard) with every head. One all-to-all
sends head slice j of those tokens to rank j (`sequence_to_head_shards`), so rank j then holds every
rank's tokens for its slice of heads. GQA: query heads and KV heads are sliced alike, and query head h
reads KV head h // g in both the full and the sliced layout, so each slice is self-contained. Rank j
attends its queries over all the keys (positions sorted per sequence: plain causal attention, whose
tiles wholly in the future are skipped), then the reverse all-to-all (`head_to_sequence_shards`) brings
each token's heads home. Per rank and layer that moves 2 * (Hq + Hkv) / n heads' worth of its tokens
(queries, K/V, outputs) at once, where the ring (parallel/ring_attention.py) moves its K/V heads
n - 1 times but overlaps the moves with compute. Memory stays O(tokens): nothing is [T, T].

The keys sent are everything the rank holds of the sequence (cached context and new tokens), so a
prefill chunk after earlier chunks or a prefix-cache hit attends correctly; decode steps keep the
LSE-merged path of workers/attention/sp_backend.py. Both SP modes keep the KV cache in the same
block-owned layout, so they mix freely step by step.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from parallel.comm import all_to_all_rows
from parallel.ring_attention import TokenShard, attention_by_positions, triton_is_default
from parallel.state import Group


def heads_divide(num_q_heads: int, num_kv_heads: int, sp_size: int) -> bool:
    """Whether Ulysses can split these (rank-local) heads over sp_size ranks: both head counts evenly."""
    return num_q_heads % sp_size == 0 and num_kv_heads % sp_size == 0


# `auto` takes the ring: on 2 x H200 (2026-11-26, Llama-3.1-8B shapes, 16K-128K-token prompts) the ring's
# SP=2 prefill beat Ulysses' at every length (0.543-0.574x of SP=1 against 0.556-0.612x): the ring hides its
# K/V transfers behind compute, Ulysses' all-to-alls (~335 MB per layer and rank at 64K) are not hidden.
AUTO_PICKS_ULYSSES = False


def choose_ulysses(mode: str, num_q_heads: int, num_kv_heads: int, sp_size: int) -> bool:
    """`sequence_parallel_attention` resolved for heads per TP rank: True for Ulysses, False for the ring.
    "ulysses" where the heads do not divide is a ValueError that says so; "auto" is the ring (measured
    faster, above), and never Ulysses where the heads do not divide."""
    if sp_size == 1:
        return False
    divides = heads_divide(num_q_heads, num_kv_heads, sp_size)
    if mode == "ulysses" and not divides:
        raise ValueError(f"sequence_parallel_attention='ulysses' needs each tensor-parallel rank's attention heads "
                         f"divisible by sequence_parallel_size={sp_size}; this model has {num_q_heads} query and "
                         f"{num_kv_heads} KV heads per rank. Use 'ring' or 'auto'.")
    return mode == "ulysses" or (mode == "auto" and divides and AUTO_PICKS_ULYSSES)


@dataclass
class UlyssesLayout:
    """Where every rank's tokens land after the all-to-all. All ranks build it alike from the schedule.

    Rows arrive rank-major (rank 0's tokens, then rank 1's, ...); `q_order` / `kv_order` list, per
    sequence in position order, which arrived row holds each token, and the shards give those positions.
    """

    q_counts: list[int]  # queries each rank holds
    kv_counts: list[int]  # keys each rank holds
    q_order: torch.Tensor  # [sum(q_counts)] int64: arrived query rows, sequence by sequence, ascending positions
    kv_order: torch.Tensor  # [sum(kv_counts)] int64: the same for keys
    q_shard: TokenShard  # all the queries' positions per sequence, in q_order
    kv_shard: TokenShard  # all the keys' positions per sequence, in kv_order
    # Every sequence a whole new prompt (queries = keys = positions 0..L-1): the prompts' bounds for the
    # causal prefill kernel, on the device before the step's first kernel. None otherwise.
    prompts: PromptBounds | None = None


@dataclass
class PromptBounds:
    """Whole prompts laid end to end, as `prefill_attention` reads them."""

    query_start: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_len: int

    @staticmethod
    def of(lens: list[int], device: torch.device) -> "PromptBounds":
        return PromptBounds(torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32).to(device),
                            torch.tensor(lens, dtype=torch.int32).to(device), max(lens, default=0))


def _whole_prompts(q_shard: TokenShard, kv_shard: TokenShard) -> bool:
    return all(q == k and (not q or (q[0] == 0 and q[-1] == len(q) - 1))
               for q, k in zip(q_shard.positions, kv_shard.positions))


def _merge_order(shards: list[TokenShard]) -> tuple[np.ndarray, TokenShard]:
    """Rank-major rows of several ranks' shards -> (row order by sequence then position, merged shard)."""
    pos, seq = [], []
    for shard in shards:
        for b, p in enumerate(shard.positions):
            pos.append(np.asarray(p, dtype=np.int64))
            seq.append(np.full(len(p), b, dtype=np.int64))
    pos_all = np.concatenate(pos) if pos else np.zeros(0, dtype=np.int64)
    seq_all = np.concatenate(seq) if seq else np.zeros(0, dtype=np.int64)
    order = np.lexsort((pos_all, seq_all))  # by sequence, then position
    num_seqs = shards[0].num_seqs if shards else 0
    bounds = np.searchsorted(seq_all[order], np.arange(num_seqs + 1))
    sorted_pos = pos_all[order]
    return order, TokenShard([sorted_pos[a:b].tolist() for a, b in zip(bounds, bounds[1:])])


def ulysses_layout(q_shards: list[TokenShard], kv_shards: list[TokenShard], device: torch.device) -> UlyssesLayout:
    """The layout of one step: q_shards[r] / kv_shards[r] are rank r's queries and keys (same sequences,
    same order on every rank, positions ascending within each)."""
    if len(q_shards) != len(kv_shards):
        raise ValueError(f"one query shard and one key shard per rank; got {len(q_shards)} and {len(kv_shards)}")
    q_order, q_shard = _merge_order(q_shards)
    kv_order, kv_shard = _merge_order(kv_shards)
    whole = _whole_prompts(q_shard, kv_shard)
    return UlyssesLayout(
        q_counts=[s.num_tokens for s in q_shards], kv_counts=[s.num_tokens for s in kv_shards],
        q_order=torch.from_numpy(q_order).to(device, non_blocking=True),
        kv_order=torch.from_numpy(kv_order).to(device, non_blocking=True),
        q_shard=q_shard, kv_shard=kv_shard,
        prompts=PromptBounds.of([len(p) for p in q_shard.positions], device) if whole else None,
    )


def sequence_to_head_shards(x: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """x [T_mine, M, H, D] (this rank's tokens, every head; M stacked tensors such as K and V) ->
    [sum(counts), M, H / n, D]: every rank's tokens (rank-major, counts[r] from rank r) for this rank's
    slice of heads."""
    n = group.size
    t, m, h, d = x.shape
    send = x.view(t, m, n, h // n, d).permute(2, 0, 1, 3, 4)  # [n, T_mine, M, H/n, D]: slice j goes to rank j
    return all_to_all_rows(send.reshape(n * t, m, h // n, d), counts, [t] * n, group)


def head_to_sequence_shards(y: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """The reverse: y [sum(counts), M, H / n, D] rank-major -> [T_mine, M, H, D] with T_mine = counts[rank]."""
    n, t = group.size, counts[group.rank]
    _, m, hs, d = y.shape
    back = all_to_all_rows(y, [t] * n, counts, group)  # [n * T_mine, M, H/n, D]: slice j from rank j
    return back.view(n, t, m, hs, d).permute(1, 2, 0, 3, 4).reshape(t, m, n * hs, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: UlyssesLayout, scale: float,
                      group: Group, tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys, by head-sharded all-to-all.

    q [Tq, Hq, D] (this rank's queries, rows as in layout.q_counts[rank]); k, v [Tk, Hkv, D] (this rank's
    keys, cached and new). Hq and Hkv must divide by the group size (`heads_divide`). Returns [Tq, Hq, D].
    The attention itself is the ring's blockwise kernel run once over all the keys (Triton on CUDA,
    PyTorch tiles elsewhere), so it is exact in fp32 accumulation and never makes a [T, T] matrix.
    """
    n = group.size
    if not heads_divide(q.shape[1], k.shape[1], n):
        raise ValueError(f"Ulysses needs query heads ({q.shape[1]}) and KV heads ({k.shape[1]}) divisible by the "
                         f"SP size ({n})")
    q_all = sequence_to_head_shards(q.unsqueeze(1), layout.q_counts, group)[:, 0]  # [Tq_all, Hq/n, D]
    kv_all = sequence_to_head_shards(torch.stack([k, v], dim=1), layout.kv_counts, group)  # [Tk_all, 2, Hkv/n, D]
    q_sorted = q_all.index_select(0, layout.q_order)
    block = kv_all.index_select(0, layout.kv_order).transpose(0, 1).contiguous()  # [2, Tk_all, Hkv/n, D]
    out_sorted = _attend_all(q_sorted, block, layout.q_shard, layout.kv_shard, scale, tiles, prompts=layout.prompts)
    out_all = torch.empty_like(q_all)
    out_all.index_copy_(0, layout.q_order, out_sorted)  # back to arrival (rank-major) order
    return head_to_sequence_shards(out_all.unsqueeze(1), layout.q_counts, group)[:, 0]


def _attend_all(q: torch.Tensor, block: torch.Tensor, q_shard: TokenShard, kv_shard: TokenShard, scale: float,
                tiles: tuple[int, int] | None, backend: str | None = None,
                prompts: PromptBounds | None = None) -> torch.Tensor:
    """Causal attention of q [Tq, h, D] over block [2, Tk, hkv, D] (rows as the shards, positions ascending
    per sequence) in one pass. With Triton (backend None: where it runs): whole new prompts (`prompts`) go
    through the engine's own causal prefill kernel, which needs no positions (on one H200 the ring's
    position-masked step took as long at 16K tokens for half the heads as the prefill kernel for all of
    them); anything else through the ring's blockwise step. Without Triton, the ring's PyTorch tiles."""
    use_triton = triton_is_default(q, block) if backend is None else backend == "triton"
    if use_triton and prompts is not None:
        return _prefill_kernel(q, block, prompts, scale)
    return attention_by_positions(q, block, q_shard, kv_shard, scale, tiles, use_triton)


def _prefill_kernel(q: torch.Tensor, block: torch.Tensor, prompts: PromptBounds, scale: float) -> torch.Tensor:
    """Whole prompts laid end to end through parallel/kernels/paged_attention.py's `prefill_attention`. Its
    paged cache holds the context before the new tokens; here there is none (each prompt's length is its
    query length), so a one-block dummy cache is never read."""
    from parallel.kernels.paged_attention import prefill_attention

    hkv, d = block.shape[2:]
    cache = torch.zeros(2, 1, 16, hkv, d, dtype=block.dtype, device=q.device)
    tables = torch.zeros(prompts.seq_lens.shape[0], 1, dtype=torch.int32, device=q.device)
    return prefill_attention(q.contiguous(), block[0], block[1], cache, tables, prompts.seq_lens, prompts.query_start,
                             prompts.max_len, scale)


def ulysses_rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, sp_size: int, scale: float,
                           backend: str | None = None, tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """Everything Ulysses rank `rank` of SP=sp_size attends in `ulysses_attention`, on one device and without
    the all-to-alls: for one prompt q [T, Hq, D], k/v [T, Hkv, D] at positions 0..T-1, the causal attention
    of its slice of heads over every token -> [T, Hq / sp_size, D] (query heads rank * Hq/n onwards).
    What scripts/bench_sp_rank.py times beside the ring's per-rank work. backend: "triton", "torch" or None."""
    if not heads_divide(q.shape[1], k.shape[1], sp_size) or not 0 <= rank < sp_size:
        raise ValueError(f"need heads ({q.shape[1]} query, {k.shape[1]} KV) divisible by SP size {sp_size} "
                         f"and 0 <= rank < {sp_size}")
    hq, hkv = q.shape[1] // sp_size, k.shape[1] // sp_size
    shard = TokenShard([list(range(q.shape[0]))])
    q_mine = q[:, rank * hq:(rank + 1) * hq].contiguous()
    block = torch.stack([k[:, rank * hkv:(rank + 1) * hkv], v[:, rank * hkv:(rank + 1) * hkv]])
    return _attend_all(q_mine, block, shard, shard, scale, tiles, backend, PromptBounds.of([q.shape[0]], q.device))
