"""What of the piecewise CUDA graphs (workers/piecewise_graphs.py) runs without a GPU: the token-count
ladder, the memory they are budgeted, the capture hook on the attention layer, and the backends'
`out=` (the shared buffer attention writes into between two graphs). The graphs themselves:
tests/gpu/test_piecewise_graphs.py."""
from __future__ import annotations

import torch

from workers.attention import AttentionMetadata
from workers.attention.torch_backend import TorchAttention
from workers.models.layers import PagedAttention
from workers.piecewise_graphs import token_ladder
from workers.step_memory import graph_pool_bytes


def test_token_ladder():
    assert token_ladder(2048)[:4] == [16, 32, 64, 128] and token_ladder(2048)[-3:] == [1792, 1920, 2048]
    assert all(b - a == 64 for a, b in zip(token_ladder(512)[2:], token_ladder(512)[3:]))
    assert token_ladder(100) == [16, 32, 64, 100] and token_ladder(8) == [8]


def test_graph_pool_bytes_scale_with_the_largest_graph():
    assert graph_pool_bytes(8 << 30, 2048, 8192) == 2 << 30
    assert graph_pool_bytes(8 << 30, 8192, 4096) == 8 << 30  # never more than a whole step's
    assert graph_pool_bytes(8 << 30, 0, 8192) == 0 and graph_pool_bytes(-5, 512, 8192) == 0


def _batch():
    """Two sequences: one decode (context 5) and a 3-token chunk of a prompt (positions 4..6); block size 4."""
    torch.manual_seed(0)
    cache = torch.zeros(2, 8, 4, 2, 16)
    cache[:, :4] = torch.randn(2, 4, 4, 2, 16)
    meta = AttentionMetadata(slot_mapping=torch.tensor([5, 20, 21, 22]), query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                             seq_lens=torch.tensor([6, 7], dtype=torch.int32),
                             block_tables=torch.tensor([[0, 1], [4, 5]], dtype=torch.int32),
                             query_lens_cpu=[1, 3], seq_lens_cpu=[6, 7], max_query_len=3, max_seq_len=7, num_decodes=1)
    return torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), cache, meta


def test_backend_writes_into_the_given_buffer():
    q, k, v, cache, meta = _batch()
    want = TorchAttention().forward(q, k, v, cache.clone(), meta, 0.25)
    buf = torch.full((6, 4, 16), 7.0)
    got = TorchAttention().forward(q, k, v, cache.clone(), meta, 0.25, out=buf[:4])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:4], want) and (buf[4:] == 7).all()


def test_capture_hook_takes_every_attention_call():
    layer = PagedAttention(4, 2, 16, 0.25)
    seen = []
    PagedAttention.intercept = lambda lyr, q, k, v: seen.append(lyr) or q
    try:
        q = torch.randn(3, 4, 16)
        assert layer(q, q[:, :2], q[:, :2]) is q and seen == [layer]  # no KV cache bound: the backend is never reached
    finally:
        PagedAttention.intercept = None


def test_partial_sums_try_the_fast_all_reduce_first():
    """parallel/comm.py: a group's fast all-reduce (the NVLink P2P one on GPUs) takes what it accepts;
    what it refuses goes to torch.distributed."""
    import pytest

    from parallel.comm import reduce_partial_sums
    from parallel.p2p_allreduce import enable_p2p_all_reduce
    from parallel.state import Group

    taken = []
    group = Group(ranks=[0, 1], rank=0, fast_all_reduce=lambda x: taken.append(x.numel()) or x.numel() <= 8)
    x = torch.ones(8)
    assert reduce_partial_sums(x, group) is x and taken == [8]
    with pytest.raises((ValueError, RuntimeError)):  # refused: NCCL/gloo, and no process group here
        reduce_partial_sums(torch.ones(16), group)
    assert taken == [8, 16]
    assert not enable_p2p_all_reduce(Group(ranks=[0, 1]), torch.device("cpu"), torch.float32)  # CUDA only


def test_a_rank_that_sees_its_node_finds_its_own_gpu():
    """cluster/rank_worker.py: with every GPU of the node visible (for the P2P all-reduce), a rank picks
    the device of the GPU Ray assigned it, in the numbering of the CUDA_VISIBLE_DEVICES it inherited."""
    import pytest

    from cluster.ray_runtime import RANK_SEES_NODE_GPUS, rank_runtime_env
    from cluster.rank_worker import own_gpu_index

    assert own_gpu_index(["3"], None) == 3
    assert own_gpu_index(["6"], "4,5,6,7") == 2
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        own_gpu_index(["1"], "4,5")
    with pytest.raises(RuntimeError, match="exactly one GPU"):
        own_gpu_index(["0", "1"], None)
    env = rank_runtime_env(see_node_gpus=True)["env_vars"]
    assert env[RANK_SEES_NODE_GPUS] == "1" and env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert RANK_SEES_NODE_GPUS not in rank_runtime_env()["env_vars"]
