"""Attention when a sequence's tokens and KV are spread over the sequence-parallel (SP) ranks.

Each SP rank runs the model on the new tokens whose KV blocks it owns (`engine/block_manager.py`,
`block_owner`) and keeps their K/V in its own cache. Attention then needs keys held by other ranks:

* sequences with several new tokens (prefill chunks) use ring attention: each rank's keys of those
  sequences (cached context + new tokens) travel around the SP ring, causally masked by position; or,
  in Ulysses mode (`sequence_parallel_attention`), an all-to-all hands each rank every token for a
  slice of the heads, attended in one pass (parallel/ulysses.py);
* sequences with one new token (decode) gather their queries on every rank, each rank attends over the
  keys it holds, and the partial results are merged by log-sum-exp.

All layout decisions are made on the host from the step's schedule (`workers/sp_plan.py`), the same
on every rank, so ranks agree on every message size without a handshake.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import gather_first_dim
from parallel.ring_attention import TokenShard, decode_attention_partial, merge_attention_partials, ring_attention
from parallel.state import Group
from parallel.ulysses import UlyssesLayout, ulysses_attention
from workers.attention.backend import AttentionMetadata
from workers.attention.torch_backend import write_kv


@dataclass
class SPRingPart:
    """Sequences of this step with more than one new token."""

    q_rows: torch.Tensor  # [Tq] int64: this rank's rows (of the step's local tokens) that are their queries
    q_shard: TokenShard  # positions of those queries, per sequence
    kv_shards: list[TokenShard]  # per SP rank: the positions (< context length) whose KV it holds
    kv_slots: torch.Tensor  # [Tk] int64: local cache slots of this rank's keys, in kv_shards[rank] order
    ulysses: UlyssesLayout | None = None  # set: attend by Ulysses all-to-all (parallel/ulysses.py), not the ring


@dataclass
class SPDecodePart:
    """Sequences of this step with one new token (its query is on the rank owning its position)."""

    q_rows: torch.Tensor  # [c] int64: this rank's rows that are decode queries
    mine: torch.Tensor  # [c] int64: their indices among all the step's decode sequences
    width: int  # most decode queries any rank holds (the all-gather pads to it)
    gather_index: torch.Tensor  # [B_dec] int64: row of each decode query in the gathered [n * width] rows
    kv_slots: torch.Tensor  # [B_dec, L] int64: local cache slots of this rank's keys per sequence, 0-padded
    kv_lens: torch.Tensor  # [B_dec] int64: valid entries of each kv_slots row (0: holds none of it)


@dataclass
class SPAttentionMetadata:
    group: Group
    ring: SPRingPart | None  # None: no prefill chunk this step
    decode: SPDecodePart | None  # None: no decode this step


class SequenceParallelAttention:
    name = "sequence_parallel"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]: this rank's new tokens; kv_cache [2, num_blocks, block_size, Hkv, D]."""
        sp: SPAttentionMetadata = meta.sp
        write_kv(kv_cache, k, v, meta.slot_mapping)
        hkv, d = kv_cache.shape[-2:]
        keys, values = kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d)  # [slots, Hkv, D]
        out = torch.empty_like(q) if out is None else out
        if sp.ring is not None:
            r = sp.ring
            if r.ulysses is not None:
                out[r.q_rows] = ulysses_attention(q[r.q_rows], keys[r.kv_slots], values[r.kv_slots], r.ulysses,
                                                  scale, sp.group)
            else:
                out[r.q_rows] = ring_attention(q[r.q_rows], keys[r.kv_slots], values[r.kv_slots], r.q_shard,
                                               r.kv_shards, scale, sp.group)
        if sp.decode is not None:
            out[sp.decode.q_rows] = self._decode(q, keys, values, sp.decode, scale, sp.group)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, part: SPDecodePart, scale: float,
                group: Group) -> torch.Tensor:
        """This rank's decode queries attended over every rank's keys -> [c, Hq, D]."""
        padded = q.new_zeros((part.width, *q.shape[1:]))
        padded[: part.q_rows.shape[0]] = q[part.q_rows]
        all_q = gather_first_dim(padded, group)[part.gather_index]  # [B_dec, Hq, D]: every rank's decode queries
        k_mine = keys[part.kv_slots].transpose(1, 2)  # [B_dec, Hkv, L, D]
        v_mine = values[part.kv_slots].transpose(1, 2)
        out, lse = decode_attention_partial(all_q, k_mine, v_mine, part.kv_lens, scale)
        out, _ = merge_attention_partials(out, lse, group)  # [B_dec, Hq, D]
        return out[part.mine].to(q.dtype)
