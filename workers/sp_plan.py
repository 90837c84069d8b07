"""Sequence parallelism on one rank: which of a step's tokens this SP rank computes, and the layout
its attention needs (`workers/attention/sp_backend.py`).

Ownership is block-granular: a sequence's block i, and so every position in it, belongs to SP rank
`block_owner(i, sp)` (zig-zag over blocks), whose KV cache holds that block in its own pool of block
ids. Each rank runs the whole model on the new tokens it owns; only attention talks across SP ranks.
Every rank plans from the same `SchedulerOutput`, so all ranks agree on every size without messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from parallel.comm import gather_to_first
from parallel.ring_attention import TokenShard
from parallel.state import Group
from parallel.ulysses import ulysses_layout
from workers.attention import AttentionMetadata
from workers.attention.sp_backend import SPAttentionMetadata, SPDecodePart, SPRingPart
from workers.kv_layout import block_owner, local_block_id
from workers.scheduler_output import ScheduledSeq


def owned_positions_array(lo: int, hi: int, rank: int, sp_size: int, block_size: int) -> np.ndarray:
    """The positions in [lo, hi) that SP rank `rank` owns, ascending, as int64 (vectorised: a 128K-token
    prompt's plan is built on every rank before its forward, and the GPUs wait for it)."""
    blocks = np.arange(lo // block_size, -(-hi // block_size), dtype=np.int64)
    j = blocks % (2 * sp_size)
    owner = np.where(j < sp_size, j, 2 * sp_size - 1 - j)  # block_owner, for every block at once
    pos = (blocks[owner == rank][:, None] * block_size + np.arange(block_size, dtype=np.int64)).ravel()
    return pos[(pos >= lo) & (pos < hi)]


def owned_positions(lo: int, hi: int, rank: int, sp_size: int, block_size: int) -> list[int]:
    """The positions in [lo, hi) that SP rank `rank` owns, ascending."""
    return owned_positions_array(lo, hi, rank, sp_size, block_size).tolist()


def sample_owner(seq: ScheduledSeq, block_size: int, sp_size: int) -> int:
    """The SP rank computing the sequence's last token this step (whose hidden state is sampled)."""
    return block_owner((seq.context_len - 1) // block_size, sp_size)


@dataclass
class _StepLists:
    """One SP step's per-token and per-sequence lists on rank `me`, filled sequence by sequence (`add`)
    before they become tensors."""
    me: int
    n: int
    bs: int
    blocks_per_rank: int
    ulysses: bool = False  # prefill attention by all-to-all (parallel/ulysses.py): needs every rank's queries
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots_new: list[int] = field(default_factory=list)  # cache slots of the new tokens this rank computes
    query_start: list[int] = field(default_factory=lambda: [0])
    sample_rows: list[int] = field(default_factory=list)
    ring_rows: list[int] = field(default_factory=list)
    ring_q: list[list[int]] = field(default_factory=list)
    ring_q_all: list[list[list[int]]] = field(init=False)  # per SP rank, its queries' positions (Ulysses only)
    ring_kv: list[list[list[int]]] = field(init=False)
    ring_slots: list[int] = field(default_factory=list)
    dec_rows: list[int] = field(default_factory=list)
    dec_mine: list[int] = field(default_factory=list)
    dec_owner_index: list[tuple[int, int]] = field(default_factory=list)  # (owner rank, index among that rank's decode queries)
    dec_held: list[int] = field(init=False)
    dec_slots: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ring_kv = [[] for _ in range(self.n)]
        self.ring_q_all = [[] for _ in range(self.n)]
        self.dec_held = [0] * self.n

    def slots(self, table: list[int], positions: np.ndarray) -> list[int]:
        """Local cache slots of a sequence's positions on this rank (pool ids -> this rank's cache)."""
        blocks = np.asarray(table, dtype=np.int64)[positions // self.bs]
        return (blocks % self.blocks_per_rank * self.bs + positions % self.bs).tolist()

    def add(self, s: ScheduledSeq) -> None:
        me, n, bs = self.me, self.n, self.bs
        row0 = len(self.token_ids)
        new = owned_positions_array(s.start_pos, s.context_len, me, n, bs)
        self.token_ids.extend(np.asarray(s.token_ids, dtype=np.int64)[new - s.start_pos].tolist())
        self.positions.extend(new.tolist())
        self.slots_new.extend(self.slots(s.block_table, new))
        self.query_start.append(len(self.token_ids))
        rows = range(row0, len(self.token_ids))
        if s.sample and sample_owner(s, bs, n) == me:
            self.sample_rows.append(rows[-1])
        mine_kv = owned_positions_array(0, s.context_len, me, n, bs)
        if s.num_tokens > 1:
            self._add_ring(s, rows, new, mine_kv)
        else:
            self._add_decode(s, rows, mine_kv)

    def _add_ring(self, s: ScheduledSeq, rows: range, new: np.ndarray, mine_kv: np.ndarray) -> None:
        self.ring_rows.extend(rows)
        self.ring_q.append(new.tolist())
        for r in range(self.n):
            self.ring_kv[r].append(mine_kv.tolist() if r == self.me else
                                   owned_positions(0, s.context_len, r, self.n, self.bs))
            if self.ulysses:
                self.ring_q_all[r].append(self.ring_q[-1] if r == self.me else
                                          owned_positions(s.start_pos, s.context_len, r, self.n, self.bs))
        self.ring_slots.extend(self.slots(s.block_table, mine_kv))

    def _add_decode(self, s: ScheduledSeq, rows: range, mine_kv: np.ndarray) -> None:
        owner = block_owner(s.start_pos // self.bs, self.n)
        if owner == self.me:
            self.dec_rows.extend(rows)
            self.dec_mine.append(len(self.dec_owner_index))
        self.dec_owner_index.append((owner, self.dec_held[owner]))
        self.dec_held[owner] += 1
        self.dec_slots.append(self.slots(s.block_table, mine_kv))

    def ring_part(self, t: Callable[..., torch.Tensor], device: torch.device) -> SPRingPart | None:
        if not self.ring_q:
            return None
        kv_shards = [TokenShard(p) for p in self.ring_kv]
        layout = ulysses_layout([TokenShard(p) for p in self.ring_q_all], kv_shards, device) if self.ulysses else None
        return SPRingPart(q_rows=t(self.ring_rows), q_shard=TokenShard(self.ring_q), kv_shards=kv_shards,
                          kv_slots=t(self.ring_slots), ulysses=layout)

    def decode_part(self, t: Callable[..., torch.Tensor]) -> SPDecodePart | None:
        if not self.dec_owner_index:
            return None
        width = max(self.dec_held)
        length = max(1, max(map(len, self.dec_slots)))
        return SPDecodePart(
            q_rows=t(self.dec_rows), mine=t(self.dec_mine), width=width,
            gather_index=t([owner * width + i for owner, i in self.dec_owner_index]),
            kv_slots=t([row + [0] * (length - len(row)) for row in self.dec_slots]),
            kv_lens=t([len(row) for row in self.dec_slots]),
        )


def plan_sp_step(seqs: list[ScheduledSeq], block_size: int, blocks_per_rank: int, group: Group,
                 device: torch.device, ulysses: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """This rank's share of a step: (token_ids [T], positions [T], metadata, rows to sample).

    blocks_per_rank: the size N of each rank's pool (block ids map to this rank's cache by `local_block_id`).
    ulysses: prefill chunks attend by Ulysses all-to-all instead of the ring (decode is the same either way).
    """
    lists = _StepLists(group.rank, group.size, block_size, blocks_per_rank, ulysses)
    for s in seqs:
        lists.add(s)

    def t(x, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    ring = lists.ring_part(t, device)
    decode = lists.decode_part(t)
    query_start = lists.query_start
    query_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    seq_lens = [s.context_len for s in seqs]
    meta = AttentionMetadata(
        slot_mapping=t(lists.slots_new),
        query_start_loc=t(query_start, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=torch.zeros((len(seqs), 0), dtype=torch.int32, device=device),  # the SP backend uses slots instead
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        sp=SPAttentionMetadata(group=group, ring=ring, decode=decode),
    )
    return t(lists.token_ids), t(lists.positions), meta, lists.sample_rows


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
