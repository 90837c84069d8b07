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
  - `residual`: y = round(round(x @ w^T) (+ bias)) + residual, the RMSNorm kernel's residual add;
  - `rope`: RoPE of the q/k heads of a fused qkv output; each program owns row pairs (j, j + D/2) of
    its heads, so the rotation needs nothing from other programs (`Rope`).
Under CUDA-graph capture on Hopper the GEMV is launched with programmatic dependent launch (PDL): its
first weight tile is loaded before it waits for the previous kernel (weights never depend on it), and
it lets the next kernel launch once its main loop is done. The decode-attention and greedy kernels take
part in the same chain at batch 1 (`paged_attention.py`, `sampling.py`); every kernel of the chain waits
(`gdc_wait`) before it reads or writes activations, so the stream order still holds.

Tiles come from `scripts/bench_gemv.py --sweep` (CUDA graphs, weights rotated past L2 as in a
real forward).

A few rows (2..`MAX_ROWS`: a speculative verification step of k + 1 tokens, small decode batches) are
still weight streaming: `gemv` with x [M, K] runs `_gemv_rows_kernel`, which loads each weight tile
once and applies it to all M rows, accumulating in fp32, so the step costs about what one row costs
while the weights dominate. Plain linear only (bias, no fused norm/activation/RoPE/residual): the
fused decode path is batch-1. Two inner products, picked per row count by `rows_tile_config`:
elementwise FMAs into a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator reduced once at the end (as the
one-row kernel does), or `tl.dot` of the weight tile with the rows padded to 16 (tensor cores; the
product is free next to the weight stream, the padding costs nothing but registers).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from parallel.kernels.cuda_launch import pdl_supported
from parallel.p2p_allreduce import EMPTY_BITS


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
def _load_x(x_ptr, nw_ptr, k, K, offs_k, rstd, EVEN_K: tl.constexpr, NORM: tl.constexpr, PARTS: tl.constexpr = 0,
            PARTS_L1: tl.constexpr = False):
    """x[k : k + BLOCK_K] in fp32; under NORM the RMSNorm of it (w_norm * (h * rstd), each rounded). PARTS > 0:
    x_ptr holds PARTS pushed partial sums [PARTS, K] (`_take_parts` saw them all arrive) and h is their sum, read
    past L1 unless PARTS_L1 (`take_x_in_l1`)."""
    if PARTS > 0:
        x = _sum_parts(x_ptr, k + offs_k, (k + offs_k) < K, K, PARTS, False, PARTS_L1)
    elif EVEN_K:
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


# A 16-bit negative zero marks a pushed-partials slot not yet written (parallel/p2p_allreduce.PushedPartials):
# a pushed value is never -0 (`_push` writes +0 for it), so a slot holds the mark until its value lands.
_EMPTY = tl.constexpr(EMPTY_BITS)


@triton.jit
def wait_filled(ptrs, mask):
    """The 16-bit values at ptrs, reread (volatile, past L1) until none is the empty mark: a peer's pushed values,
    waited for in this rank's memory (also parallel/kernels/pushed_reduce.py)."""
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    while tl.max((v.to(tl.int16, bitcast=True) == _EMPTY).to(tl.int32), 0) > 0:
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    return v


@triton.jit
def plus_zero(x):
    """16-bit x with -0 as +0: what a rank pushes, since a -0 would read as "not yet written"."""
    bits = x.to(tl.int16, bitcast=True)
    return tl.where(bits == _EMPTY, tl.zeros_like(bits), bits).to(x.dtype, bitcast=True)


@triton.jit
def _sum_parts(parts_ptr, offs, mask, K, PARTS: tl.constexpr, WAIT: tl.constexpr, L1: tl.constexpr = False):
    """h[offs] = the sum of PARTS partials [PARTS, K] (each rank's, in rank order), rounded to their dtype,
    returned in fp32. WAIT: reread (volatile, past L1) each part until none of its values is the empty mark;
    else read them from L2 (`.cg`), after a wait has seen them arrive: L1 may hold another kernel's lines; or, with
    L1, through L1 (the SM's programs then share the lines; see `take_x_in_l1`)."""
    dt = parts_ptr.dtype.element_ty
    h = tl.zeros(offs.shape, tl.float32)
    for p in tl.static_range(PARTS):
        if WAIT:
            v = wait_filled(parts_ptr + p * K + offs, mask)
        elif L1:
            v = tl.load(parts_ptr + p * K + offs, mask=mask, other=0.0)
        else:
            v = tl.load(parts_ptr + p * K + offs, mask=mask, other=0.0, cache_modifier=".cg")
        h += v.to(tl.float32)
    return h.to(dt).to(tl.float32)


@triton.jit
def _take_parts(parts_ptr, reset_ptr, h_out_ptr, K, K_PAD: tl.constexpr, PARTS: tl.constexpr):
    """Wait for every rank's partial sum of h, return h (fp32, rounded) over K_PAD; program 0 writes h to h_out
    (the next row-parallel GEMV's residual) and marks the previous site's slots empty (every program of the
    kernel that read them has finished: it came before this one in the stream)."""
    offs = tl.arange(0, K_PAD)
    mask = offs < K
    h = _sum_parts(parts_ptr, offs, mask, K, PARTS, True)
    if tl.program_id(0) == 0:
        tl.store(h_out_ptr + offs, h.to(h_out_ptr.dtype.element_ty), mask=mask)
        empty = tl.full([K_PAD], _EMPTY, tl.int16).to(reset_ptr.dtype.element_ty, bitcast=True)
        for p in tl.static_range(PARTS):
            tl.store(reset_ptr + p * K + offs, empty, mask=mask)
    return h


@triton.jit
def _push(y, offs, mask, push_ptrs, PUSH: tl.constexpr, dt: tl.constexpr):
    """Store y (rounded to dt, -0 as +0) at every rank's slot: push_ptrs [PUSH], each rank's slot address (int64)."""
    yb = plus_zero(y.to(dt))
    for p in tl.static_range(PUSH):
        base = tl.load(push_ptrs + p).to(tl.pointer_type(dt))
        tl.store(base + offs, yb, mask=mask)


@triton.jit
def _sum_pushed_kernel(parts_ptr, reset_ptr, h_out_ptr, K, K_PAD: tl.constexpr, PARTS: tl.constexpr,
                       USE_PDL: tl.constexpr, GRID_WAIT: tl.constexpr = True):
    """h_out = the sum of the pushed partials, for a consumer that is not a fused GEMV (the final norm)."""
    if USE_PDL and GRID_WAIT:
        tl.extra.cuda.gdc_wait()
    _take_parts(parts_ptr, reset_ptr, h_out_ptr, K, K_PAD, PARTS)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, wu_ptr, bu_ptr, y_ptr, nw_ptr, r_ptr, pos_ptr, cs_ptr, reset_ptr, push_ptrs,
                 N, K, stride_wn, stride_cp,
                 eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 EVEN_N: tl.constexpr, NORM: tl.constexpr, K_PAD: tl.constexpr, SILU: tl.constexpr,
                 RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr,
                 PAIRED: tl.constexpr, USE_PDL: tl.constexpr, PARTS: tl.constexpr = 0, PUSH: tl.constexpr = 0,
                 GRID_WAIT: tl.constexpr = True, PARTS_L1: tl.constexpr = False):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output features; under ROPE, (row, row + D/2) pairs
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    if ROPE:  # pair p: feature j < D/2 of head p // (D/2), and its rotate-half partner j + D/2
        offs_a = (offs_n // HALF) * HEAD_DIM + offs_n % HALF
        offs_b = offs_a + HALF
    else:
        offs_a = offs_n
        offs_b = offs_n
    w_ptrs = w_ptr + offs_a[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = wu_ptr + offs_b[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # SILU: "up" rows; ROPE: partners
    # The first weight tile does not depend on the previous kernel: under PDL it loads while that one drains.
    w = _load_w(w_ptrs, 0, K, offs_k, n_mask, EVEN_K, EVEN_N)
    if PAIRED:
        wu = _load_w(u_ptrs, 0, K, offs_k, n_mask, EVEN_K, EVEN_N)
    if USE_PDL and GRID_WAIT:
        tl.extra.cuda.gdc_wait()  # x, residual and y's memory belong to earlier kernels: nothing before this touches them
    rstd = 0.0
    if NORM:
        if PARTS > 0:  # h arrives as the TP ranks' pushed partial sums: wait for them, sum, hand h on (r_ptr)
            h = _take_parts(x_ptr, reset_ptr, r_ptr, K, K_PAD, PARTS)
        else:
            offs_f = tl.arange(0, K_PAD)
            h = tl.load(x_ptr + offs_f, mask=offs_f < K, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) / K + eps)
    x = _load_x(x_ptr, nw_ptr, 0, K, offs_k, rstd, EVEN_K, NORM, PARTS, PARTS_L1)
    acc = w.to(tl.float32) * x[None, :]
    if PAIRED:
        acc_u = wu.to(tl.float32) * x[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        w = _load_w(w_ptrs, k, K, offs_k, n_mask, EVEN_K, EVEN_N)
        x = _load_x(x_ptr, nw_ptr, k, K, offs_k, rstd, EVEN_K, NORM, PARTS, PARTS_L1)
        acc += w.to(tl.float32) * x[None, :]
        if PAIRED:
            u_ptrs += BLOCK_K
            wu = _load_w(u_ptrs, k, K, offs_k, n_mask, EVEN_K, EVEN_N)
            acc_u += wu.to(tl.float32) * x[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = y_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        if not RESIDUAL:  # column-parallel: F.linear adds the bias before rounding
            y += tl.load(b_ptr + offs_a, mask=n_mask, other=0.0).to(tl.float32)
    if ROPE:  # y holds features offs_a, u their partners offs_b; rotate q and k rows as `fused_ops.rope` does
        u = tl.sum(acc_u, axis=1)
        if HAS_BIAS:
            u += tl.load(b_ptr + offs_b, mask=n_mask, other=0.0).to(tl.float32)
        x1 = y.to(dt).to(tl.float32)
        x2 = u.to(dt).to(tl.float32)
        j = offs_n % HALF
        cs = cs_ptr + tl.load(pos_ptr).to(tl.int64) * stride_cp  # table [P, 2, D] fp32: cos, then sin
        c1 = tl.load(cs + j).to(dt).to(tl.float32)
        c2 = tl.load(cs + HALF + j).to(dt).to(tl.float32)
        s1 = tl.load(cs + HEAD_DIM + j).to(dt).to(tl.float32)
        s2 = tl.load(cs + HEAD_DIM + HALF + j).to(dt).to(tl.float32)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        rot = offs_a < ROT_ROWS  # q and k heads; v passes through
        tl.store(y_ptr + offs_a, tl.where(rot, o1, x1).to(dt), mask=n_mask)
        tl.store(y_ptr + offs_b, tl.where(rot, o2, x2).to(dt), mask=n_mask)
    else:
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
        if PUSH > 0:  # a TP rank's partial sum, stored in every rank's slot instead of an all-reduce
            _push(y, offs_n, n_mask, push_ptrs, PUSH, dt)
        else:
            tl.store(y_ptr + offs_n, y.to(dt), mask=n_mask)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, DOT: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M <= BLOCK_M: one program per BLOCK_N output features
    streams their weight rows over K once; every tile meets all M rows of x (a few KB, from L1/L2)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w = _load_w(w_ptrs, 0, K, offs_k, n_mask, EVEN_K, EVEN_N)  # before the wait, as in `_gemv_kernel`
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = _load_rows(x_ptrs, 0, K, offs_k, m_mask, EVEN_K, EVEN_M)
    if DOT:  # [BLOCK_N, BLOCK_M]: tensor cores, rows padded with zeros
        acc = tl.dot(w, tl.trans(x), tl.zeros([BLOCK_N, BLOCK_M], tl.float32))
    else:  # elementwise products, one reduction over K at the end
        acc = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w = _load_w(w_ptrs, k, K, offs_k, n_mask, EVEN_K, EVEN_N)
        x = _load_rows(x_ptrs, k, K, offs_k, m_mask, EVEN_K, EVEN_M)
        if DOT:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if DOT:
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:  # F.linear adds the bias before rounding
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _load_rows(x_ptrs, k, K, offs_k, m_mask, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr):
    if EVEN_K:
        if EVEN_M:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs, mask=m_mask[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
    return x


def tile_config(n: int, k: int, silu: bool = False) -> dict:
    """Narrow layers (few programs) want long K tiles and more warps per program to keep enough
    bytes in flight; wide ones (MLP up, LM head) have programs to spare. n: outputs (SiLU: of the
    product, each reading a gate and an up row: `silu`). A TP=2 rank's halved shapes ran 7% faster in a one-GPU
    chain of its layers with longer tiles (qkv 1,024-input tiles, 8 warps; gate/up 256, 5 stages; scripts/
    bench_w4_chain.py --tp 2 --bf16-tiles) but slower in the real batch-1 TP=2 step, whose qkv and gate/up read the
    pushed partial sums (2 x H200, 2026-11-29, one call: 340.9 tok/s against 364.0 and 364.7): not used. Tried for
    those taking GEMVs alone (TANDEM_GEMV_TAKE_TILE; BLOCK_N, BLOCK_K, warps, stages), all slower than this tile's
    384.2-387.3 tok/s: 16/512/4/4 364.5, 8/256/4/6 336.1, 8/1024/8/3 378.8 and 378.6, 8/2048/8/2 307.4; 8/1024/8/3
    on the taking qkv alone was faster (`take_tile`, TAKE_QKV_TILE)."""
    if n <= 8192:
        return dict(BLOCK_N=8, BLOCK_K=512, num_warps=8 if k >= 8192 else 4, num_stages=4)
    return dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def rows_tile_config(m: int, n: int, k: int) -> dict:
    """Tiles of `_gemv_rows_kernel` for m rows (2..MAX_ROWS), from `scripts/bench_gemv.py --rows --sweep`
    on an H100 (2026-11-26): tensor-core tiles with short K steps and deep pipelines won at every row count
    from 2 to 16 and every Llama-3.1-8B shape; the FMA tiles ran at half the bandwidth from 4 rows up."""
    if n <= 8192:  # narrow layers: many small programs
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, DOT=True, num_warps=2, num_stages=6)
    return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT=True, num_warps=4, num_stages=4)


MAX_ROWS = 16  # the most rows `gemv` takes (the rows kernel's largest BLOCK_M)


_MAX_ROWS: int | None = None


def max_rows() -> int:
    """Rows up to which `supports` takes a call: 1 (the one-row GEMV only), or TANDEM_GEMV_ROWS (read once,
    at most MAX_ROWS). The rows kernel is opt-in: it beats cuBLAS per layer, but the one engine run with it
    on (n-gram speculation at batch 1, H100, 2026-11-26) was slower end to end (262 against 281 tok/s),
    for a reason not yet found (docs/benchmarks.md)."""
    global _MAX_ROWS
    if _MAX_ROWS is None:
        _MAX_ROWS = max(1, min(MAX_ROWS, int(os.environ.get("TANDEM_GEMV_ROWS", 1))))
    return _MAX_ROWS


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` takes this call (else the caller uses F.linear): 1..max_rows() rows of 16-bit
    activations on CUDA."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= max_rows() and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and x.stride(-1) == 1 and w.stride(-1) == 1)


MAX_NORM_K = 16384  # the norm prologue holds all of h in registers

TAKE_WAIT_ENV = "TANDEM_TP_TAKE_WAIT"
TAKE_WAIT_MODES = ("grid", "slots")


def take_waits_for_grid() -> bool:
    """Whether a GEMV taking pushed partials (and `sum_pushed`) first waits, under PDL, for the kernel ahead to
    finish (TANDEM_TP_TAKE_WAIT=grid) or only for its slots to fill (`slots`, the default). The kernel ahead is the
    row-parallel GEMV that pushed this rank's own part, and its grid ends only once its stores into the peers' slots
    have landed over NVLink, which this rank does not need. Without the grid wait the take still touches nothing
    another kernel is using: every program of the kernel ahead stores its slice of this rank's part last, after its
    reads, and that kernel waited for the ones before it; so once every slot holds a value, all of them are done.
    Batch-1 TP=2 on 2 x H200, one call: 384.0 / 384.1 tok/s against 382.3 / 382.1 with the grid wait (2026-11-29)."""
    mode = os.environ.get(TAKE_WAIT_ENV, "slots").strip().lower()
    if mode not in TAKE_WAIT_MODES:
        raise ValueError(f"{TAKE_WAIT_ENV}={mode!r}: expected one of {', '.join(TAKE_WAIT_MODES)}")
    return mode == "grid"


def pdl_enabled() -> bool:
    """Programmatic dependent launch for these Triton kernels: `cuda_launch.pdl_supported` (Hopper or newer, not
    TANDEM_PDL=0), and a Triton that has it."""
    return pdl_supported() and hasattr(tl.extra.cuda, "gdc_wait")


TAKE_TILE_ENV = "TANDEM_GEMV_TAKE_TILE"
TAKE_X_ENV = "TANDEM_GEMV_TAKE_X"


def take_x_in_l1() -> bool:
    """TANDEM_GEMV_TAKE_X=l1: a taking GEMV's K loop reads the pushed parts through L1, so the programs of an SM share
    each step's lines, instead of each going to L2 (`l2`, the default). Opt-in until measured (scripts/
    bench_w4_chain.py --take on one GPU). It reads no stale value if an SM's L1 holds no lines of earlier kernels when
    a kernel starts (to be confirmed on GPUs: tests/gpu/test_gemv.py replays the same sites with new values): only
    this loop loads slot addresses into L1 (the waits read them volatile, `sum_pushed` past L1), and it runs after
    the kernel's own wait saw every value arrive in L2."""
    mode = os.environ.get(TAKE_X_ENV, "l2").strip().lower()
    if mode not in ("l1", "l2"):
        raise ValueError(f"{TAKE_X_ENV}={mode!r}: expected 'l1' or 'l2'")
    return mode == "l1"


TILE_KEYS = {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
# The qkv GEMV that takes pushed partials (TP, batch 1) streams longer K tiles with more warps than `tile_config`
# gives its shape: batch-1 TP=2 on 2 x H200, 2026-11-30, two pairs in one call: 390.9 / 391.0 tok/s against 385.7 /
# 385.9 (one GPU 242.8: 1.610x against 1.589x). The same tile on the taking gate/up GEMV was slower (378.8 tok/s with
# both, 2026-11-29; +6.5 us a layer in bench_w4_chain.py --take), so gate/up keeps `tile_config`'s.
TAKE_QKV_TILE = dict(BLOCK_N=8, BLOCK_K=1024, num_warps=8, num_stages=3)


def take_tile(silu: bool = False) -> dict | None:
    """The tile of a GEMV that takes pushed partials (under TP, batch 1: qkv, and gate/up where `silu`), or None for
    `tile_config`'s: by default TAKE_QKV_TILE for qkv and None for gate/up. TANDEM_GEMV_TAKE_TILE replaces that, to
    measure tiles in the real TP step: one JSON tile (BLOCK_N, BLOCK_K, num_warps, num_stages) for both, or
    {"qkv": tile, "gate_up": tile} where a shape left out takes `tile_config`'s."""
    raw = os.environ.get(TAKE_TILE_ENV, "").strip()
    if not raw:
        return None if silu else dict(TAKE_QKV_TILE)
    import json

    try:
        tile = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{TAKE_TILE_ENV}={raw!r}: not JSON ({e})") from None
    if isinstance(tile, dict) and set(tile) <= {"qkv", "gate_up"} and tile:
        for shape, one in tile.items():
            if not isinstance(one, dict) or set(one) != TILE_KEYS:
                raise ValueError(f"{TAKE_TILE_ENV}={raw!r}: {shape}'s tile needs the keys {', '.join(sorted(TILE_KEYS))}")
        return tile.get("gate_up" if silu else "qkv")
    if not isinstance(tile, dict) or set(tile) != TILE_KEYS:
        raise ValueError(f"{TAKE_TILE_ENV}={raw!r}: expected the keys {', '.join(sorted(TILE_KEYS))}, or "
                         "{\"qkv\": tile, \"gate_up\": tile}")
    return tile


@dataclass(frozen=True)
class Rope:
    """Rotate-half RoPE of a fused qkv output: the first `rot_rows` features (q and k heads of
    `head_dim`) at position positions[0], with the [P, 2, head_dim] fp32 cos/sin table."""
    positions: torch.Tensor
    cos_sin: torch.Tensor
    head_dim: int
    rot_rows: int


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         silu: bool = False, rope: Rope | None = None, take=None, push=None) -> torch.Tensor | None:
    """F.linear(x, w, bias) for x [1, K] on CUDA (see `supports`), optionally with the RMSNorm of x
    before, and after it SiLU-and-mul of the [gate; up] halves, RoPE of the q/k heads, or a residual
    add (module docstring). x [M, K] with 1 < M <= MAX_ROWS: the plain product (`gemv_rows`).

    TP partial sums without an all-reduce kernel (`parallel.p2p_allreduce.PushedSite`): `push` stores y, a
    row-parallel rank's partial sum, in every rank's slot at that site and returns None; `take` (with
    `norm_weight`) waits for all ranks' partials at its site, sums them into x (which it writes, not reads)
    and goes on with x as h."""
    if x.shape[0] != 1:
        if norm_weight is not None or residual is not None or silu or rope is not None or take or push:
            raise ValueError(f"gemv: the fused prologue/epilogues take one row, got {x.shape[0]}")
        return gemv_rows(x, w, bias, config)
    if (take is not None and (norm_weight is None or residual is not None)) or (push is not None and (silu or rope)):
        raise ValueError("gemv: `take` goes with the RMSNorm prologue (no residual), `push` with a plain or "
                         "residual epilogue")
    k = x.shape[1]
    n = w.shape[0] // 2 if silu else w.shape[0]
    if norm_weight is not None and k > MAX_NORM_K:
        raise ValueError(f"gemv: the RMSNorm prologue supports K <= {MAX_NORM_K}, got {k}")
    if w.stride(-1) != 1 or x.stride(-1) != 1:  # the kernel walks rows by stride(0) and reads each row densely
        raise ValueError(f"gemv: weight and input rows must be contiguous (strides {tuple(w.stride())}, "
                         f"{tuple(x.stride())}); a transposed view reads other values")
    cfg = dict(config or (take is not None and take_tile(silu)) or tile_config(n, k, silu))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid_n = n
    if rope is not None:  # each program takes BLOCK_N / 2 (row, partner) pairs: the same rows per program
        if n % rope.head_dim or rope.rot_rows % rope.head_dim or rope.head_dim % 2 or rope.cos_sin.stride(-1) != 1:
            raise ValueError("gemv: RoPE needs whole heads of an even head_dim and a contiguous cos/sin table")
        grid_n = n // 2
        cfg["BLOCK_N"] = max(1, min(cfg["BLOCK_N"] // 2, rope.head_dim // 2))
    pdl = x.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    if rope is not None:  # the RoPE products are rounded to the dtype before their sum, as `fused_ops.rope` does
        extra["enable_fp_fusion"] = False
    b = bias if bias is not None else w
    # `take`: the kernel reads h from the site's slots and writes it to x (the residual pointer is free there)
    x_in, r = (take.parts, x) if take is not None else (x, residual if residual is not None else x)
    _gemv_kernel[(triton.cdiv(grid_n, cfg["BLOCK_N"]),)](
        x_in, w, b, w[n:] if silu else w, b[n:] if silu and bias is not None else b, y, norm_weight if norm_weight is not None else x,
        r, rope.positions if rope else x, rope.cos_sin if rope else x, take.reset if take is not None else x,
        push.ptrs if push is not None else x,
        grid_n, k, w.stride(0), rope.cos_sin.stride(0) if rope else 0, eps,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, EVEN_N=grid_n % cfg["BLOCK_N"] == 0,
        NORM=norm_weight is not None, K_PAD=triton.next_power_of_2(k) if norm_weight is not None else 1,
        SILU=silu, RESIDUAL=residual is not None, ROPE=rope is not None, HEAD_DIM=rope.head_dim if rope else 2,
        ROT_ROWS=rope.rot_rows if rope else 0, PAIRED=silu or rope is not None, USE_PDL=pdl,
        PARTS=take.world if take is not None else 0, PUSH=push.world if push is not None else 0,
        GRID_WAIT=take is None or take_waits_for_grid(), PARTS_L1=take is not None and take_x_in_l1(), **cfg, **extra)
    return None if push is not None else y


def sum_pushed(take, h_out: torch.Tensor) -> torch.Tensor:
    """h_out [1, K] = the sum of the partials pushed at site `take` (`gemv(push=...)`), waited for: the
    all-reduce's result where the next kernel is not a fused GEMV."""
    k = h_out.shape[-1]
    pdl = h_out.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    _sum_pushed_kernel[(1,)](take.parts, take.reset, h_out, k, K_PAD=triton.next_power_of_2(k), PARTS=take.world,
                             USE_PDL=pdl, GRID_WAIT=take_waits_for_grid(), num_warps=8, **extra)
    return h_out


def gemv_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              config: dict | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M, K], M <= MAX_ROWS (or the config's BLOCK_M): each weight tile is
    read once for all M rows."""
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(config or rows_tile_config(m, n, k))
    if m > cfg["BLOCK_M"]:
        raise ValueError(f"gemv_rows: {m} rows, the tile takes {cfg['BLOCK_M']}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = x.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    _gemv_rows_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, EVEN_N=n % cfg["BLOCK_N"] == 0,
        EVEN_M=m == cfg["BLOCK_M"], USE_PDL=pdl, **cfg, **extra)
    return y
