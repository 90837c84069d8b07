"""Sequence parallelism on one rank: which of a step's tokens this SP rank computes, and the layout
its attention needs (`workers/attention/sp_backend.py`).

Ownership is block-granular: a sequence's block i, and so every position in it, belongs to SP rank
`block_owner(i, sp)` (zig-zag over blocks), whose KV cache holds that block in its own pool of block
ids. Each rank runs the whole model on the new tokens it owns; only attention talks across SP ranks.
Every rank plans from the same `SchedulerOutput`, so all ranks agree on every size without messages.
"""
from __future__ import annotations

import itertools

import torch

from parallel.comm import gather_to_first
from parallel.ring_attention import TokenShard
from parallel.state import Group
from workers.attention import AttentionMetadata
from workers.attention.sp_backend import SPAttentionMetadata, SPDecodePart, SPRingPart
from workers.kv_layout import block_owner, local_block_id
from workers.scheduler_output import ScheduledSeq


def owned_positions(lo: int, hi: int, rank: int, sp_size: int, block_size: int) -> list[int]:
    """The positions in [lo, hi) that SP rank `rank` owns, ascending."""
    first, end = lo // block_size, -(-hi // block_size)
    return list(itertools.chain.from_iterable(
        range(max(lo, i * block_size), min(hi, (i + 1) * block_size))
        for i in range(first, end) if block_owner(i, sp_size) == rank
    ))


def sample_owner(seq: ScheduledSeq, block_size: int, sp_size: int) -> int:
    """The SP rank computing the sequence's last token this step (whose hidden state is sampled)."""
    return block_owner((seq.context_len - 1) // block_size, sp_size)


def plan_sp_step(seqs: list[ScheduledSeq], block_size: int, blocks_per_rank: int, group: Group,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """This rank's share of a step: (token_ids [T], positions [T], metadata, rows to sample).

    blocks_per_rank: the size N of each rank's pool (block ids map to this rank's cache by `local_block_id`).
    """
    me, n, bs = group.rank, group.size, block_size
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    sample_rows: list[int] = []
    ring_rows: list[int] = []
    ring_q: list[list[int]] = []
    ring_kv: list[list[list[int]]] = [[] for _ in range(n)]
    ring_slots: list[int] = []
    dec_rows: list[int] = []
    dec_mine: list[int] = []
    dec_owner_index: list[tuple[int, int]] = []  # (owner rank, index among that rank's decode queries)
    dec_held = [0] * n
    dec_slots: list[list[int]] = []

    def slot(table: list[int], p: int) -> int:
        return local_block_id(table[p // bs], blocks_per_rank) * bs + p % bs

    for s in seqs:
        row0 = len(token_ids)
        new = owned_positions(s.start_pos, s.context_len, me, n, bs)
        token_ids.extend(s.token_ids[p - s.start_pos] for p in new)
        positions.extend(new)
        slots.extend(slot(s.block_table, p) for p in new)
        query_start.append(len(token_ids))
        rows = range(row0, len(token_ids))
        if s.sample and sample_owner(s, bs, n) == me:
            sample_rows.append(rows[-1])
        mine_kv = owned_positions(0, s.context_len, me, n, bs)
        if s.num_tokens > 1:
            ring_rows.extend(rows)
            ring_q.append(new)
            for r in range(n):
                ring_kv[r].append(mine_kv if r == me else owned_positions(0, s.context_len, r, n, bs))
            ring_slots.extend(slot(s.block_table, p) for p in mine_kv)
        else:
            owner = block_owner(s.start_pos // bs, n)
            if owner == me:
                dec_rows.extend(rows)
                dec_mine.append(len(dec_owner_index))
            dec_owner_index.append((owner, dec_held[owner]))
            dec_held[owner] += 1
            dec_slots.append([slot(s.block_table, p) for p in mine_kv])

    def t(x, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    ring = None
    if ring_q:
        ring = SPRingPart(q_rows=t(ring_rows), q_shard=TokenShard(ring_q), kv_shards=[TokenShard(p) for p in ring_kv],
                          kv_slots=t(ring_slots))
    decode = None
    if dec_owner_index:
        width = max(dec_held)
        length = max(1, max(map(len, dec_slots)))
        decode = SPDecodePart(
            q_rows=t(dec_rows), mine=t(dec_mine), width=width,
            gather_index=t([owner * width + i for owner, i in dec_owner_index]),
            kv_slots=t([row + [0] * (length - len(row)) for row in dec_slots]),
            kv_lens=t([len(row) for row in dec_slots]),
        )
    query_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    seq_lens = [s.context_len for s in seqs]
    meta = AttentionMetadata(
        slot_mapping=t(slots),
        query_start_loc=t(query_start, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=torch.zeros((len(seqs), 0), dtype=torch.int32, device=device),  # the SP backend uses slots instead
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        sp=SPAttentionMetadata(group=group, ring=ring, decode=decode),
    )
    return t(token_ids), t(positions), meta, sample_rows


def gather_sample_hidden(hidden: torch.Tensor, owners: list[int], group: Group) -> torch.Tensor | None:
    """Rows to sample, spread over the SP ranks -> all of them in schedule order on the first SP rank.

    hidden [c, H]: this rank's rows, in schedule order; owners[j]: the rank holding the j-th row to sample.
    Returns [len(owners), H] on the group's first rank and None on the others.
    """
    width = max(1, max(owners.count(r) for r in range(group.size)))
    padded = hidden.new_zeros((width, hidden.shape[1]))
    padded[: hidden.shape[0]] = hidden
    parts = gather_to_first(padded, group)
    if parts is None:
        return None
    taken = [0] * group.size
    rows = []
    for r in owners:
        rows.append(parts[r][taken[r]])
        taken[r] += 1
    return torch.stack(rows) if rows else hidden.new_zeros((0, hidden.shape[1]))
