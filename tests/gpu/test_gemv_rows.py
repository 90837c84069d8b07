"""The rows GEMV (parallel/kernels/gemv.py `gemv_rows`, 2..MAX_ROWS rows, each weight tile read once for
all of them) equals an fp32 reference as closely as cuBLAS does, in bf16 and fp16: Llama-3.1-8B shapes
and ragged N and K, bias, strided rows, both inner products; and `parallel.matmul.linear` routes 2..max_rows()
rows captured in a CUDA graph to it (a verification step's k + 1 rows), more rows and eager calls to cuBLAS."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEV = "cuda"


def _check(x, w, b, config=None):
    from parallel.kernels.gemv import gemv_rows

    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemv_rows(x, w, b, config)
    cublas = F.linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == x.dtype
    scale = ref.abs().max().item()
    err = (got.float() - ref).abs().max().item() / scale
    err_cublas = (cublas.float() - ref).abs().max().item() / scale
    # fp32 accumulation, then one rounding to the 16-bit dtype: the same error budget as cuBLAS
    assert err <= max(2 * err_cublas, 1e-2), (x.shape, w.shape, config, err, err_cublas)


@pytest.mark.parametrize("m", [2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096), (1000, 136), (37, 4104)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(m, n, k, dtype):
    torch.manual_seed(n + k + m)
    x = torch.randn(m, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    _check(x, w, None)


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=4, BLOCK_N=8, BLOCK_K=256, DOT=False, num_warps=4, num_stages=4),
                                 dict(BLOCK_M=8, BLOCK_N=16, BLOCK_K=128, DOT=False, num_warps=8, num_stages=4),
                                 dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, DOT=True, num_warps=4, num_stages=4),
                                 dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT=True, num_warps=4, num_stages=4)])
def test_configs_bias_and_strided_rows(cfg):
    torch.manual_seed(0)
    w = torch.randn(3000, 2056, device=DEV, dtype=torch.bfloat16) / 45
    b = torch.randn(3000, device=DEV, dtype=torch.bfloat16)
    for m in (2, 3, cfg["BLOCK_M"]):
        x = torch.randn(m, 4112, device=DEV, dtype=torch.bfloat16)[:, :2056]  # stride(0) = 4112
        _check(x, w, b, cfg)
        _check(x, w, None, cfg)


def _capture(fn):
    """(graph, output) of fn captured in a CUDA graph, replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn()
    g.replay()
    torch.cuda.synchronize()
    return g, y


def test_linear_routes_small_row_counts_in_graphs():
    """2..max_rows() rows inside capture take the rows kernel (bit for bit what it gives eagerly); more
    rows, and eager calls, stay on cuBLAS."""
    from parallel.kernels.gemv import gemv_rows, max_rows, supports
    from parallel.matmul import linear

    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16) / 64
    b = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    top = max_rows()
    for m in sorted({2, 4, 5, 9, top, top + 1}):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # eager: cuBLAS, bit for bit
        _, y = _capture(lambda: linear(x, w, b))
        if 2 <= m <= top:
            assert supports(x, w)
            assert torch.equal(y, gemv_rows(x, w, b)), m
            _check(x, w, b)
        else:
            assert not supports(x, w)
            assert torch.equal(y, F.linear(x, w, b)), m


def test_graph_replay_reads_new_inputs():
    """A captured rows GEMV recomputes from whatever the input buffer holds at replay (as a verification
    graph is replayed with each step's hidden states), and its PDL launch keeps the stream order."""
    from parallel.matmul import linear

    torch.manual_seed(1)
    w1 = torch.randn(14336, 4096, device=DEV, dtype=torch.bfloat16) / 64
    w2 = torch.randn(4096, 14336, device=DEV, dtype=torch.bfloat16) / 120
    x = torch.zeros(6, 4096, device=DEV, dtype=torch.bfloat16)
    g, y = _capture(lambda: linear(F.silu(linear(x, w1)), w2))  # two chained rows GEMVs and an op between
    for _ in range(3):
        x.copy_(torch.randn(6, 4096, device=DEV, dtype=torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        want = F.linear(F.silu(F.linear(x.float(), w1.float()).to(torch.bfloat16)).float(), w2.float())
        err = (y.float() - want).abs().max().item() / want.abs().max().item()
        assert err < 2e-2, err
