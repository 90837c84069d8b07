"""The Triton GEMV equals an fp32 reference as closely as cuBLAS does: ragged N and K, bias,
strided x, several tile configs; the model's linears route exactly batch-1 calls to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEV = "cuda"


def _check(x, w, b, config=None):
    from parallel.kernels.gemv import gemv

    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = gemv(x, w, b, config)
    cublas = F.linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == x.dtype
    scale = ref.abs().max().item()
    err = (got.float() - ref).abs().max().item() / scale
    err_cublas = (cublas.float() - ref).abs().max().item() / scale
    # fp32 accumulation, then one rounding to the 16-bit dtype: the same error budget as cuBLAS
    assert err <= max(2 * err_cublas, 1e-2), (err, err_cublas)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096), (1000, 136), (37, 4104)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(n, k, dtype):
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    _check(x, w, None)


@pytest.mark.parametrize("block_n,block_k,warps", [(8, 1024, 8), (16, 256, 4), (32, 512, 8)])
def test_configs_and_bias(block_n, block_k, warps):
    torch.manual_seed(0)
    cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3)
    x = torch.randn(1, 2056, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3000, 2056, device=DEV, dtype=torch.bfloat16) / 45
    b = torch.randn(3000, device=DEV, dtype=torch.bfloat16)
    _check(x, w, b, cfg)
    _check(x, w, None, cfg)


def test_strided_input_and_dispatch():
    """x as a slice of a wider row, and which calls `supports` takes (more rows: tests/gpu/test_gemv_rows.py)."""
    from parallel.kernels.gemv import max_rows, supports

    x = torch.randn(1, 8192, device=DEV, dtype=torch.bfloat16)[:, :4096]
    w = torch.randn(512, 4096, device=DEV, dtype=torch.bfloat16) / 64
    _check(x, w, None)
    assert supports(x, w)
    assert not supports(torch.randn(max_rows() + 1, 4096, device=DEV, dtype=torch.bfloat16), w)
    assert not supports(x.float(), w.float())
    assert not supports(x.cpu(), w.cpu())


def test_parallel_linear_routes_batch_one_in_graphs():
    """Calls of 1..max_rows() rows captured in a CUDA graph run the GEMV; eager calls and larger batches
    run cuBLAS."""
    from parallel.matmul import linear
    from parallel.kernels.gemv import gemv, max_rows

    torch.manual_seed(0)
    w = torch.randn(2048, 1024, device=DEV, dtype=torch.bfloat16) / 32
    for m in (1, 4, max_rows() + 1):
        x = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(linear(x, w), F.linear(x, w))  # eager: cuBLAS, bit for bit
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            linear(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = linear(x, w)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gemv(x, w) if m <= max_rows() else F.linear(x, w))
