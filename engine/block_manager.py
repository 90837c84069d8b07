"""Paged KV cache bookkeeping: blocks, reference counts, block tables and prefix caching.

A block holds `block_size` tokens' K/V in every layer. A full block whose KV is computed gets a
chained hash (its tokens plus the hash of the block before it), so a later request with the same
prefix reuses it. Blocks with no owner but a hash stay cached, in LRU order, until a new
allocation needs them. The device memory itself lives with the model runner; this module only hands
out block ids.

With sequence parallelism (SP) the block ids are split into one pool per SP rank (the layout is in
workers/kv_layout.py): a sequence's i-th block always comes from pool `block_owner(i, num_pools)`,
so the rank holding a position is known from the position alone, and a cached prefix block (whose
chained hash pins its index) is always in the pool the next sequence needs it in: prefix caching
works unchanged.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.sequence import Sequence
from workers.kv_layout import block_owner, block_pool

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: list[int]) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prefix_block_hashes(token_ids: list[int], block_size: int, num_blocks: int | None = None) -> list[BlockHash]:
    """Chained hashes of the first `num_blocks` full blocks of token_ids (all full blocks by default)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    hashes: list[BlockHash] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_pools: int = 1):
        """num_blocks in all; num_pools > 1 splits them into equal per-SP-rank pools (see the module doc)."""
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise the memory budget or lower max_model_len")
        if num_blocks % num_pools:
            raise ValueError(f"{num_blocks} KV blocks do not split into {num_pools} equal per-rank pools")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.num_pools, self.pool_size = num_pools, num_blocks // num_pools
        # One LRU-first free list per pool.
        self.pools: list[OrderedDict[int, None]] = [
            OrderedDict((i, None) for i in range(p * self.pool_size, (p + 1) * self.pool_size)) for p in range(num_pools)
        ]
        self.cached: dict[BlockHash, int] = {}
        self.hit_tokens = 0  # prefix-cache statistics
        self.queried_tokens = 0

    # ---- capacity ----
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def free(self) -> OrderedDict[int, None]:
        """The free block ids, LRU first (per pool, pools in order). Read-only: a copy when there are pools."""
        if self.num_pools == 1:
            return self.pools[0]
        return OrderedDict((i, None) for pool in self.pools for i in pool)

    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self.pools))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _pool_of(self, block_id: int) -> OrderedDict[int, None]:
        return self.pools[block_pool(block_id, self.pool_size)]

    def _new_per_pool(self, first_index: int, end_index: int) -> list[int]:
        """How many blocks each pool must supply for a sequence's blocks [first_index, end_index)."""
        counts = [0] * self.num_pools
        for i in range(first_index, end_index):
            counts[block_owner(i, self.num_pools)] += 1
        return counts

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether one sequence of num_tokens fits in an empty cache."""
        return all(n <= self.pool_size for n in self._new_per_pool(0, self.blocks_needed(num_tokens)))

    # ---- allocation ----
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._pool_of(block_id)[block_id]
        block.ref_count += 1

    def _allocate_fresh(self, pool: int = 0) -> int:
        block_id, _ = self.pools[pool].popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the LRU cached block
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        At least one token is always left to compute, since its logits are needed to sample.
        """
        assert not seq.block_table, "match_prefix on a sequence that already holds blocks"
        if not self.enable_prefix_caching:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for h in prefix_block_hashes(seq.token_ids, self.block_size, max_blocks):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of a prompt `match_prefix` would find cached now (nothing is taken)."""
        if not self.enable_prefix_caching:
            return 0
        hits = 0
        for h in prefix_block_hashes(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size):
            if self.cached.get(h) is None:
                break
            hits += 1
        return hits * self.block_size

    def record_admission(self, seq: Sequence) -> None:
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_cached_tokens

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        end = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        have = len(seq.block_table)
        if end <= have:  # most decode steps: the last block still has room
            return True
        if self.num_pools == 1:
            return end - have <= len(self.pools[0])
        need = self._new_per_pool(have, end)
        return all(n <= len(pool) for n, pool in zip(need, self.pools))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend seq's block table to cover num_new_tokens more tokens (check can_grow first)."""
        if not self.can_grow(seq, num_new_tokens):
            need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
            raise RuntimeError(f"out of KV blocks growing {seq.seq_id}: need {need}, free {self.num_free_blocks}")
        for i in range(len(seq.block_table), self.blocks_needed(seq.num_computed_tokens + num_new_tokens)):
            seq.block_table.append(self._allocate_fresh(block_owner(i, self.num_pools)))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past those covering its first num_tokens tokens (speculative decoding's
        rejected lookahead slots). Only blocks beyond the computed KV go, so none holds a cached hash."""
        keep = max(self.blocks_needed(num_tokens), self.blocks_needed(seq.num_computed_tokens))
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                pool = self._pool_of(block_id)
                pool[block_id] = None
                pool.move_to_end(block_id, last=False)  # no hash: reused before cached blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register hashes for blocks that became full of computed KV (call after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_hashed_blocks
        if num_full <= start:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(start, num_full):
            parent = hash_block(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(parent)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = parent
                self.cached.setdefault(parent, block.block_id)

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks go to the LRU end first, so they are evicted first."""
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def free_blocks(self, block_table: list[int]) -> None:
        """Drop one reference to each block of a table (a sequence's, or one parked by the scheduler)."""
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                pool = self._pool_of(block_id)
                pool[block_id] = None
                if block.block_hash is None:
                    pool.move_to_end(block_id, last=False)  # uncached blocks are reused before cached ones

    # ---- checks ----
    def check_invariants(self) -> None:
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in self._pool_of(b.block_id)), f"block {b.block_id}: ref_count {b.ref_count} vs free list"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h, f"cached hash points at block {block_id} with another hash"
