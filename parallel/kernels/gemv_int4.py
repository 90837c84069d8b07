"""Batch-1 decode GEMV on 4-bit codes in tinygemm's layout, read in place, with the fused decoder's prologue and epilogues.

The layout (parallel/quant/tinygemm.py, inner_k_tiles 8: J = 4 words per (row, a) of a 128-input tile ko):
    codes int32 [N/8, K/128, 32, 4]   word [nt, ko, t, j], t = 4 (row % 8) + a, nibble b = 4 lo + 2 i1 + i0 at bits 4b
    holds row 8 nt + t // 4, input 128 ko + 32 j + 16 i1 + 8 i0 + 2 a + lo
    sz bf16 [K/GS, N, 2]: w = (q - 8) * scale + zero
A row's 16 words of a tile are contiguous (64 bytes), ordered (a, j). A *chunk* here is 16 bytes: the 4 words (j = 0..3)
of one (row, tile, a), 32 codes, one vector load. Chunk c of a row starts at word 128 (c // 4) + 4 (c % 4) of its 8-row
block; word j's nibble b is input 128 (c // 4) + 2 (c % 4) + 32 j + OFF[b], OFF = (0, 8, 16, 24, 1, 9, 17, 25).

Why another kernel: gemv_quant's integer path spent 3.8-4.9 SASS instructions per code and reached 107-504 GB/s. Here a
thread owns whole chunks (Triton's layout for a [BLOCK_N, KS, 4] int32 tile with KS >= 32 x num_warps: one 16-byte load
per row and chunk), so each x value it loads serves its BLOCK_N rows (2 BLOCK_N when paired), nothing crosses threads
until the final sum over chunks, and per code the loop is one FFMA, one LOP3 and half a shift:
  - four shifts of a word (<< 15, << 7, >> 1, >> 9) put nibbles (0, 1), (2, 3), (4, 5), (6, 7) at bits 15 and 19;
  - `(v & mask) | 0x43800000` is the float 256 + c (bit 15) or 256 + 16 c (bit 19): exact, no I2F;
  - x for a bit-19 nibble is pre-scaled by 1/16 (exact), so every product is c x + 256 x' (x' the scaled x): the
    word's sum minus 256 sum(x') is sum(c x), exact up to fp32 rounding of sums ~32x larger than it (~2^-19 relative).
Then per word and row: w x = scale * sum(c x) + (zero - 8 scale) * sum(x), applied once per chunk (a 128-input tile
lies in one group when GS >= 128) or per word (GS 32 / 64). The result is x @ the dequantized weight up to fp32 summation
order and that cancellation (tests: tests/test_gemv_int4_interpreted.py, tests/gpu/test_gemv_quant.py).

Measured (one H100, 2026-11-27, `scripts/bench_gemv.py --int4 --sweep`, CUDA graphs, weights past L2): 600-850 GB/s
of int4 bytes on the qkv / o shapes (best tiles 2x32x1 and 4x64x2), against ~1,300 for tinygemm's bare product and
~2,530 for the bf16 GEMV; gate/up (RMSNorm + SiLU) 54.0 us, 1,156 GB/s, against tinygemm's 33.7 us (1,850) and the
bf16 GEMV's 84.2 (2,790); down, timed cold at load only, 63-85 us against tinygemm's 25. So it is opt-in
(parallel/quant/fused_gemv.py). Compiled for sm_90 it spends 4.2 SASS instructions per code on o
(residual, 8 rows a thread), 5.1-6.8 on gate/up with the RMSNorm prologue; at 3 TB/s of 4-bit codes an H100 has
about 5 instruction slots per code in all, so this CUDA-core kernel is issue-bound well below HBM speed. The way on
is tensor cores (what the layout is made for: a word's nibble pairs are mma.m16n8k16 B-fragment registers after one
LOP3 each, and tinygemm itself runs at half of HBM here), not more tuning of this loop.

K steps: KS chunks of every row per step (KS x 32 inputs); K = 4096 with KS = 128 is one step, all codes loaded before
the PDL wait. With more steps the next step's codes are loaded before the current one is summed (two in flight).
GPTQ act order (`perm`) gathers x through the permutation, as gemv_quant does. Prologue / epilogues (RMSNorm rounded as
`RMSNorm`, SiLU-and-mul, RoPE, residual, bias, PDL) are gemv_quant's, with the same arguments and rounding.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from parallel.kernels import gemv as _gemv
from parallel.kernels.gemv_quant import _xq


@triton.jit
def _words(w_ptr, rows, t, n_mask, KS: tl.constexpr, EVEN_N: tl.constexpr):
    """[BLOCK_N, KS, 4] int32: step t's chunks of each row (rows: the element offset of the row in its 8-row block)."""
    c = t * KS + tl.arange(0, KS)
    col = ((c // 4) * 128 + (c % 4) * 4)[:, None] + tl.arange(0, 4)[None, :]
    ptrs = w_ptr + rows[:, None, None] + col[None, :, :]
    if EVEN_N:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=n_mask[:, None, None], other=0)
    return w


@triton.jit
def _nibble(w, b: tl.constexpr, EXP):
    """Nibble b of each word as the float 256 + c (b even: the code lands at bit 15, EXP = 256.0's bits) or 16 + c
    (b odd: bit 19, EXP = 16.0's). EXP is a kernel argument: as a register it makes `(v & mask) | EXP` one LOP3 (a
    LOP3 has one immediate; with both constant, ptxas emitted an AND and an OR per code)."""
    if b // 2 == 0:
        v = w << 15
    elif b // 2 == 1:
        v = w << 7
    elif b // 2 == 2:
        v = w >> 1
    else:
        v = w >> 9
    if b % 2 == 0:
        v = (v & 0x00078000) | EXP
    else:
        v = (v & 0x00780000) | EXP
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _x2(x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, k, rstd, NORM: tl.constexpr, PERM: tl.constexpr,
        PAIRS: tl.constexpr):
    """x at inputs k and k + 1 (k even) in fp32, as `gemv_quant._xq` gives them (under NORM the RMSNorm of h there).
    PAIRS (bf16, no act order): one 4-byte load per pair, split with a shift and an AND (a bf16's fp32 bits are its
    16 bits shifted up)."""
    if PAIRS:
        v = tl.load(x32_ptr + k // 2)
        xl = (v << 16).to(tl.float32, bitcast=True)
        xh = (v & -65536).to(tl.float32, bitcast=True)
        if NORM:
            nv = tl.load(nw32_ptr + k // 2)
            xl = (xl * rstd).to(tl.bfloat16).to(tl.float32)
            xh = (xh * rstd).to(tl.bfloat16).to(tl.float32)
            xl = ((nv << 16).to(tl.float32, bitcast=True) * xl).to(tl.bfloat16).to(tl.float32)
            xh = ((nv & -65536).to(tl.float32, bitcast=True) * xh).to(tl.bfloat16).to(tl.float32)
    else:
        xl = _xq(x_ptr, nw_ptr, perm_ptr, k, rstd, NORM, PERM)
        xh = _xq(x_ptr, nw_ptr, perm_ptr, k + 1, rstd, NORM, PERM)
    return xl, xh


@triton.jit
def _scale_zero(sz_ptr, rows, g, NS, mask):
    """(scale, zero - 8 scale) in fp32 of output rows `rows` in group g: sz viewed as int32 [K/GS, N], scale in the
    low 16 bits (a bf16's fp32 bits are its 16 bits shifted up)."""
    v = tl.load(sz_ptr + g.to(tl.int64) * NS + rows, mask=mask, other=0)
    s = (v << 16).to(tl.float32, bitcast=True)
    z = (v & -65536).to(tl.float32, bitcast=True)
    return s, z - 8.0 * s


@triton.jit
def _word(wa, wb, k, x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, rstd, EXP_E, EXP_O, NORM: tl.constexpr,
          PERM: tl.constexpr, PAIRS: tl.constexpr, PAIRED: tl.constexpr):
    """For one word per row and chunk (wa, and under PAIRED wb: [BLOCK_N, KS]) whose nibble 0 is input k [KS]: the sums
    over its 8 codes of c x per row (pa, pb) and the sum of its 8 x [KS]. Nibbles i and i + 4 are inputs k + 8 i and
    k + 8 i + 1; each x serves both tiles (loaded, normed and summed once)."""
    pa = tl.zeros(wa.shape, tl.float32)
    pb = tl.zeros(wb.shape, tl.float32)
    se = tl.zeros(k.shape, tl.float32)  # x of the even nibbles (offset 256 x each), then of the odd ones (16 x)
    so = tl.zeros(k.shape, tl.float32)
    for i in tl.static_range(4):
        xl, xh = _x2(x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, k + 8 * i, rstd, NORM, PERM, PAIRS)
        exp = EXP_E if i % 2 == 0 else EXP_O
        if i % 2 == 0:
            se += xl + xh
        else:
            so += xl + xh
        pa += _nibble(wa, i, exp) * xl[None, :]
        pa += _nibble(wa, i + 4, exp) * xh[None, :]
        if PAIRED:
            pb += _nibble(wb, i, exp) * xl[None, :]
            pb += _nibble(wb, i + 4, exp) * xh[None, :]
    off = (256.0 * se + 16.0 * so)[None, :]
    return pa - off, pb - off, se + so


@triton.jit
def _split4(w):
    """[BLOCK_N, KS, 4] -> its four [BLOCK_N, KS] words (the last dim is one thread's 16-byte load: no data moves)."""
    w02, w13 = tl.split(tl.reshape(w, [w.shape[0], w.shape[1], 2, 2]))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    return w0, w1, w2, w3


@triton.jit
def _apply(acc, p, xs, sz_ptr, rows, g, NS, n_mask):
    """acc [BLOCK_N, KS] += scale * p + (zero - 8 scale) * xs for group g [KS] of each row."""
    s, zc = _scale_zero(sz_ptr, rows[:, None], g[None, :], NS, n_mask[:, None])
    return acc + s * p + zc * xs[None, :]


@triton.jit
def _step(acc, acc_u, wa, wb, t, x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, sz_ptr, offs_a, offs_b, n_mask, NS, rstd,
          EXP_E, EXP_O, GS: tl.constexpr, KS: tl.constexpr, NORM: tl.constexpr, PERM: tl.constexpr,
          PAIRED: tl.constexpr, PAIRS: tl.constexpr):
    """acc[n, s] (acc_u: the paired rows) += step t's chunk s (4 words) of row n times x. A chunk lies in one group when
    GS >= 128: its words are summed, then scaled once; groups of 32 / 64 inputs scale each word."""
    c = t * KS + tl.arange(0, KS)
    k0 = (c // 4) * 128 + 2 * (c % 4)  # [KS]: each chunk's word 0, nibble 0
    ws_a = _split4(wa)
    ws_b = _split4(wb) if PAIRED else ws_a
    pa_sum = tl.zeros(acc.shape, tl.float32)
    pb_sum = tl.zeros(acc_u.shape, tl.float32)
    xs_sum = tl.zeros(k0.shape, tl.float32)
    for j in tl.static_range(4):
        pa, pb, xs = _word(ws_a[j], ws_b[j], k0 + 32 * j, x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, rstd, EXP_E,
                           EXP_O, NORM, PERM, PAIRS, PAIRED)
        if GS % 128 == 0:
            pa_sum += pa
            pb_sum += pb
            xs_sum += xs
        else:
            acc = _apply(acc, pa, xs, sz_ptr, offs_a, (k0 + 32 * j) // GS, NS, n_mask)
            if PAIRED:
                acc_u = _apply(acc_u, pb, xs, sz_ptr, offs_b, (k0 + 32 * j) // GS, NS, n_mask)
    if GS % 128 == 0:
        acc = _apply(acc, pa_sum, xs_sum, sz_ptr, offs_a, k0 // GS, NS, n_mask)
        if PAIRED:
            acc_u = _apply(acc_u, pb_sum, xs_sum, sz_ptr, offs_b, k0 // GS, NS, n_mask)
    return acc, acc_u


@triton.jit
def _epilogue(y, u, offs_n, offs_a, offs_b, n_mask, y_ptr, b_ptr, r_ptr, pos_ptr, cs_ptr, stride_cp,
              HAS_BIAS: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, ROPE: tl.constexpr,
              HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr, INTERPRETED: tl.constexpr):
    """`gemv._gemv_kernel`'s epilogue on y (rows offs_a) and u (offs_b: the up half, or the RoPE partners)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = y_ptr.dtype.element_ty
    if HAS_BIAS:
        if not RESIDUAL:  # column-parallel: F.linear adds the bias before rounding
            y += tl.load(b_ptr + offs_a, mask=n_mask, other=0.0).to(tl.float32)
    if ROPE:
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
            if HAS_BIAS:
                u += tl.load(b_ptr + offs_b, mask=n_mask, other=0.0).to(tl.float32)
            g = y.to(dt).to(tl.float32)
            if INTERPRETED:  # the interpreter has no libdevice; numpy's exp is exact there
                s = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dt)
            else:
                s = tl.div_rn(g, 1.0 + libdevice.exp(-g)).to(dt)  # F.silu, rounded to the dtype
            y = s.to(tl.float32) * u.to(dt).to(tl.float32)
        if RESIDUAL:  # row-parallel: round, add the bias (rounded), add the residual stream (rounded)
            if HAS_BIAS:
                y = y.to(dt).to(tl.float32) + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            y = y.to(dt).to(tl.float32) + tl.load(r_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(dt), mask=n_mask)


@triton.jit
def _int4_kernel(x_ptr, x32_ptr, w_ptr, sz_ptr, b_ptr, y_ptr, nw_ptr, nw32_ptr, r_ptr, pos_ptr, cs_ptr, perm_ptr,
                 N, K, UP, stride_w, NS, stride_cp, eps, EXP_E, EXP_O,
                 T: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, KS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_N: tl.constexpr, NORM: tl.constexpr, K_PAD: tl.constexpr, SILU: tl.constexpr,
                 RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr,
                 PAIRED: tl.constexpr, PERM: tl.constexpr, PAIRS: tl.constexpr, USE_PDL: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output features; under ROPE, (row, row + D/2) pairs
    n_mask = offs_n < N
    if ROPE:
        offs_a = (offs_n // HALF) * HEAD_DIM + offs_n % HALF
        offs_b = offs_a + HALF
    else:
        offs_a = offs_n
        offs_b = offs_n + UP  # SILU: the "up" rows; otherwise unused
    rows_a = (offs_a // 8).to(tl.int64) * stride_w + (offs_a % 8) * 16
    rows_b = (offs_b // 8).to(tl.int64) * stride_w + (offs_b % 8) * 16
    # The first step's codes do not depend on the previous kernel: under PDL they load while that one drains.
    wa = _words(w_ptr, rows_a, 0, n_mask, KS, EVEN_N)
    wb = wa
    if PAIRED:
        wb = _words(w_ptr, rows_b, 0, n_mask, KS, EVEN_N)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, residual and y's memory belong to earlier kernels: nothing before this touches them
    rstd = 0.0
    if NORM:
        offs_f = tl.arange(0, K_PAD)
        h = tl.load(x_ptr + offs_f, mask=offs_f < K, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, KS], tl.float32)
    acc_u = tl.zeros([BLOCK_N, KS], tl.float32)
    for t in range(1, T):  # step t's codes load before step t - 1's are summed: two steps in flight
        na = _words(w_ptr, rows_a, t, n_mask, KS, EVEN_N)
        nb = na
        if PAIRED:
            nb = _words(w_ptr, rows_b, t, n_mask, KS, EVEN_N)
        acc, acc_u = _step(acc, acc_u, wa, wb, t - 1, x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, sz_ptr, offs_a, offs_b,
                           n_mask, NS, rstd, EXP_E, EXP_O, GS, KS, NORM, PERM, PAIRED, PAIRS)
        wa, wb = na, nb
    acc, acc_u = _step(acc, acc_u, wa, wb, T - 1, x_ptr, x32_ptr, nw_ptr, nw32_ptr, perm_ptr, sz_ptr, offs_a, offs_b,
                       n_mask, NS, rstd, EXP_E, EXP_O, GS, KS, NORM, PERM, PAIRED, PAIRS)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _epilogue(tl.sum(acc, axis=1), tl.sum(acc_u, axis=1), offs_n, offs_a, offs_b, n_mask, y_ptr, b_ptr, r_ptr, pos_ptr,
              cs_ptr, stride_cp, HAS_BIAS, SILU, RESIDUAL, ROPE, HEAD_DIM, ROT_ROWS, INTERPRETED)


EXP_E, EXP_O = 0x43800000, 0x41800000  # 256.0 and 16.0: `_nibble`'s exponents for the even and odd nibbles


def fits(qw, cfg: dict) -> bool:
    """Whether this kernel takes the weight (tinygemm layout with 4-word (row, a) runs: inner_k_tiles 8) with tile cfg."""
    return qw.j == 4 and qw.bits == 4 and qw.k % (32 * cfg["KS"]) == 0 and qw.group_size % 32 == 0


def qgemv4(x: torch.Tensor, qw, bias: torch.Tensor | None, cfg: dict, *, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, residual: torch.Tensor | None = None, silu: bool = False,
           rope: _gemv.Rope | None = None) -> torch.Tensor:
    """`gemv_quant.qgemv` for an INT4PACK weight (`QuantGemvWeight`, j = 4) with this kernel's tile cfg (BLOCK_N, KS,
    num_warps); same arguments, same result up to fp32 summation order."""
    k = x.shape[1]
    n = qw.n // 2 if silu else qw.n
    cfg = {key: v for key, v in cfg.items() if key in ("BLOCK_N", "KS", "num_warps", "num_stages")}
    if not fits(qw, cfg):
        raise ValueError(f"qgemv4: tile {cfg} does not fit K={k}, j={qw.j}, group {qw.group_size}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid_n = n
    if rope is not None:
        if n % rope.head_dim or rope.rot_rows % rope.head_dim or rope.head_dim % 2 or rope.cos_sin.stride(-1) != 1:
            raise ValueError("qgemv4: RoPE needs whole heads of an even head_dim and a contiguous cos/sin table")
        grid_n = n // 2  # BLOCK_N counts (row, partner) pairs, as it counts (gate, up) pairs under SiLU
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 1 << ((rope.head_dim // 2).bit_length() - 1))
    pdl = x.is_cuda and torch.cuda.is_current_stream_capturing() and _gemv.pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    if rope is not None:  # the RoPE products are rounded to the dtype before their sum, as `fused_ops.rope` does
        extra["enable_fp_fusion"] = False
    x = x.contiguous()
    sz = qw.scales.view(torch.int32)  # [K/GS, N]: (scale, zero) bf16 pairs
    # bf16 x (and norm weight) without act order: x read as int32 pairs (`_x2`)
    pairs = x.dtype == torch.bfloat16 and qw.perm is None and (norm_weight is None or norm_weight.dtype == x.dtype)
    nw = norm_weight if norm_weight is not None else x
    _int4_kernel[(triton.cdiv(grid_n, cfg["BLOCK_N"]),)](
        x, x.view(torch.int32) if pairs else x, qw.codes, sz, bias if bias is not None else x, y, nw,
        nw.contiguous().view(torch.int32) if pairs else nw, residual if residual is not None else x,
        rope.positions if rope else x, rope.cos_sin if rope else x, qw.perm if qw.perm is not None else x,
        grid_n, k, n if silu else 0, qw.row_stride, qw.n, rope.cos_sin.stride(0) if rope else 0, eps,
        EXP_E, EXP_O, T=k // (32 * cfg["KS"]), GS=qw.group_size, HAS_BIAS=bias is not None,
        EVEN_N=grid_n % cfg["BLOCK_N"] == 0, NORM=norm_weight is not None,
        K_PAD=triton.next_power_of_2(k) if norm_weight is not None else 1, SILU=silu, RESIDUAL=residual is not None,
        ROPE=rope is not None, HEAD_DIM=rope.head_dim if rope else 2, ROT_ROWS=rope.rot_rows if rope else 0,
        PAIRED=silu or rope is not None, PERM=qw.perm is not None, PAIRS=pairs, USE_PDL=pdl,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", **cfg, **extra)
    return y
