"""The KV handoff's block-id index modes (`KVTransferAgent.index_mode`, TANDEM_KV_INDEX) over NCCL between two GPUs:
with the ids copied from pageable memory, staged through a pinned buffer, or read by the row copy straight from
that pinned buffer ("mapped"), the received blocks equal the sent blocks bit for bit, over several transfers in
a row (each reusing the thread's staging buffer) of different block counts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workers.kv_transfer.plan import RankShard, Transfer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_kv_transfer as bench  # noqa: E402

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")]

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 32, 8, 128, 16, 64
# (prefill blocks, decode blocks) per transfer, sent one after the other on the pair
ROUNDS = [([5, 17, 3, 20, 11], [9, 1, 22, 12, 4]), (list(range(40, 63)), list(range(63, 40, -1))), ([0], [63])]


def _case(rank: int, args: tuple[str, str]) -> dict:
    mode, device_type = args
    device = bench.rank_device(rank, device_type)
    shard = RankShard(0, range(LAYERS), range(HEADS))
    g = torch.Generator().manual_seed(1)
    full = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    cache = full.to(device) if rank == 0 else torch.zeros_like(full, device=device)
    agent, spec = bench.connect_agents(rank, cache, shard, timeout_s=60.0)
    agent.index_mode = mode
    expected = torch.zeros_like(full)
    for k, (src, dst) in enumerate(ROUNDS):
        plan = [Transfer(0, 0, range(LAYERS), range(HEADS), tuple(range(len(src))))]
        if rank == 0:
            agent.send(spec, plan, {0: shard}, src, f"req-{k}")
        else:
            agent.recv(spec, plan, {0: shard}, dst)
        expected[:, :, dst] = full[:, :, src]
    bench.synchronize()
    stage = getattr(agent._index_stages, "stage", None)
    staged = stage is not None and stage.mode == mode
    if rank == 0:
        return {"staged": staged}
    got = cache.cpu()
    return {"staged": staged, "equal": torch.equal(got, expected),
            "mismatched_blocks": sorted({int(b) for b in (got != expected).nonzero()[:, 2].tolist()})}


@pytest.mark.parametrize("mode", ["pageable", "pinned", "mapped"])
def test_each_index_mode_lands_every_block_bit_for_bit(mode: str):
    sender, receiver = bench.run_pair(_case, (mode, "cuda"), timeout_s=300.0)
    assert sender["staged"] == receiver["staged"] == (mode != "pageable")  # the mode was really the one used
    assert receiver["equal"], f"blocks that differ from what was sent: {receiver['mismatched_blocks']}"
