"""Where a KV block lives when sequence parallelism splits the cache into one pool per SP rank.

Pool p holds block ids [p * N, (p + 1) * N) at local index id - p * N in SP rank p's KV cache. A
sequence's i-th block always comes from pool `block_owner(i, num_pools)`, so the rank holding a
position is known from the position alone. The engine's block manager hands out ids by this layout;
the per-rank side (SP attention, KV transfer) reads it back.
"""
from __future__ import annotations


def block_owner(block_index: int, num_pools: int) -> int:
    """The pool (SP rank) of a sequence's block_index-th block: zig-zag over blocks with period 2 * n
    (0, 1, .., n-1, n-1, .., 0, 0, 1, ..), so every rank holds early and late blocks of the causal triangle."""
    j = block_index % (2 * num_pools)
    return j if j < num_pools else 2 * num_pools - 1 - j


def block_pool(block_id: int, pool_size: int) -> int:
    """The pool (SP rank) a block id belongs to, with pool_size ids per pool."""
    return block_id // pool_size


def pool_ids(pool: int, pool_size: int) -> range:
    """The block ids pool (SP rank) `pool` holds; id b of it lives at b - range.start in that rank's cache."""
    return range(pool * pool_size, (pool + 1) * pool_size)


def local_block_id(block_id: int, pool_size: int) -> int:
    """Where a block id lives in its pool's KV cache (pool p holds ids [p * N, (p + 1) * N) at 0..N-1)."""
    return block_id % pool_size
