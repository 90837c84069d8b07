"""BlockManager unit tests: chained block hashes, prefix reuse, LRU eviction, ref counts, invariants."""
import pytest

from engine.block_manager import BlockManager, hash_block, prefix_block_hashes
from workers.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def make_seq(tokens, seq_id="s") -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What the scheduler does for a waiting sequence: reuse the cached prefix, then allocate for the rest."""
    bm.match_prefix(seq)
    n = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
    assert bm.can_grow(seq, n)
    bm.grow(seq, n)
    bm.record_admission(seq)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What the scheduler does after a step: the scheduled tokens' KV is now in the cache."""
    seq.num_computed_tokens += seq.num_uncomputed_tokens if n is None else n
    bm.cache_full_blocks(seq)


def run_and_free(bm: BlockManager, tokens, seq_id="s") -> Sequence:
    seq = make_seq(tokens, seq_id)
    admit(bm, seq)
    compute(bm, seq)
    table = list(seq.block_table)
    bm.free_seq(seq)
    seq.block_table = table  # keep for the caller to inspect
    return seq


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free)


@pytest.fixture
def bm():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    yield manager
    manager.check_invariants()


# ---- hashes ----


def test_block_hash_is_chained():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    h_a = hash_block(None, a)
    assert hash_block(None, a) == h_a  # deterministic
    assert hash_block(h_a, b) != hash_block(None, b)  # same tokens, another prefix
    assert hash_block(hash_block(None, [9, 9, 9, 9]), b) != hash_block(h_a, b)
    assert hash_block(None, [1, 2, 3, 5]) != h_a
    assert prefix_block_hashes(a + b + [9], BS) == [h_a, hash_block(h_a, b)]  # only full blocks
    assert prefix_block_hashes(a + b, BS, num_blocks=1) == [h_a]
    assert prefix_block_hashes([1, 2, 3], BS) == []


def test_hashes_distinguish_token_values_beyond_one_byte():
    assert hash_block(None, [256, 0, 0, 0]) != hash_block(None, [0, 1, 0, 0])
    assert hash_block(None, [70000, 1, 2, 3]) != hash_block(None, [70000 % 65536, 1, 2, 3])


# ---- allocation and prefix reuse ----


def test_grow_allocates_blocks_on_demand(bm):
    seq = make_seq(range(10))
    bm.match_prefix(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    bm.grow(seq, 5)  # chunk of 5 tokens: 2 blocks
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2
    compute(bm, seq, 5)
    bm.grow(seq, 3)  # tokens 5..7 fit in block 1
    assert len(seq.block_table) == 2
    compute(bm, seq, 3)
    bm.grow(seq, 2)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert not bm.can_grow(seq, 100)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(seq, 100)
    bm.free_seq(seq)
    assert bm.num_used_blocks == 0


def test_full_computed_blocks_get_hashes_and_are_reused(bm):
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    first = make_seq(prompt, "a")
    admit(bm, first)
    compute(bm, first, 6)  # only block 0 is full of computed KV
    assert first.block_hashes == prefix_block_hashes(prompt, BS, 1)
    compute(bm, first, 4)
    assert first.block_hashes == prefix_block_hashes(prompt, BS)
    table = list(first.block_table)
    bm.free_seq(first)
    assert bm.num_used_blocks == 0

    second = make_seq(prompt[:8] + [99, 98, 97], "b")  # same first 2 blocks, other tail
    admit(bm, second)
    assert second.block_table[:2] == table[:2]
    assert second.num_cached_tokens == second.num_computed_tokens == 8
    assert bm.hit_tokens == 8 and bm.queried_tokens == 10 + 11
    third = make_seq(prompt[:4] + [1, 2, 3, 4, 5], "c")  # diverges in block 1: only block 0 reused
    admit(bm, third)
    assert third.block_table[0] == table[0] and third.block_table[1] != table[1]
    assert third.num_cached_tokens == 4
    bm.free_seq(second)
    bm.free_seq(third)


def test_partial_block_is_not_cached(bm):
    run_and_free(bm, list(range(6)))
    seq = make_seq(list(range(6)) + [50])
    bm.match_prefix(seq)
    assert seq.num_cached_tokens == 4  # block 1 held only 2 tokens
    bm.free_seq(seq)


@pytest.mark.parametrize("length", [4, 8, 9, 12])
def test_at_least_one_token_is_left_to_compute(bm, length):
    prompt = list(range(100, 100 + length))
    run_and_free(bm, prompt, "a")
    seq = make_seq(prompt, "b")
    bm.match_prefix(seq)
    assert 1 <= seq.num_uncomputed_tokens <= BS
    assert seq.num_cached_tokens == ((length - 1) // BS) * BS
    bm.free_seq(seq)


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(12))
    run_and_free(bm, prompt)
    seq = make_seq(prompt)
    bm.match_prefix(seq)
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert bm.cached == {}
    bm.check_invariants()


# ---- ref counts ----


def test_two_sequences_share_prefix_blocks_with_ref_counts(bm):
    system = list(range(30, 38))  # 2 full blocks
    a = make_seq(system + [1, 2, 3], "a")
    admit(bm, a)
    compute(bm, a)
    b = make_seq(system + [7, 7], "b")
    admit(bm, b)  # a still running: b shares its computed blocks
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    assert bm.num_used_blocks == 3 + 1
    bm.free_seq(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert not any(i in bm.free for i in shared)  # still owned by b: never evictable
    bm.check_invariants()
    # Allocating every other block must not hand out b's blocks.
    c = make_seq(list(range(200, 200 + 4 * bm.num_free_blocks)), "c")
    admit(bm, c)
    assert not set(c.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 0
    bm.free_seq(c)
    bm.free_seq(b)
    assert [bm.blocks[i].ref_count for i in shared] == [0, 0]
    assert bm.num_used_blocks == 0


def test_same_prompt_computed_twice_concurrently_keeps_invariants(bm):
    prompt = list(range(40, 48))
    a, b = make_seq(prompt, "a"), make_seq(prompt, "b")
    admit(bm, a)
    admit(bm, b)  # a's blocks are not computed yet: no hit
    assert b.num_cached_tokens == 0
    compute(bm, a)
    compute(bm, b)
    bm.check_invariants()
    bm.free_seq(a)
    bm.free_seq(b)
    bm.check_invariants()
    c = make_seq(prompt + [1], "c")
    bm.match_prefix(c)
    assert c.num_cached_tokens == 8
    bm.free_seq(c)


# ---- LRU eviction ----


def test_uncached_blocks_are_reused_before_cached_ones(bm):
    cached = run_and_free(bm, list(range(8)), "a")  # 2 cached blocks
    partial = run_and_free(bm, [1, 2, 3], "b")  # 1 uncached block
    assert free_order(bm)[0] == partial.block_table[0]
    seq = make_seq([9] * 3 + [8], "c")
    admit(bm, seq, 4)
    assert not set(seq.block_table) & set(cached.block_table)
    bm.free_seq(seq)


def test_lru_evicts_least_recently_freed_and_tails_first():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = run_and_free(bm, list(range(0, 12)), "a")  # 3 blocks, all full and cached
    b = run_and_free(bm, list(range(50, 62)), "b")
    # a was freed first (least recently used); within a sequence the tail goes before the head.
    expected = list(reversed(a.block_table)) + list(reversed(b.block_table))
    assert free_order(bm) == expected
    assert len(bm.cached) == 6

    # A new sequence needing 2 blocks evicts a's last two blocks: a's head block survives.
    c = make_seq(list(range(100, 108)), "c")
    admit(bm, c)
    assert c.block_table == expected[:2]
    assert bm.blocks[a.block_table[0]].block_hash is not None
    assert len(bm.cached) == 4
    bm.check_invariants()
    # a's first block is still a hit; its second is gone.
    again = make_seq(list(range(0, 12)), "a2")
    bm.match_prefix(again)
    assert again.block_table == [a.block_table[0]] and again.num_cached_tokens == 4
    bm.free_seq(again)
    bm.free_seq(c)
    bm.check_invariants()


def test_reusing_a_cached_block_refreshes_its_lru_position():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = run_and_free(bm, list(range(0, 4)) + [0], "a")  # block 0 cached, block 1 partial
    b = run_and_free(bm, list(range(20, 24)) + [0], "b")
    # Hit a's block again: it becomes the most recently used of the cached blocks.
    hit = make_seq(list(range(0, 4)) + [5, 6], "hit")
    admit(bm, hit)
    assert hit.block_table[0] == a.block_table[0]
    compute(bm, hit)
    bm.free_seq(hit)
    cached_order = [i for i in free_order(bm) if bm.blocks[i].block_hash is not None]
    assert cached_order == [b.block_table[0], a.block_table[0]]


def test_evicted_block_loses_its_hash(bm):
    a = run_and_free(bm, list(range(0, 32)), "a")  # fills all 8 blocks
    assert len(bm.cached) == 8
    big = make_seq(list(range(500, 532)), "big")  # needs all 8 blocks: evicts everything
    admit(bm, big)
    assert sorted(big.block_table) == sorted(a.block_table)
    assert bm.cached == {}
    assert all(bm.blocks[i].block_hash is None for i in big.block_table)
    compute(bm, big)
    assert len(bm.cached) == 8
    bm.free_seq(big)
    probe = make_seq(list(range(0, 8)), "probe")
    bm.match_prefix(probe)
    assert probe.num_cached_tokens == 0
    bm.free_seq(probe)


def test_check_invariants_catches_corruption(bm):
    seq = make_seq(range(6))
    admit(bm, seq)
    bm.blocks[seq.block_table[0]].ref_count = 0  # owned but not on the free list
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm.blocks[seq.block_table[0]].ref_count = 1
    bm.check_invariants()
    bm.free_seq(seq)


def test_rejects_empty_cache():
    with pytest.raises(ValueError, match="no blocks"):
        BlockManager(0, BS)
