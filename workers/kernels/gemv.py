"""GEMV for batch-1 decode: y[1, N] = x[1, K] @ w[N, K]^T (+ bias).

A batch-1 decode step is one matrix-vector product per linear layer: it must stream every weight
byte from HBM once, and nothing else matters. cuBLAS picks tiles for these shapes that leave part of
the GPU idle (a 4096 x 4096 projection ran at 2.55 TB/s on an H200 whose copy engine does 4.2).
Here each program owns BLOCK_N output features and streams their rows of `w` over the whole K
through a deep software pipeline, accumulating products elementwise in fp32 and reducing once.

Tiles come from `scripts/bench_gemv.py --sweep` (CUDA graphs, weights rotated past L2 as in a
real forward). A tensor-core variant for 8 rows was only level with cuBLAS, so batches of more than
one row stay with F.linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 EVEN_N: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k + offs_k)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def tile_config(n: int, k: int) -> dict:
    """Narrow layers (few programs) want long K tiles and more warps per program to keep enough
    bytes in flight; wide ones (MLP up, LM head) have programs to spare."""
    if n <= 8192:
        return dict(BLOCK_N=8, BLOCK_K=512, num_warps=8 if k >= 8192 else 4, num_stages=4)
    return dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` takes this call (else the caller uses F.linear)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and x.stride(-1) == 1 and w.stride(-1) == 1)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [1, K] on CUDA (see `supports`)."""
    k = x.shape[1]
    n = w.shape[0]
    cfg = config or tile_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, bias if bias is not None else w, y, n, k, w.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0, EVEN_N=n % cfg["BLOCK_N"] == 0, **cfg)
    return y
