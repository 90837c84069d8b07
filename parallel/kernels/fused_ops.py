"""Fused elementwise kernels for the CUDA path: RMSNorm (+ residual add), SiLU-and-mul, RoPE, per-head
q/k RMSNorm with RoPE in one launch (Qwen3), and a TP rank's share of the token embedding.

Each reproduces the PyTorch reference in `workers/models/layers.py` rounding step for rounding step
(bf16/fp16 results of every intermediate op are rounded to the model dtype exactly where PyTorch
rounds them), so the fused path gives the same bits as the unfused one; the win is one kernel
(one pass over memory) instead of 5-10 small ones per call, which dominates batch-1 decode.
The CPU path never calls these. Kernels launch with `enable_fp_fusion=False` and use IEEE exp/div
(libdevice, div_rn) where PyTorch's CUDA kernels do.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from parallel.kernels.gemv import _push
from parallel.kernels.quant_gemm import fp8_pad_row, fp8_row
from parallel.quant import fp8_act

# No mul+add -> fma contraction: PyTorch rounds each product to the dtype before the add.
_EXACT = dict(enable_fp_fusion=False)
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"  # the CPU interpreter (kernel tests) has no libdevice


# ---------------------------------------------------------------- RMSNorm

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, M, stride_x, stride_r, stride_o,
                     stride_ro, stride_q, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                     FP8: tl.constexpr):
    """One row per program; with FP8 the grid also covers the W8A8 GEMM's padding rows M.. (zero codes, scale 1)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if FP8:
        if row < M:
            _rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, row, offs, mask, stride_x, stride_r,
                          stride_o, stride_ro, stride_q, eps, N, HAS_RES, True)
        else:
            fp8_pad_row(q_ptr, s_ptr, row, stride_q, offs, mask)
    else:
        _rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, row, offs, mask, stride_x, stride_r,
                      stride_o, stride_ro, stride_q, eps, N, HAS_RES, False)


@triton.jit
def _rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, row, offs, mask, stride_x, stride_r,
                  stride_o, stride_ro, stride_q, eps, N: tl.constexpr, HAS_RES: tl.constexpr, FP8: tl.constexpr):
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # x + residual in the model dtype
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    h = (h * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # h.to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty)  # weight * h
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    if FP8:  # the next linear's W8A8 input, from the rounded output (parallel/quant/fp8_act.py)
        fp8_row(y.to(tl.float32), mask, q_ptr, s_ptr, row, stride_q, offs)


def _fp8_outputs(n: int, fp8_rows: int | None, out: torch.Tensor):
    """(codes [fp8_rows, n] e4m3 and scales [fp8_rows, 1] float32, or None) and the (codes, scales, row stride)
    arguments of a producer kernel asked for FP8 activations (unused pointers otherwise)."""
    if fp8_rows is None:
        return None, (out, out, 0)
    q = torch.empty(fp8_rows, n, dtype=torch.float8_e4m3fn, device=out.device)
    s = torch.empty(fp8_rows, 1, dtype=torch.float32, device=out.device)
    return (q, s), (q, s, q.stride(0))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             fp8_rows: int | None = None):
    """Same contract as layers.RMSNorm.forward: norm(x), or (norm(x + residual), x + residual). `fp8_rows`: also
    write the output's per-token FP8 codes and scales (`quant_fp8_rows` of it, padded to fp8_rows rows) and
    attach them to it for the W8A8 linear that takes it (parallel/quant/fp8_act.py); 16-bit outputs only."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    fp8, (q, s, stride_q) = _fp8_outputs(n, fp8_rows, out)
    block = triton.next_power_of_2(n)
    warps = 4 if block <= 1024 else 8
    if residual is None:
        r2 = res_out = x2
    else:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = max(rows, fp8_rows or 0)  # FP8: padding rows too
    if rows:
        _rms_norm_kernel[(grid,)](x2, r2, weight, out, res_out, q, s, rows, x2.stride(0), r2.stride(0) if residual is not None else 0,
                                  out.stride(0), res_out.stride(0) if residual is not None else 0, stride_q, eps, N=n,
                                  BLOCK=block, HAS_RES=residual is not None, FP8=fp8 is not None, num_warps=warps, **_EXACT)
    y = out.view(shape)
    if fp8 is not None:
        fp8_act.attach(y, *fp8)
    return y if residual is None else (y, res_out.view(shape))


# ---------------------------------------------------------------- SiLU and mul

@triton.jit
def _silu_mul(g, u, LIBDEVICE: tl.constexpr):
    """silu(g) * u as PyTorch rounds it: g fp32 (from the 16-bit gate), u 16-bit; fp32 result of the rounded product."""
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.div_rn(g, 1.0 + e).to(u.dtype)  # F.silu (x / (1 + expf(-x))), rounded to the dtype
    return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    y = _silu_mul(g, u, LIBDEVICE)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, q_ptr, s_ptr, M, stride_x, stride_o, stride_q, N: tl.constexpr,
                             BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """`_silu_and_mul_kernel` with the whole row in one program, so that it can also write the row's FP8 codes and
    scale (`fp8_row`) for the W8A8 down projection; programs M.. write the GEMM's padding rows."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if row < M:
        g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
        y = _silu_mul(g, u, LIBDEVICE)
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        fp8_row(y, mask, q_ptr, s_ptr, row, stride_q, offs)
    else:
        fp8_pad_row(q_ptr, s_ptr, row, stride_q, offs, mask)


MAX_FP8_SILU_N = 32768  # the FP8-emitting SiLU kernel holds a row in registers (16 warps: 64 values a thread)


def silu_and_mul(gate_up: torch.Tensor, fp8_rows: int | None = None) -> torch.Tensor:
    """silu(gate) * up of the [gate; up] halves. `fp8_rows`: also the output's per-token FP8 codes and scales
    (padded to fp8_rows rows), attached to it for the W8A8 down projection (parallel/quant/fp8_act.py); not
    for rows wider than MAX_FP8_SILU_N (the consumer then quantizes them itself)."""
    n = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if fp8_rows is not None and n <= MAX_FP8_SILU_N and rows:
        (q, s), _ = _fp8_outputs(n, fp8_rows, out)
        block = triton.next_power_of_2(n)
        _silu_and_mul_fp8_kernel[(max(rows, fp8_rows),)](
            x2, out, q, s, rows, x2.stride(0), out.stride(0), q.stride(0), N=n, BLOCK=block, LIBDEVICE=_LIBDEVICE,
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **_EXACT)
        return fp8_act.attach(out.view(*gate_up.shape[:-1], n), q, s)
    block = min(2048, triton.next_power_of_2(n))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), N=n,
                                                            BLOCK=block, LIBDEVICE=_LIBDEVICE, num_warps=4, **_EXACT)
    return out.view(*gate_up.shape[:-1], n)


# ---------------------------------------------------------------- RoPE (neox / rotate-half)

@triton.jit
def _rope_rows(x_ptr, out_ptr, w_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, c1, c2, s1, s2, eps,
               H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    """Rotate-half RoPE of one token's heads; under NORM each head is RMS-normed first (with weight
    w_ptr [D]), rounded as `_rms_norm_kernel` rounds it."""
    HALF: tl.constexpr = D // 2
    dt = x_ptr.dtype.element_ty
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF)
    mask = offs_h[:, None] < H
    base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    x1 = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]  # [H_PAD, 1]
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype as PyTorch does
    o1 = ((x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)).to(dt)
    obase = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh
    tl.store(obase + offs_d[None, :], o1, mask=mask)
    tl.store(obase + HALF + offs_d[None, :], o2, mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cp,
                 HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr, D: tl.constexpr,
                 NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    HALF: tl.constexpr = D // 2
    offs_d = tl.arange(0, HALF)
    # table [P, 2, D] fp32, cos then sin, cast to the model dtype as `cos_sin[positions].to(q.dtype)`
    cs = cos_sin_ptr + pos * stride_cp
    dt = q_ptr.dtype.element_ty
    c1 = tl.load(cs + offs_d).to(dt).to(tl.float32)
    c2 = tl.load(cs + HALF + offs_d).to(dt).to(tl.float32)
    s1 = tl.load(cs + D + offs_d).to(dt).to(tl.float32)
    s2 = tl.load(cs + D + HALF + offs_d).to(dt).to(tl.float32)
    _rope_rows(q_ptr, qo_ptr, qw_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, c1, c2, s1, s2, eps, HQ, HQ_PAD, D, NORM)
    _rope_rows(k_ptr, ko_ptr, kw_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, c1, c2, s1, s2, eps, HK, HK_PAD, D, NORM)


def _launch_rope(positions, q, k, cos_sin, q_weight=None, k_weight=None, eps: float = 0.0):
    t, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    qo = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    norm = q_weight is not None
    if t:
        _rope_kernel[(t,)](q, k, qo, ko, q_weight if norm else q, k_weight if norm else k, positions, cos_sin, eps,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1),
                           ko.stride(0), ko.stride(1), cos_sin.stride(0), HQ=hq, HQ_PAD=triton.next_power_of_2(hq),
                           HK=hk, HK_PAD=triton.next_power_of_2(hk), D=d, NORM=norm, num_warps=4, **_EXACT)
    return qo, ko


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor):
    """RMSNorm over each head of q [T, Hq, D] and k [T, Hkv, D] (weights [D]), then RoPE: what
    `rope(positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos_sin)` computes, in one launch."""
    return _launch_rope(positions, q, k, cos_sin, q_weight, k_weight, eps)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D], cos_sin [P, 2, D] fp32 contiguous -> rotated (q, k), new tensors."""
    return _launch_rope(positions, q, k, cos_sin)


# ---------------------------------------------------------------- vocabulary-parallel embedding

@triton.jit
def _vocab_rows_kernel(ids_ptr, w_ptr, out_ptr, push_ptrs, start, rows, stride_w, stride_o, D: tl.constexpr,
                       BLOCK: tl.constexpr, PUSH: tl.constexpr):
    """Program (t, c): columns [c * BLOCK, (c + 1) * BLOCK) of token t's embedding where this rank's slice
    [start, start + rows) holds it, zeros where another rank's does (their sum over the ranks is the embedding).
    PUSH: one token, stored into every rank's slot at a pushed-partials site (gemv.py `_push`) instead of out."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    local = tl.load(ids_ptr + t).to(tl.int64) - start + tl.zeros([BLOCK], tl.int64)  # the token's row, per lane
    mine = (local >= 0) & (local < rows)
    v = tl.load(w_ptr + tl.where(mine, local, 0) * stride_w + offs, mask=mask & mine, other=0.0)
    if PUSH > 0:
        _push(v.to(tl.float32), offs, mask, push_ptrs, PUSH, w_ptr.dtype.element_ty)
    else:
        tl.store(out_ptr + t * stride_o + offs, v, mask=mask)


def vocab_rows(token_ids: torch.Tensor, weight: torch.Tensor, start: int, push=None) -> torch.Tensor | None:
    """token_ids [T] -> [T, D]: each token's row of this rank's vocabulary slice weight [rows, D] (token ids
    start..start + rows), zeros for ids another rank holds: what `VocabParallelEmbedding` all-reduces, in one
    launch where the PyTorch form takes seven (the mask's compares, the shift, the lookup, the fill). push (one
    token): a pushed-partials site (parallel/p2p_allreduce.PushedSite); the row goes into every rank's slot there,
    for the GEMV that takes the site to sum, and None is returned."""
    t, d = token_ids.shape[0], weight.shape[1]
    if weight.stride(1) != 1:
        raise ValueError("vocab_rows: the embedding's rows must be contiguous")
    if push is not None and t != 1:
        raise ValueError(f"vocab_rows: a pushed embedding is one token's, got {t}")
    out = None if push is not None else torch.empty(t, d, dtype=weight.dtype, device=weight.device)
    if t:
        block = min(1024, triton.next_power_of_2(d))
        _vocab_rows_kernel[(t, triton.cdiv(d, block))](
            token_ids, weight, out if out is not None else weight, push.ptrs if push is not None else token_ids,
            start, weight.shape[0], weight.stride(0), d, D=d, BLOCK=block, PUSH=push.world if push is not None else 0,
            num_warps=4)
    return out
