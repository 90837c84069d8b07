"""Pools sharing one GPU (`gpus_per_rank` < 1): an SP=2 prefill replica's ranks and a decode rank all on
cuda:0. NCCL refuses such a group, so the pair is gloo: ranks that report the same GPU copy the blocks by
CUDA IPC, the others through host memory. Either way the blocks must arrive bit for bit, and nothing else
in the decode cache may change."""
from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.test_kv_transfer import _transfer_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("gpus", [("GPU-same", "GPU-same"), ("GPU-a", "GPU-b")], ids=["ipc", "host"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_sp2_prefill_and_decode_on_one_gpu_move_kv(dtype, gpus):
    run_ranks(_transfer_rank, 3, (1, 2), 1, dtype, "cuda", True, gpus)


@pytest.mark.parametrize("gpus", [("GPU-same", "GPU-same"), ("GPU-a", "GPU-b")], ids=["ipc", "host"])
def test_a_handoff_does_not_wait_for_the_engines_stream(gpus):
    """Every rank's default stream is busy with a ~4 s kernel (an engine step) when the handoff starts: the
    transfer runs on the agents' own stream and ends long before it, bit for bit (checked by the decode rank)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    cycles = int(100_000_000 * 4.0 / (start.elapsed_time(end) / 1e3))  # ~4 s of spinning on this GPU
    run_ranks(_transfer_rank, 3, (1, 2), 1, torch.bfloat16, "cuda", True, gpus, None, cycles)
