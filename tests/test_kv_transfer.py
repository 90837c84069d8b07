"""KV transfer plans and data without Ray: `plan_transfers` over prefill layouts with sequence parallelism
(each block sent by a rank of its owning SP rank), and `KVTransferAgent` send/recv between CPU processes
over gloo: the decode blocks end up equal to the prefill KV, block for block, and nothing else is written;
an FP8 cache (`kv_cache_dtype="fp8"`) moves as bytes, half those of a 16-bit cache, bit for bit.
"""
from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from engine.block_manager import BlockManager
from workers.kv_layout import block_owner, local_block_id
from workers.kv_transfer.blocks import gather_blocks, scatter_blocks, wire_dtype
from workers.kv_transfer.plan import Transfer, plan_transfers, replica_shards
from workers.kv_transfer.transport import KVTransferAgent, PairSpec
from workers.sampling_params import SamplingParams
from engine.sequence import Sequence

LAYERS, KV_HEADS = 6, 2  # with a small message_bytes, transfers go out as several chunks of layers


def _coverage(plan: list[Transfer]) -> dict[tuple, list[int]]:
    """(decode rank, layer, head, block index) -> the prefill ranks the plan sends it from."""
    got: dict[tuple, list[int]] = {}
    for t in plan:
        for key in itertools.product([t.dst], t.layers, t.heads, t.blocks):
            got.setdefault(key, []).append(t.src)
    return got


# (prefill tp, pp, sp), (decode tp, pp)
LAYOUTS = [
    ((1, 1, 1), (1, 1)),
    ((2, 1, 1), (1, 1)),
    ((1, 1, 2), (1, 1)),
    ((2, 1, 2), (1, 1)),
    ((2, 1, 2), (2, 1)),
    ((4, 1, 2), (1, 1)),  # tp > KV heads: each head on two ranks of an SP rank
    ((1, 2, 2), (2, 1)),  # pipeline stages cut the decode rank's layers
    ((1, 1, 3), (2, 2)),
]


@pytest.mark.parametrize("blocks", [range(0, 11), range(3, 11), range(5, 6)])
@pytest.mark.parametrize("prefill,decode", LAYOUTS)
def test_every_layer_head_block_comes_once_from_its_owner(prefill, decode, blocks):
    tp, pp, sp = prefill
    src = replica_shards(tp, pp, LAYERS, KV_HEADS, sp)
    dst = replica_shards(decode[0], decode[1], LAYERS, KV_HEADS)
    plan = plan_transfers(src, dst, blocks)
    by_rank = {s.rank: s for s in src}
    wanted = {(d.rank, layer, h, i) for d in dst for layer in d.layers for h in d.heads for i in blocks}
    got = _coverage(plan)
    assert set(got) == wanted
    for (_, layer, h, i), senders in got.items():
        assert len(senders) == 1, f"layer {layer} head {h} block {i} sent {len(senders)} times"
        s = by_rank[senders[0]]
        assert layer in s.layers and h in s.heads and block_owner(i, sp) == s.sp_rank
    # One message per (source, destination, layer range, head range): never one per block.
    assert len(plan) <= len(dst) * len(src)


def test_sp_ranks_send_only_blocks_they_own():
    src = replica_shards(1, 1, LAYERS, KV_HEADS, sp_size=2)
    dst = replica_shards(1, 1, LAYERS, KV_HEADS)
    # Owners of blocks 0..7: 0 1 1 0 0 1 1 0. The decode side holds 3 already (prefix hits).
    assert plan_transfers(src, dst, range(3, 8)) == [
        Transfer(0, 0, range(LAYERS), range(KV_HEADS), (3, 4, 7)),
        Transfer(1, 0, range(LAYERS), range(KV_HEADS), (5, 6)),
    ]
    # Blocks 1 and 2 are both SP rank 1's: rank 0 sends nothing.
    assert plan_transfers(src, dst, range(1, 3)) == [Transfer(1, 0, range(LAYERS), range(KV_HEADS), (1, 2))]


def test_without_sp_every_block_comes_from_one_rank_per_head():
    src, dst = replica_shards(2, 1, LAYERS, KV_HEADS), replica_shards(1, 1, LAYERS, KV_HEADS)
    assert [s.sp_size for s in src] == [1, 1]
    assert plan_transfers(src, dst, range(2, 5)) == [
        Transfer(0, 0, range(LAYERS), range(0, 1), (2, 3, 4)),
        Transfer(1, 0, range(LAYERS), range(1, 2), (2, 3, 4)),
    ]


def test_decode_replicas_cannot_use_sp():
    src = replica_shards(1, 1, LAYERS, KV_HEADS, sp_size=2)
    with pytest.raises(ValueError, match="decode replicas do not use sequence parallelism"):
        plan_transfers(src, src, range(4))


# ---------------------------------------------------------------- the data, between processes (gloo)

BS, HEAD_DIM, PER_RANK, DECODE_BLOCKS = 2, 3, 12, 16
NUM_SEQ_BLOCKS, HITS = 7, 2  # the request's blocks; the decode side holds the first HITS already
SENTINEL = -7.0


def _prefill_table(sp: int) -> list[int]:
    """The request's block table as a prefill replica with `sp` pools hands it out (global ids). Another
    sequence holds a few blocks first, so the ids are not simply 0, 1, ..."""
    bm = BlockManager(PER_RANK * sp, BS, num_pools=sp)
    bm.grow(Sequence("other", [1] * 3 * BS, SamplingParams()), 3 * BS)
    seq = Sequence("req", [1] * NUM_SEQ_BLOCKS * BS, SamplingParams())
    bm.grow(seq, NUM_SEQ_BLOCKS * BS)
    return seq.block_table


def _decode_table() -> list[int]:
    return torch.randperm(DECODE_BLOCKS, generator=torch.Generator().manual_seed(1))[:NUM_SEQ_BLOCKS].tolist()


def _sequence_kv() -> torch.Tensor:
    """The request's KV by sequence block index: [L, 2, NUM_SEQ_BLOCKS, BS, H, D], the same in every process."""
    return torch.randn(LAYERS, 2, NUM_SEQ_BLOCKS, BS, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (compared byte for byte: an FP8 NaN or -0 pattern must survive the trip too)."""
    return t.contiguous().view(torch.uint8)


def _transfer_rank(rank: int, prefill: tuple[int, int], decode_tp: int, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", staged: bool = False, gpus: tuple[str, str] = ("", ""),
                   message_bytes: int | None = None, busy_cycles: int = 0, pair_groups: int = 1) -> None:
    """One rank of a prefill -> decode handoff; every rank checks what it holds afterwards. device "cuda":
    every rank on the same GPU (pools sharing it), which only a `staged` pair can do; `gpus`: the GPU ids
    the prefill and the decode ranks report (equal: they copy by CUDA IPC; different: through host memory).
    message_bytes: the agents' message size (every rank the same), to cut transfers into several messages.
    busy_cycles (CUDA): each rank first queues a kernel that spins this many GPU cycles on its default stream,
    as a running engine step does; the handoff must not wait for it. pair_groups: the pair's process groups (each
    rank the same), which its messages take in turn."""
    import dataclasses

    tp, sp = prefill
    src, dst = replica_shards(tp, 1, LAYERS, KV_HEADS, sp), replica_shards(decode_tp, 1, LAYERS, KV_HEADS)
    src = [dataclasses.replace(s, device=gpus[0]) for s in src]
    dst = [dataclasses.replace(d, device=gpus[1]) for d in dst]
    is_prefill = rank < len(src)
    shard = src[rank] if is_prefill else dst[rank - len(src)]
    full, heads = _sequence_kv().to(dtype), slice(shard.heads.start, shard.heads.stop)
    src_table, dst_table = _prefill_table(sp), _decode_table()
    if is_prefill:
        # This rank's pool: its own blocks hold the KV, every other slot a value no block has.
        cache = torch.full((LAYERS, 2, PER_RANK, BS, len(shard.heads), HEAD_DIM), 99.0).to(dtype)
        for i in range(NUM_SEQ_BLOCKS):
            if block_owner(i, sp) == shard.sp_rank:
                cache[:, :, local_block_id(src_table[i], PER_RANK)] = full[:, :, i, :, heads]
    else:
        cache = torch.full((LAYERS, 2, DECODE_BLOCKS, BS, len(shard.heads), HEAD_DIM), SENTINEL).to(dtype)
    cache = cache.to(device)
    agent = KVTransferAgent(cache, shard, "prefill" if is_prefill else "decode", timeout_s=60.0)
    if message_bytes is not None:
        agent.message_bytes = message_bytes
    agent.pair_groups = pair_groups
    if pair_groups > 1:
        agent.long_bytes = 0  # every transfer long: its messages take the groups in turn (and about target_messages)
    spec = PairSpec("p->d", len(src), len(dst), staged=staged, ipc=staged and gpus[0] == gpus[1] != "")
    address = [agent.open_store(spec.pair_id) if rank == 0 else None]
    dist.broadcast_object_list(address, src=0)
    agent.join(spec, *address[0])
    if pair_groups > 1:  # a gloo pair makes one group (`join`): the others by hand, over the world's ranks (= pair ranks)
        extra = [dist.new_group(list(range(len(src) + len(dst))), backend="gloo") for _ in range(pair_groups - 1)]
        agent._spread[spec.pair_id] = [agent._groups[spec.pair_id], *extra]

    plan = plan_transfers(src, dst, range(HITS, NUM_SEQ_BLOCKS))
    if busy_cycles:
        torch.cuda.synchronize()  # the KV is written (as it is once the prefill's token reached the host)
        torch.cuda._sleep(busy_cycles)  # the engine's stream, busy with a step
    t0 = time.monotonic()
    if is_prefill:
        agent.send(spec, plan, {d.rank: d for d in dst}, src_table, "req")
    else:
        received = agent.recv(spec, plan, {s.rank: s for s in src}, dst_table, src_table).bytes
    if busy_cycles:
        took, busy = time.monotonic() - t0, not torch.cuda.current_stream().query()
        assert took < 1.0 and busy, (f"the handoff took {took:.2f}s, and the engine's stream was "
                                     f"{'still busy' if busy else 'idle'} after it (if idle, the handoff waited for it, "
                                     "or the busy kernel is too short)")
        torch.cuda.synchronize()
    if is_prefill:
        return
    expected = cache.clone()  # the sentinel everywhere, before the transfer
    for i in range(HITS, NUM_SEQ_BLOCKS):
        expected[:, :, dst_table[i]] = full[:, :, i, :, heads]
    assert torch.equal(_bytes(cache), _bytes(expected)), \
        "decode blocks differ from the prefill KV (or blocks outside the request were written)"
    assert received == (NUM_SEQ_BLOCKS - HITS) * LAYERS * 2 * BS * len(shard.heads) * HEAD_DIM * dtype.itemsize
    assert agent.bytes_received == received


@pytest.mark.slow
@pytest.mark.parametrize("prefill,decode_tp", [((1, 2), 1), ((2, 2), 2), ((2, 1), 1)], ids=["sp2->tp1", "tp2xsp2->tp2", "tp2->tp1"])
def test_sp_prefill_blocks_arrive_in_the_decode_blocks(prefill, decode_tp):
    tp, sp = prefill
    run_ranks(_transfer_rank, tp * sp + decode_tp, prefill, decode_tp)


@pytest.mark.slow
@pytest.mark.parametrize("message_bytes", [1, 2 * 5 * BS * HEAD_DIM * 4 * 4], ids=["layer-per-message", "4-layers-then-2"])
def test_transfers_cut_into_several_messages_arrive_whole(message_bytes):
    """A transfer larger than message_bytes goes as several messages of whole layers (one layer each, or
    4 + 2 of the 6 when 4 of this tp2->tp1 plan's one-head layers fit); the blocks arrive all the same."""
    run_ranks(_transfer_rank, 3, (2, 1), 1, torch.float32, "cpu", False, ("", ""), message_bytes)


@pytest.mark.slow
def test_messages_over_two_pair_groups_in_turn_arrive_whole():
    """With pair_groups 2 each transfer's messages (one layer each here) alternate between the pair's two process
    groups, by their place in the transfer on both sides: every block lands where it belongs."""
    run_ranks(_transfer_rank, 3, (2, 1), 1, torch.float32, "cpu", False, ("", ""), 1, 0, 2)


def test_messages_hold_as_many_whole_layers_as_fit():
    shard = replica_shards(1, 1, LAYERS, KV_HEADS)[0]
    agent = KVTransferAgent(torch.zeros(LAYERS, 2, 8, BS, KV_HEADS, HEAD_DIM), shard, "decode")
    plan = plan_transfers([shard], [shard], range(5))  # one transfer: 6 layers x 2 heads x 5 blocks
    per_layer = 2 * 5 * BS * KV_HEADS * HEAD_DIM * 4
    for message_bytes, layers in [(1, [1] * 6), (per_layer, [1] * 6), (4 * per_layer + 1, [4, 2]), (10 * per_layer, [6])]:
        agent.message_bytes = message_bytes
        got = list(agent._messages(plan, {0: shard}, sending=False))
        assert [m[2].stop - m[2].start for m in got] == layers
        assert [m[0] for m in got] == list(range(len(layers)))  # tags: the messages' positions in the plan
    agent.message_bytes = 10 * per_layer
    for min_messages, layers in [(1, [6]), (2, [3, 3]), (4, [2, 2, 2]), (6, [1] * 6), (50, [1] * 6)]:
        agent.min_messages = min_messages  # at most ceil(6 / min_messages) layers a message
        assert [m[2].stop - m[2].start for m in agent._messages(plan, {0: shard}, sending=False)] == layers
    agent.min_messages = 1
    for split_bytes, layers in [(0, [6]), (6 * per_layer + 1, [6]), (6 * per_layer, [3, 3]), (1, [3, 3])]:
        agent.split_bytes = split_bytes  # a transfer of at least split_bytes that fits one message goes as two
        assert [m[2].stop - m[2].start for m in agent._messages(plan, {0: shard}, sending=False)] == layers
    agent.message_bytes = 4 * per_layer + 1  # two messages by their bytes: cut in halves instead
    assert [m[2].stop - m[2].start for m in agent._messages(plan, {0: shard}, sending=False)] == [3, 3]
    agent.message_bytes = 2 * per_layer  # three by their bytes: the split changes nothing
    assert [m[2].stop - m[2].start for m in agent._messages(plan, {0: shard}, sending=False)] == [2, 2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("prefill,decode_tp", [((2, 1), 1), ((1, 2), 1)], ids=["tp2->tp1", "sp2->tp1"])
def test_fp8_cache_blocks_arrive_byte_for_byte(prefill, decode_tp):
    """kv_cache_dtype="fp8" on both sides: the decode rank (both heads, the whole-block scatter) gets the
    prefill ranks' e4m3 bytes unchanged, and counts 1 byte per value."""
    tp, sp = prefill
    run_ranks(_transfer_rank, tp * sp + decode_tp, prefill, decode_tp, torch.float8_e4m3fn)


def test_a_pair_that_shares_a_gpu_is_staged_over_gloo():
    """NCCL refuses two ranks on one device, so pools sharing a GPU (gpus_per_rank < 1) move KV over gloo
    through host memory; the decode replica decides from the ranks' GPU UUIDs."""
    from workers.kv_transfer.plan import RankShard, share_a_gpu

    def shards(*devices: str) -> list[RankShard]:
        return [RankShard(r, range(2), range(2), device=d) for r, d in enumerate(devices)]

    assert share_a_gpu(shards("GPU-a", "GPU-b"), shards("GPU-a"))
    assert not share_a_gpu(shards("GPU-a", "GPU-b"), shards("GPU-c"))
    assert not share_a_gpu(shards("", ""), shards(""))  # CPU ranks: gloo anyway


class _AckGroup:
    """Stands in for a pair group where only the acks travel: records (peer, tag) of each send."""

    def __init__(self):
        self.acks: list[tuple[int, int]] = []

    def send(self, tensors, dst: int, tag: int):
        self.acks.append((dst, tag))
        return type("Done", (), {"wait": lambda self, timeout=None: True})()


@pytest.mark.parametrize("prefill,decode_tp", [((1, 2), 1), ((2, 2), 2)], ids=["sp2->tp1", "tp2xsp2->tp2"])
def test_ranks_on_one_gpu_copy_the_blocks_out_of_the_peer_cache(prefill, decode_tp):
    """The CUDA IPC path's copy on CPU tensors (the mapping itself needs a GPU: tests/gpu): every message's
    layer chunk, heads and blocks come from the right place of each prefill rank's cache, and every
    sender gets one ack per message."""
    tp, sp = prefill
    src, dst = replica_shards(tp, 1, LAYERS, KV_HEADS, sp), replica_shards(decode_tp, 1, LAYERS, KV_HEADS)
    full, src_table, dst_table = _sequence_kv(), _prefill_table(sp), _decode_table()
    plan = plan_transfers(src, dst, range(HITS, NUM_SEQ_BLOCKS))
    for shard in dst:
        heads = slice(shard.heads.start, shard.heads.stop)
        cache = torch.full((LAYERS, 2, DECODE_BLOCKS, BS, len(shard.heads), HEAD_DIM), SENTINEL)
        agent = KVTransferAgent(cache, shard, "decode")
        agent.message_bytes = 1  # one layer per message
        group = agent._groups["p->d"] = _AckGroup()
        agent._same_gpu = lambda spec, peer: True
        for s in src:  # each prefill rank's cache, as _transfer_rank lays it out
            peer = torch.full((LAYERS, 2, PER_RANK, BS, len(s.heads), HEAD_DIM), 99.0)
            for i in range(NUM_SEQ_BLOCKS):
                if block_owner(i, sp) == s.sp_rank:
                    peer[:, :, local_block_id(src_table[i], PER_RANK)] = full[:, :, i, :, s.heads.start:s.heads.stop]
            agent._peer_caches[("p->d", s.rank)] = peer
        spec = PairSpec("p->d", len(src), len(dst), staged=True, ipc=True)
        received = agent.recv(spec, plan, {s.rank: s for s in src}, dst_table, src_table).bytes
        expected = torch.full_like(cache, SENTINEL)
        for i in range(HITS, NUM_SEQ_BLOCKS):
            expected[:, :, dst_table[i]] = full[:, :, i, :, heads]
        assert torch.equal(cache, expected)
        assert received == (NUM_SEQ_BLOCKS - HITS) * LAYERS * 2 * BS * len(shard.heads) * HEAD_DIM * 4
        mine = list(agent._messages(plan, {s.rank: s for s in src}, sending=False))
        assert sorted(group.acks) == sorted((t.src, tag) for tag, t, _, _ in mine)
        assert len(mine) == LAYERS * sum(t.dst == shard.rank for t in plan)  # 6 layers: six messages per transfer


@pytest.mark.slow
def test_a_staged_pair_moves_the_blocks_too():
    run_ranks(_transfer_rank, 3, (1, 2), 1, torch.float32, "cpu", True)


# ---------------------------------------------------------------- gather / scatter of an FP8 cache, one process

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


def _cache(dtype: torch.dtype, seed: int, num_blocks: int = 8) -> torch.Tensor:
    x = torch.randn(LAYERS, 2, num_blocks, BS, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    return x.to(dtype)


@pytest.mark.parametrize("heads", [slice(None), slice(1, 2)], ids=["all-heads", "one-head"])
def test_fp8_gather_scatter_round_trip_is_byte_exact_and_half_of_bf16(heads):
    src, dst = _cache(FP8, 0), _cache(FP8, 1)
    before = dst.clone()
    ids_src, ids_dst, layers = [5, 0, 3], [2, 7, 4], slice(1, 5)
    buf = gather_blocks(src, ids_src, layers, heads)
    assert buf.dtype == wire_dtype(FP8) == torch.uint8
    bf16_buf = gather_blocks(_cache(BF16, 0), ids_src, layers, heads)
    assert 2 * buf.numel() * buf.element_size() == bf16_buf.numel() * bf16_buf.element_size()
    scatter_blocks(dst, ids_dst, layers, heads, buf)
    expected = before.clone()
    for s_id, d_id in zip(ids_src, ids_dst):
        expected[layers, :, d_id, :, heads] = src[layers, :, s_id, :, heads]
    assert torch.equal(_bytes(dst), _bytes(expected))


def test_16_bit_cache_travels_in_its_own_dtype():
    assert wire_dtype(BF16) == BF16 and wire_dtype(torch.float32) == torch.float32
    cache = _cache(BF16, 0)
    assert gather_blocks(cache, [1], slice(None), slice(None)).dtype == BF16


def test_scatter_refuses_a_buffer_of_another_dtype():
    """A bf16 buffer into an FP8 cache (pools with different kv_cache_dtype) is an error, not a silent cast."""
    cache, buf = _cache(FP8, 0), gather_blocks(_cache(BF16, 1), [0], slice(None), slice(None))
    with pytest.raises(ValueError, match="bfloat16.*takes torch.uint8"):
        scatter_blocks(cache, [0], slice(None), slice(None), buf)


@pytest.mark.parametrize("dtype,head_dim", [(BF16, HEAD_DIM), (torch.float32, HEAD_DIM), (FP8, HEAD_DIM), (BF16, 2),
                                            (FP8, 4)], ids=["bf16", "fp32", "fp8", "bf16-4-byte-rows", "fp8-4-byte-rows"])
@pytest.mark.parametrize("heads", [slice(None), slice(1, 2)], ids=["all-heads", "one-head"])
def test_gather_and_scatter_move_each_block_exactly_whatever_the_row_width(dtype, head_dim, heads):
    """The copies go as 8-byte words where a row's bytes allow it and element by element where not (4-byte rows):
    the same buffer and the same cache either way, in the wire dtype and shape."""
    def cache(seed):
        x = torch.randn(LAYERS, 2, 8, BS, KV_HEADS, head_dim, generator=torch.Generator().manual_seed(seed))
        return x.to(dtype)

    src, dst = cache(0), cache(1)
    ids_src, ids_dst, layers = [6, 0, 3, 5], [2, 7, 4, 1], slice(1, 5)
    buf = gather_blocks(src, ids_src, layers, heads)
    wire = wire_dtype(dtype)
    assert buf.dtype == wire and buf.is_contiguous()
    assert torch.equal(_bytes(buf), _bytes(src[layers][:, :, ids_src][..., heads, :].contiguous()))
    expected = dst.clone()
    for s_id, d_id in zip(ids_src, ids_dst):
        expected[layers, :, d_id, :, heads] = src[layers, :, s_id, :, heads]
    scatter_blocks(dst, ids_dst, layers, heads, buf)
    assert torch.equal(_bytes(dst), _bytes(expected))


def test_the_nccl_stream_priority_comes_from_the_environment(monkeypatch):
    """TANDEM_KV_NCCL_HIGH_PRIORITY=1 makes an agent's later NCCL pair groups high-priority (the served ranks get
    the variable from the driver: cluster/ray_runtime.py forwards it); unset, they are not."""
    from cluster.ray_runtime import rank_runtime_env
    from workers.kv_transfer.plan import RankShard
    from workers.kv_transfer.transport import KVTransferAgent

    cache = torch.zeros(1, 2, 4, 2, 1, 4)
    shard = RankShard(0, range(1), range(1))
    monkeypatch.delenv("TANDEM_KV_NCCL_HIGH_PRIORITY", raising=False)
    assert not KVTransferAgent(cache, shard, "prefill").nccl_high_priority
    monkeypatch.setenv("TANDEM_KV_NCCL_HIGH_PRIORITY", "1")
    assert KVTransferAgent(cache, shard, "decode").nccl_high_priority
    assert rank_runtime_env()["env_vars"]["TANDEM_KV_NCCL_HIGH_PRIORITY"] == "1"


def test_the_lanes_and_pair_groups_switches_reach_the_ranks(monkeypatch):
    """TANDEM_KV_LEAN and TANDEM_KV_PAIR_GROUPS are read by the agents in the rank actors, and both sides of a pair
    must agree on the groups: the driver forwards them. Lanes are on unless the switch says 0."""
    from cluster.ray_runtime import rank_runtime_env
    from workers.kv_transfer.plan import RankShard
    from workers.kv_transfer.transport import KVTransferAgent

    cache = torch.zeros(1, 2, 4, 2, 1, 4)
    shard = RankShard(0, range(1), range(1))
    monkeypatch.delenv("TANDEM_KV_LEAN", raising=False)
    assert KVTransferAgent(cache, shard, "prefill").lean
    monkeypatch.setenv("TANDEM_KV_LEAN", "0")
    monkeypatch.setenv("TANDEM_KV_PAIR_GROUPS", "1")
    assert not KVTransferAgent(cache, shard, "prefill").lean
    env = rank_runtime_env()["env_vars"]
    assert env["TANDEM_KV_LEAN"] == "0" and env["TANDEM_KV_PAIR_GROUPS"] == "1"


class _Posted:
    """A message the fake pair group below 'delivered' at once."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _InstantGroup:
    """Stands in for a pair group: every send and receive is done when posted (nothing moves)."""

    def send(self, tensors, dst: int, tag: int) -> _Posted:
        return _Posted()

    def recv(self, tensors, src: int, tag: int) -> _Posted:
        return _Posted()


def test_only_copies_beside_a_message_in_flight_take_the_overlap_cap(monkeypatch):
    """overlap_copy_programs caps a transfer's gathers but the first and its scatters but the last (the ones that
    run while another message of it is on the wire); 0 caps none. Checked on the programs each copy is asked for."""
    from workers.kv_transfer import transport

    asked: list[tuple[str, int | None]] = []
    # The agent's copies (`CacheBlocks.gather(block_ids, layers, heads, index, programs)`, `.scatter(..., buf, index,
    # programs)`), recorded instead of run.
    monkeypatch.setattr(transport.CacheBlocks, "gather",
                        lambda self, *a: asked.append(("gather", a[4])) or torch.zeros(a[1].stop - a[1].start, 2, 3, BS,
                                                                                       KV_HEADS, HEAD_DIM))
    monkeypatch.setattr(transport.CacheBlocks, "scatter", lambda self, *a: asked.append(("scatter", a[5])))
    shard = replica_shards(1, 1, LAYERS, KV_HEADS)[0]
    plan = plan_transfers([shard], [shard], range(3))
    spec = PairSpec("p", 1, 1)
    agents = {role: KVTransferAgent(torch.zeros(LAYERS, 2, 8, BS, KV_HEADS, HEAD_DIM), shard, role)
              for role in ("prefill", "decode")}
    for agent in agents.values():
        agent._groups["p"], agent.min_messages = _InstantGroup(), 3  # 6 layers: 3 messages of 2
    if "TANDEM_KV_OVERLAP_COPY_PROGRAMS" not in os.environ:
        assert all(a.overlap_copy_programs == 66 for a in agents.values())  # the default (transport.py says why)
    for cap, gathers, scatters in [(66, [None, 66, 66], [66, 66, None]), (0, [None] * 3, [None] * 3)]:
        asked.clear()
        for agent in agents.values():
            agent.overlap_copy_programs = cap
        agents["prefill"].send(spec, plan, {0: shard}, [0, 1, 2])
        agents["decode"].recv(spec, plan, {0: shard}, [5, 6, 7])
        assert [p for kind, p in asked if kind == "gather"] == gathers
        assert [p for kind, p in asked if kind == "scatter"] == scatters


def test_block_ids_map_into_their_sp_pool_and_foreign_ids_are_refused():
    """transport._local_ids: ids of this SP rank's pool -> indices into its cache (a range check, then a shift);
    an id of another pool is refused, never sent from the wrong cache slot."""
    from workers.kv_transfer.transport import _local_ids

    cache = torch.zeros(1, 2, 10, BS, 1, HEAD_DIM)  # pools of 10 blocks
    shard0 = replica_shards(1, 1, 1, 1, 2)[0]
    shard1 = replica_shards(1, 1, 1, 1, 2)[1]
    assert _local_ids(cache, shard0, [3, 0, 9]) == [3, 0, 9]
    assert _local_ids(cache, shard1, [13, 10, 19]) == [3, 0, 9]
    assert _local_ids(cache, shard1, []) == []
    for shard, ids in ((shard0, [3, 10]), (shard1, [9, 12]), (shard1, [20])):
        with pytest.raises(ValueError, match="not in SP rank"):
            _local_ids(cache, shard, ids)


class _OrderWire:
    """Point-to-point messages matched the way NCCL matches them: per (sender, receiver), the n-th send posted pairs
    with the n-th receive posted, whatever the tags (gloo matches by tag, so a transfer posted out of order would
    still pair up over gloo and never show here). A pair whose shapes differ is recorded and both fail."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sends: dict[tuple[int, int], list] = {}
        self.recvs: dict[tuple[int, int], list] = {}
        self.mismatches: list[str] = []

    def post(self, kind: str, me: int, peer: int, tensor: torch.Tensor) -> "_WireWork":
        work = _WireWork(tensor)
        key = (me, peer) if kind == "send" else (peer, me)
        with self.lock:
            (self.sends if kind == "send" else self.recvs).setdefault(key, []).append(work)
            sends, recvs = self.sends.get(key, []), self.recvs.get(key, [])
            while sends and recvs:
                s, r = sends.pop(0), recvs.pop(0)
                if s.tensor.shape != r.tensor.shape or s.tensor.dtype != r.tensor.dtype:
                    self.mismatches.append(f"{key}: send {tuple(s.tensor.shape)} met recv {tuple(r.tensor.shape)}")
                    s.failed = r.failed = True
                else:
                    r.tensor.copy_(s.tensor)
                s.done.set()
                r.done.set()
        return work


class _WireWork:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.done, self.failed = tensor, threading.Event(), False

    def wait(self, timeout=None) -> bool:
        if not self.done.wait(timeout.total_seconds() if timeout is not None else None) or self.failed:
            raise RuntimeError("message not delivered (or paired with another transfer's)")
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _WireGroup:
    def __init__(self, wire: _OrderWire, rank: int) -> None:
        self.wire, self.rank = wire, rank

    def send(self, tensors, dst: int, tag: int) -> _WireWork:
        return self.wire.post("send", self.rank, dst, tensors[0])

    def recv(self, tensors, src: int, tag: int) -> _WireWork:
        return self.wire.post("recv", self.rank, src, tensors[0])


def test_numbered_transfers_in_flight_pair_up_by_posting_order_as_nccl_does():
    """Four numbered transfers of different sizes, each side's calls started in a scrambled order from their own
    threads and several messages each, over a wire that pairs messages by posting order only (NCCL's rule): every
    message meets its own transfer's, and every transfer's blocks land where they belong."""
    import random

    shard = replica_shards(1, 1, LAYERS, KV_HEADS)[0]
    torch.manual_seed(0)
    prefill = KVTransferAgent(torch.randn(LAYERS, 2, 16, BS, KV_HEADS, HEAD_DIM), shard, "prefill", timeout_s=20)
    decode = KVTransferAgent(torch.zeros(LAYERS, 2, 24, BS, KV_HEADS, HEAD_DIM), shard, "decode", timeout_s=20)
    wire, spec = _OrderWire(), PairSpec("p->d", 1, 1)
    for rank, agent in enumerate((prefill, decode)):
        agent._groups[spec.pair_id] = _WireGroup(wire, rank)
        agent.message_bytes = 2 * 2 * BS * KV_HEADS * HEAD_DIM * 4  # two blocks of one layer: several messages each
    jobs = {0: ([0, 1, 2], [10, 11, 12]), 1: ([3], [13]), 2: ([4, 5, 6, 7, 8], [14, 15, 16, 17, 18]), 3: ([9, 15], [19, 23])}
    results: dict[tuple[int, str], object] = {}
    errors: list[BaseException] = []

    def transfer(seq: int, side: str) -> None:
        src_blocks, dst_blocks = jobs[seq]
        plan = plan_transfers([shard], [shard], range(len(src_blocks)))
        try:
            if side == "send":
                results[(seq, side)] = prefill.send(spec, plan, {0: shard}, src_blocks, f"h{seq}", seq)
            else:
                results[(seq, side)] = decode.recv(spec, plan, {0: shard}, dst_blocks, None, seq)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    calls = [(seq, side) for seq in jobs for side in ("send", "recv")]
    random.Random(3).shuffle(calls)
    threads = [threading.Thread(target=transfer, args=call) for call in calls]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(30)
    assert not errors and not wire.mismatches, (errors, wire.mismatches)
    for seq, (src_blocks, dst_blocks) in jobs.items():
        assert results[(seq, "send")].bytes == results[(seq, "recv")].bytes > 0
        # the ack waits only for the pair's earlier transfers to end, not out its timeout (a send once took a
        # throwaway order where no group came from `join`)
        assert results[(seq, "send")].ended - results[(seq, "send")].began < 5
        assert torch.equal(decode.kv_cache[:, :, dst_blocks], prefill.kv_cache[:, :, src_blocks]), seq



def test_a_long_transfer_is_cut_into_about_target_messages(monkeypatch):
    """A transfer over long_bytes goes as about target_messages messages (here with the 128 MiB floor lowered to one
    byte: 6 layers, target 3 -> 2 layers a message), never below the floor, and one at most long_bytes keeps the
    message_bytes cut (one message)."""
    import workers.kv_transfer.transport as transport

    shard = replica_shards(1, 1, LAYERS, KV_HEADS)[0]
    agent = KVTransferAgent(torch.zeros(LAYERS, 2, 8, BS, KV_HEADS, HEAD_DIM), shard, "decode")
    plan = plan_transfers([shard], [shard], range(5))  # one transfer: 6 layers x 2 heads x 5 blocks
    per_layer = 2 * 5 * BS * KV_HEADS * HEAD_DIM * 4
    agent.message_bytes, agent.min_messages, agent.split_bytes, agent.target_messages = 10 * per_layer, 1, 0, 3

    def cut() -> list[int]:
        return [m[2].stop - m[2].start for m in agent._messages(plan, {0: shard}, sending=False)]

    monkeypatch.setattr(transport, "TARGET_MESSAGE_FLOOR", 1)
    agent.long_bytes = 6 * per_layer  # not over it: the message_bytes cut alone
    assert cut() == [6]
    agent.long_bytes = 6 * per_layer - 1
    assert cut() == [2, 2, 2]
    monkeypatch.setattr(transport, "TARGET_MESSAGE_FLOOR", 3 * per_layer)  # the floor wins over total / target
    assert cut() == [3, 3]
    agent.target_messages = 0  # off: message_bytes alone
    assert cut() == [6]
