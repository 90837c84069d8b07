"""GEMV for batch-1 decode: y[1, N] = x[1, K] @ w[N, K]^T (+ bias), with the decode step's small
ops folded in.

A batch-1 decode step is one matrix-vector product per linear layer: it must stream every weight
byte from HBM once, and nothing else matters. cuBLAS picks tiles for these shapes that leave part of
the GPU idle (a 4096 x 4096 projection ran at 2.55 TB/s on an H200 whose copy engine does 4.2).
Here each program owns BLOCK_N output features and streams their rows of `w` over the whole K
through a deep software pipeline, accumulating products elementwise in fp32 and reducing once.

At one row the RMSNorm, SiLU-and-mul and residual-add kernels between the GEMVs cost as much in
launches as in work (65 + 32 of a step's 340 kernels for Llama-3.1-8B), so the GEMV can absorb them
(`workers/models/fused_decode.py` wires this up):
  - `norm_weight`: x is the residual stream h; every program computes rsqrt(mean(h^2) + eps) over
    all of h (8 KB from L2) and feeds w_norm * (h * rstd) to the product, rounded as `RMSNorm` rounds;
  - `silu`: w is the fused [gate; up] weight; each program owns the same rows of both halves and
    writes silu(gate) * up (rounded as `silu_and_mul`);
  - `residual`: y = round(round(x @ w^T) (+ bias)) + residual, the RMSNorm kernel's residual add.
Under CUDA-graph capture on Hopper the GEMV is launched with programmatic dependent launch: its
first weight tile is loaded before it waits for the previous kernel (weights never depend on it), and
the decode kernels before it let it launch early.

Tiles come from `scripts/bench_gemv.py --sweep` (CUDA graphs, weights rotated past L2 as in a
real forward). A tensor-core variant for 8 rows was only level with cuBLAS, so batches of more than
one row stay with F.linear.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _load_w(w_ptrs, k, K, offs_k, n_mask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    if EVEN_K:
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        k_mask = (k + offs_k) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return w


@triton.jit
def _load_x(x_ptr, nw_ptr, k, K, offs_k, rstd, EVEN_K: tl.constexpr, NORM: tl.constexpr):
    """x[k : k + BLOCK_K] in fp32; under NORM the RMSNorm of it (w_norm * (h * rstd), each rounded)."""
    if EVEN_K:
        x = tl.load(x_ptr + k + offs_k)
    else:
        x = tl.load(x_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0)
    if NORM:
        if EVEN_K:
            nw = tl.load(nw_ptr + k + offs_k)
        else:
            nw = tl.load(nw_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0)
        x = (x.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
        x = (nw.to(tl.float32) * x.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, wu_ptr, bu_ptr, y_ptr, nw_ptr, r_ptr, N, K, stride_wn, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 EVEN_N: tl.constexpr, NORM: tl.constexpr, K_PAD: tl.constexpr, SILU: tl.constexpr,
                 RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = wu_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # SILU: the same rows of "up"
    # The first weight tile does not depend on the previous kernel: under PDL it loads while that one drains.
    w = _load_w(w_ptrs, 0, K, offs_k, n_mask, EVEN_K, EVEN_N)
    if SILU:
        wu = _load_w(u_ptrs, 0, K, offs_k, n_mask, EVEN_K, EVEN_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, residual and y's memory belong to earlier kernels: nothing before this touches them
    rstd = 0.0
    if NORM:
        offs_f = tl.arange(0, K_PAD)
        h = tl.load(x_ptr + offs_f, mask=offs_f < K, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) / K + eps)
    x = _load_x(x_ptr, nw_ptr, 0, K, offs_k, rstd, EVEN_K, NORM)
    acc = w.to(tl.float32) * x[None, :]
    if SILU:
        acc_u = wu.to(tl.float32) * x[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        w = _load_w(w_ptrs, k, K, offs_k, n_mask, EVEN_K, EVEN_N)
        x = _load_x(x_ptr, nw_ptr, k, K, offs_k, rstd, EVEN_K, NORM)
        acc += w.to(tl.float32) * x[None, :]
        if SILU:
            u_ptrs += BLOCK_K
            wu = _load_w(u_ptrs, k, K, offs_k, n_mask, EVEN_K, EVEN_N)
            acc_u += wu.to(tl.float32) * x[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = y_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        if not RESIDUAL:  # column-parallel: F.linear adds the bias before rounding
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if SILU:
        u = tl.sum(acc_u, axis=1)
        if HAS_BIAS:
            u += tl.load(bu_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        g = y.to(dt).to(tl.float32)
        s = tl.div_rn(g, 1.0 + libdevice.exp(-g)).to(dt)  # F.silu, rounded to the dtype
        y = s.to(tl.float32) * u.to(dt).to(tl.float32)
    if RESIDUAL:  # row-parallel: round, add the bias (rounded), add the residual stream (rounded)
        if HAS_BIAS:
            y = y.to(dt).to(tl.float32) + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32) + tl.load(r_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(dt), mask=n_mask)


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


MAX_NORM_K = 16384  # the norm prologue holds all of h in registers


_PDL: bool | None = None


def pdl_enabled() -> bool:
    """Programmatic dependent launch: Hopper or newer, a Triton that has it, and not turned off
    with TANDEM_PDL=0 (scripts/bench_latency.py compares both)."""
    global _PDL
    if _PDL is None:
        _PDL = (os.environ.get("TANDEM_PDL", "1") != "0" and torch.cuda.get_device_capability()[0] >= 9
                and hasattr(tl.extra.cuda, "gdc_wait"))
    return _PDL


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         silu: bool = False) -> torch.Tensor:
    """F.linear(x, w, bias) for x [1, K] on CUDA (see `supports`), optionally with the RMSNorm of x
    before, SiLU-and-mul of the [gate; up] halves after, or a residual add after (module docstring)."""
    k = x.shape[1]
    n = w.shape[0] // 2 if silu else w.shape[0]
    if norm_weight is not None and k > MAX_NORM_K:
        raise ValueError(f"gemv: the RMSNorm prologue supports K <= {MAX_NORM_K}, got {k}")
    cfg = config or tile_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = torch.cuda.is_current_stream_capturing() and pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    b = bias if bias is not None else w
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, b, w[n:] if silu else w, b[n:] if silu and bias is not None else b, y, norm_weight if norm_weight is not None else x,
        residual if residual is not None else x, n, k, w.stride(0), eps,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, EVEN_N=n % cfg["BLOCK_N"] == 0,
        NORM=norm_weight is not None, K_PAD=triton.next_power_of_2(k) if norm_weight is not None else 1,
        SILU=silu, RESIDUAL=residual is not None, USE_PDL=pdl, **cfg, **extra)
    return y
