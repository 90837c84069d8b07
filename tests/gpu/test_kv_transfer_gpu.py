"""`KVTransferAgent` over NCCL between two GPUs, one process each (the harness of
scripts/bench_kv_transfer.py): the received blocks equal the sent blocks, bit for bit.

TP 1 -> 1 moves every head. A TP 2 -> 1 reshard needs 3 GPUs (two prefill ranks, one decode rank), so
its two halves are checked with one sender and one receiver: the sender gathering a slice of its heads
(a decode rank of a wider TP taking its share) and the receiver scattering into a slice of its heads
(one prefill rank of a wider TP delivering its share) while the other heads stay untouched. Last, the
benchmark runs end to end on a small prompt and verifies its own transfers.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from workers.kv_transfer.plan import RankShard, Transfer, plan_transfers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_kv_transfer as bench  # noqa: E402

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")]

# Llama-3.1-8B's per-block shape, over a small cache.
LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 32, 8, 128, 16, 24
SRC_BLOCKS = [5, 17, 3, 20, 11, 23, 0]  # a prompt's block table on the prefill side...
DST_BLOCKS = [9, 1, 22, 12, 4, 0, 15]  # ...and the blocks the decode side reserved for it
SENTINEL = -7.0

CASES = {  # (heads the prefill rank holds, heads the decode rank holds, heads sent)
    "tp1->tp1": (range(0, 8), range(0, 8), range(0, 8)),
    "gather-head-slice": (range(0, 8), range(4, 8), range(4, 8)),  # decode rank 1 of TP 2, from a TP 1 prefill
    "scatter-head-slice": (range(4, 8), range(0, 8), range(4, 8)),  # prefill rank 1 of TP 2, into a TP 1 decode
}


def _source_kv() -> torch.Tensor:
    """Every head of the prompt's KV as the prefill side computed it: distinct values, the same in both processes."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def _heads(r: range, base: range) -> slice:
    return slice(r.start - base.start, r.stop - base.start)


def _transfer_case(rank: int, args: tuple[str, str]) -> dict:
    """Runs in each GPU process: rank 0 sends the case's heads of SRC_BLOCKS, rank 1 receives them into DST_BLOCKS."""
    name, device_type = args
    src_heads, dst_heads, sent = CASES[name]
    device = bench.rank_device(rank, device_type)
    src, dst = RankShard(0, range(LAYERS), src_heads), RankShard(0, range(LAYERS), dst_heads)
    plan = [Transfer(0, 0, range(LAYERS), sent, tuple(range(len(SRC_BLOCKS))))]
    full = _source_kv()
    if rank == 0:
        cache = full[:, :, :, :, _heads(src_heads, range(HEADS))].contiguous().to(device)
    else:
        cache = torch.full((LAYERS, 2, NUM_BLOCKS, BLOCK, len(dst_heads), HEAD_DIM), SENTINEL, dtype=torch.bfloat16, device=device)
    agent, spec = bench.connect_agents(rank, cache, src if rank == 0 else dst, timeout_s=60.0)
    if rank == 0:
        return {"bytes": agent.send(spec, plan, {0: dst}, SRC_BLOCKS, "req-0").bytes}
    received = agent.recv(spec, plan, {0: src}, DST_BLOCKS).bytes
    bench.synchronize()
    expected = torch.full_like(cache, SENTINEL, device="cpu")
    for s, d in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
        expected[:, :, d, :, _heads(sent, dst_heads)] = full[:, :, s, :, _heads(sent, range(HEADS))]
    got = cache.cpu()
    return {"bytes": received, "equal": torch.equal(got, expected),
            "mismatched_blocks": sorted({int(b) for b in (got != expected).nonzero()[:, 2].tolist()})}


@pytest.mark.parametrize("name", list(CASES))
def test_received_blocks_equal_sent_blocks(name: str):
    src_heads, dst_heads, sent = CASES[name]
    if name != "scatter-head-slice":  # there, the other heads would come from the TP group's other prefill rank
        assert plan_transfers([RankShard(0, range(LAYERS), src_heads)], [RankShard(0, range(LAYERS), dst_heads)], range(len(SRC_BLOCKS))) == \
            [Transfer(0, 0, range(LAYERS), sent, tuple(range(len(SRC_BLOCKS))))]
    sender, receiver = bench.run_pair(_transfer_case, (name, "cuda"), timeout_s=300.0)
    nbytes = len(SRC_BLOCKS) * LAYERS * 2 * BLOCK * len(sent) * HEAD_DIM * 2
    assert sender["bytes"] == receiver["bytes"] == nbytes
    assert receiver["equal"], f"blocks that differ from what was sent (or were written outside the slice): {receiver['mismatched_blocks']}"


def test_bench_script_runs_and_verifies(tmp_path: Path):
    out = tmp_path / "kv_transfer.json"
    report = bench.main(["--tokens", "256", "1024", "--layers", "4", "--warmup", "1", "--iters", "2", "--out", str(out)])
    rows = report["results"]
    assert [r["tokens"] for r in rows] == [256, 1024]
    assert [r["bytes"] for r in rows] == [n // 16 * report["bytes_per_block"] for n in (256, 1024)]
    assert all(r["verified"] and r["agent_gbps"] > 0 and r["raw_gbps"] > 0 for r in rows)
    assert json.loads(out.read_text())["results"] == rows


# Four numbered transfers of one pair in flight at once (issue 24, item 2), each of its own blocks; their calls reach
# each rank in another order than their numbers, and each rank posts them in number order (`_PostOrder`).
IN_FLIGHT = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6]}  # seq -> indices into SRC_BLOCKS / DST_BLOCKS
PIECE_SEQ = 3  # sent as a piece of a prompt still being prefilled: its blocks are written on the engine's stream late


def _in_flight_case(rank: int, device_type: str) -> dict:
    """Rank 0 sends, rank 1 receives, four transfers on threads of their own. Transfer PIECE_SEQ's source blocks hold
    zeros until a write queued on the default stream behind a ~50 ms sleep (a prefill chunk still running): its send,
    with piece=True, must gather only after that write: it waits for the event recorded after it (`ChunkEnds`, as a
    prefill rank's model runner records one per chunk), while another sleep (the next chunk) follows on the stream."""
    import threading

    from workers.kv_transfer.chunk_ends import ChunkEnds

    device = bench.rank_device(rank, device_type)
    shard = RankShard(0, range(LAYERS), range(HEADS))
    full = _source_kv()
    if rank == 0:
        cache = full.to(device)
    else:
        cache = torch.full((LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM), SENTINEL, dtype=torch.bfloat16, device=device)
    agent, spec = bench.connect_agents(rank, cache, shard, timeout_s=60.0)
    bench.sync_start(rank)
    piece_src = [SRC_BLOCKS[i] for i in IN_FLIGHT[PIECE_SEQ]]
    if rank == 0 and device.type == "cuda":
        cache[:, :, piece_src] = 0
        torch.cuda._sleep(100_000_000)  # the chunk still computing, on the engine's (default) stream
        cache[:, :, piece_src] = full[:, :, piece_src].to(device, non_blocking=False)
        agent.chunk_ends = ChunkEnds()
        agent.chunk_ends.record(_chunk_step("piece-req", 64))  # the event after the write
        torch.cuda._sleep(100_000_000)  # the next chunk: the piece need not wait for it
    results, errors = {}, []

    def one(seq: int) -> None:
        try:
            torch.cuda.set_device(device) if device.type == "cuda" else None
            idx = IN_FLIGHT[seq]
            plan = [Transfer(0, 0, range(LAYERS), range(HEADS), tuple(range(len(idx))))]
            if rank == 0:
                results[seq] = agent.send(spec, plan, {0: shard}, [SRC_BLOCKS[i] for i in idx], f"h{seq}", seq,
                                          seq == PIECE_SEQ, ("piece-req", 64) if seq == PIECE_SEQ else None).bytes
            else:
                results[seq] = agent.recv(spec, plan, {0: shard}, [DST_BLOCKS[i] for i in idx], None, seq).bytes
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    order = [3, 2, 1, 0] if rank == 0 else [2, 3, 0, 1]
    threads = [threading.Thread(target=one, args=(seq,)) for seq in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bench.synchronize()
    out = {"bytes": sum(results.values()), "errors": errors}
    if rank == 1:
        expected = torch.full_like(cache, SENTINEL, device="cpu")
        for s, d in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
            expected[:, :, d] = full[:, :, s]
        got = cache.cpu()
        out.update(equal=torch.equal(got, expected),
                   mismatched_blocks=sorted({int(b) for b in (got != expected).nonzero()[:, 2].tolist()}))
    return out


def _chunk_step(seq_id: str, tokens: int):
    """A step that runs `tokens` prompt tokens of `seq_id` and samples nothing (a prefill chunk), as ChunkEnds sees it."""
    from workers.sampling_params import SamplingParams
    from workers.scheduler_output import ScheduledSeq, SchedulerOutput

    return SchedulerOutput(seqs=[ScheduledSeq(seq_id, [0] * tokens, 0, [], False, SamplingParams(), 0)])


def test_numbered_transfers_in_flight_together_land_bit_for_bit_and_a_piece_waits_for_its_chunk():
    sender, receiver = bench.run_pair(_in_flight_case, "cuda", timeout_s=300.0)
    assert not sender["errors"] and not receiver["errors"], (sender["errors"], receiver["errors"])
    assert sender["bytes"] == receiver["bytes"] == len(SRC_BLOCKS) * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2
    assert receiver["equal"], f"blocks that differ from what was sent: {receiver['mismatched_blocks']} " \
                              f"(the piece's are {[DST_BLOCKS[i] for i in IN_FLIGHT[PIECE_SEQ]]})"
