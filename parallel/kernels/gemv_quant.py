"""Batch-1 decode GEMV on quantized weights, with the decode step's small ops folded in as in `gemv.py`.

The bf16 fused decoder (workers/models/fused_decode.py) streams each weight once per token through
`gemv.gemv`, with RMSNorm in the prologue and SiLU-and-mul / RoPE / residual add in the epilogue. This is
the same kernel for the weights a quantized layer keeps on CUDA after load, read in place (no second copy):
  - INT4PACK: PyTorch's tinygemm layout (parallel/quant/tinygemm.py; 4-bit GPTQ / AWQ with bf16 activations):
        codes int32 [N/8, K/(32 J), 32, J]   word [nt, ko, t, j] nibble b = 4 lo + 2 i1 + i0 holds row
        8 nt + t // 4, input ko*32J + 32 j + 16 i1 + 8 i0 + 2 (t % 4) + lo  (J = inner_k_tiles / 2)
        sz bf16 [K/GS, N, 2]: w = (q - 8) * scale + zero
    One row's 4J words of one ko tile are contiguous (64 B for J = 4), rows of an 8-row block adjacent.
  - PACKED: the Triton layout (parallel/quant/packed.py; 8-bit GPTQ, fp16 activations, shapes tinygemm lacks):
        codes int32 [N, K / PACK] (code k at word k // PACK, bits (k % PACK) * BITS), scales / zeros [N, G]:
        w = (q - zero) * scale
  - FP8: e4m3 codes [N, K] with float32 scales [N, G] (per channel: G = 1; block-wise: one per GS inputs).
    Weight-only: the e4m3 codes are widened in registers and multiplied with the bf16 activations in fp32
    (W8A16), so the product is x @ dequantized(w) up to fp32 summation order, not the W8A8 `_scaled_mm`
    product of larger batches (which also rounds x to e4m3 per token).
GPTQ act order (`perm`): the codes are stored with K sorted by group; x is gathered through the
permutation (with the RMSNorm weight under NORM), so nothing is permuted in memory.

Integer codes are never converted with I2F (a quarter-rate instruction on Hopper, which bound the earlier
W4A16 GEMV). Three shifted copies of a word (one per 8-bit code) put its codes at bits P = 11, 15, 19 with
the exponent of 2^11 OR'd in; an AND with an immediate then leaves the float 2^11 + c * 2^(P - 12), and with
x pre-scaled by 2^(12 - P) one FFMA adds c x + 2^(23 - P) x to the word's sum: a LOP3 and an FFMA per code
plus 3/4 of a shift and OR (compiled for sm_90 with Triton 3.9: 3.8-4.9 instructions per code in all,
Llama-3.1-8B shapes). The offsets are summed per input once per program and subtracted per word, then the
word's (or a thread's chunk's) group scale and zero are applied once: scale * sum(c x) + zero' * sum(x),
zero' = zero - 8 scale (tinygemm) or -zero * scale. That is x @ the dequantized weight up to fp32 summation
order and the cancellation of the offsets (~1e-4 of the output's scale, under bf16's rounding of it); the
reference rounds nothing more, since (q - z) * s is exact in fp32 for bf16 / fp16 scales.

Tiles: a program owns BLOCK_N output features and walks K in steps of KS chunks of 64 bytes per row, its
codes a [BLOCK_N, KS, 64 B] tensor. Triton gives each thread one 16-byte piece of a chunk for all BLOCK_N
rows, so each x value a thread loads (normed, summed) serves BLOCK_N rows (twice that for the paired SiLU
/ RoPE epilogues), while the K split keeps the programs many on narrow layers; the partial sums are
reduced over the chunks once, before the epilogue. FP8 also has 8- and 16-byte chunks, one per thread, summed in
the thread every step (`_fp8_red_tile`: one fp32 accumulator per row and chunk instead of one per code). Tiles:
`FP8_TABLE` (measured per Llama-3.1-8B shape by `scripts/bench_gemv.py --fp8 --sweep`) where it has the shape,
else `candidates`, which `fused_gemv.tune` measures per weight shape and kind of layer at load, before any graph.

Everything else (the RMSNorm prologue rounded as `RMSNorm` rounds, SiLU-and-mul, RoPE, residual add, bias,
PDL under CUDA-graph capture) is `gemv._gemv_kernel`'s, see there.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from parallel.kernels import gemv as _gemv

INT4PACK, PACKED, FP8 = 0, 1, 2
MAX_NORM_K = _gemv.MAX_NORM_K


@triton.jit
def _row_addr(rows, stride_w, FMT: tl.constexpr, J: tl.constexpr):
    """Element offset of each output row's first code (INT4PACK: its words in an 8-row block)."""
    if FMT == 0:
        addr = (rows // 8).to(tl.int64) * stride_w + (rows % 8) * (4 * J)
    else:
        addr = rows.to(tl.int64) * stride_w
    return addr


@triton.jit
def _chunks(t, KS: tl.constexpr):
    """[KS, 1] indices of the K chunks of step t (each of BLOCK_C words, or bytes for FP8)."""
    return (t * KS + tl.arange(0, KS))[:, None]


@triton.jit
def _col_addr(t, KS: tl.constexpr, BLOCK_C: tl.constexpr, FMT: tl.constexpr, J: tl.constexpr):
    """[KS, BLOCK_C] offsets of step t's words (bytes for FP8) of a row, from its first code. INT4PACK: a chunk
    is one ko tile (BLOCK_C = 4J words of a row, 32J words for the 8-row block)."""
    c = tl.arange(0, BLOCK_C)[None, :]
    if FMT == 0:
        off = _chunks(t, KS) * (32 * J) + c
    else:
        off = _chunks(t, KS) * BLOCK_C + c
    return off


@triton.jit
def _load_codes(w_ptr, row_addr, col, n_mask, EVEN_N: tl.constexpr, FMT: tl.constexpr):
    ptrs = w_ptr + row_addr[:, None, None] + col[None, :, :]  # [BLOCK_N, KS, BLOCK_C]
    if EVEN_N:
        w = tl.load(ptrs)
    else:
        if FMT == 2:
            w = tl.load(ptrs, mask=n_mask[:, None, None], other=0.0)
        else:
            w = tl.load(ptrs, mask=n_mask[:, None, None], other=0)
    return w


@triton.jit
def _step_codes(w_ptr, rows_a, rows_b, t, n_mask, KS: tl.constexpr, BLOCK_C: tl.constexpr, FMT: tl.constexpr,
                J: tl.constexpr, EVEN_N: tl.constexpr, PAIRED: tl.constexpr):
    """Step t's codes of rows_a (and under PAIRED of rows_b; else the same tensor twice)."""
    col = _col_addr(t, KS, BLOCK_C, FMT, J)
    wa = _load_codes(w_ptr, rows_a, col, n_mask, EVEN_N, FMT)
    wb = wa
    if PAIRED:
        wb = _load_codes(w_ptr, rows_b, col, n_mask, EVEN_N, FMT)
    return wa, wb


@triton.jit
def _xq(x_ptr, nw_ptr, perm_ptr, k, rstd, NORM: tl.constexpr, PERM: tl.constexpr):
    """x at (layout order) inputs k, fp32; under NORM the RMSNorm of h there, rounded as `_gemv._load_x`."""
    if PERM:
        k = tl.load(perm_ptr + k)
    x = tl.load(x_ptr + k)
    if NORM:
        nw = tl.load(nw_ptr + k)
        x = (x.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
        x = (nw.to(tl.float32) * x.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


# Code b's bit position after its shift (`_shifted`) is P = 11 + 4 (b % 3) for 4-bit codes (11, 15 or 19) and 11 for 8-bit
# ones. Each helper computes it inline: older Triton cannot return a constexpr from a jit function (the GPU host's
# Triton failed to compile the kernel when P came from one).
@triton.jit
def _shifted(w, b: tl.constexpr, BITS: tl.constexpr):
    """The words shifted so that code b lands in bits 11..22 (left; right where negative), with the exponent of 2^11
    OR'd in (once per copy, not per code). 4-bit: codes 0-2 by 11, 3-5 by -1, 6-7 by -13, so three shifted copies
    serve a word's eight codes; 8-bit: one copy per code, by 11 - 8 b."""
    SH: tl.constexpr = (11 if b < 3 else -1 if b < 6 else -13) if BITS == 4 else 11 - 8 * b
    if SH > 0:
        v = w << SH
    else:
        v = w >> (-SH)
    return v | 0x45000000


@triton.jit
def _code(v, b: tl.constexpr, BITS: tl.constexpr):
    """Code b from its shifted copy v (`_shifted`) as the float 2^11 + c * 2^(P - 12), P = its bit position (11,
    15 or 19): an AND with an immediate keeps the exponent and the code's bits. (OR-ing the exponent here instead,
    one LOP3 with two constants, made ptxas rematerialize a constant per code: more instructions, not fewer.)"""
    P: tl.constexpr = 11 + 4 * (b % 3) if BITS == 4 else 11
    return (v & ((((1 << BITS) - 1) << P) | 0x45000000)).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_x(x, b: tl.constexpr, BITS: tl.constexpr):
    """x times 2^(12 - P) for code b (2, 1/8 or 1/128), so that `_code`'s float times it is c x + 2^(23 - P) x."""
    P: tl.constexpr = 11 + 4 * (b % 3) if BITS == 4 else 11
    return x * (2.0 if P == 11 else 0.125 if P == 15 else 0.0078125)


@triton.jit
def _offset_x(x, b: tl.constexpr, BITS: tl.constexpr):
    """x times 2^(23 - P) (4096, 256 or 16): what `_code` times `_scaled_x` adds per unit of x for code b."""
    P: tl.constexpr = 11 + 4 * (b % 3) if BITS == 4 else 11
    return x * (4096.0 if P == 11 else 256.0 if P == 15 else 16.0)


@triton.jit
def _group_scale(s_ptr, z_ptr, rows, g, stride_s, mask, FMT: tl.constexpr, HAS_ZERO: tl.constexpr):
    """(scale, zero') of output rows `rows` in group g, fp32: w = scale * code + zero'. INT4PACK: stride_s is N
    (scales_and_zeros [K/GS, N, 2])."""
    if FMT == 0:
        p = s_ptr + (g.to(tl.int64) * stride_s + rows) * 2
        s = tl.load(p, mask=mask, other=0.0).to(tl.float32)
        zc = tl.load(p + 1, mask=mask, other=0.0).to(tl.float32) - 8.0 * s
    else:
        off = rows.to(tl.int64) * stride_s + g
        s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zc = -tl.load(z_ptr + off, mask=mask, other=0.0).to(tl.float32) * s
        else:
            zc = s * 0.0
    return s, zc


@triton.jit
def _int_tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, rows_a, rows_b, n_mask, stride_s, rstd,
              FMT: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, J: tl.constexpr, KS: tl.constexpr,
              BLOCK_C: tl.constexpr, NORM: tl.constexpr, PERM: tl.constexpr, PAIRED: tl.constexpr,
              HAS_ZERO: tl.constexpr):
    """acc[n, s, c] += step t's products of word c of chunk s (one group) for rows_a (acc_u: rows_b)."""
    PACK: tl.constexpr = 32 // BITS
    KT: tl.constexpr = BLOCK_C * PACK  # inputs per chunk
    c = tl.arange(0, BLOCK_C)[None, :]
    if FMT == 0:  # word c = J a + j of a ko tile; its code b is input 32 j + 16 i1 + 8 i0 + 2 a + lo of the tile
        k_word = _chunks(t, KS) * KT + (c % J) * 32 + 2 * (c // J)  # [KS, BLOCK_C]
    else:
        k_word = (_chunks(t, KS) * BLOCK_C + c) * PACK
    part = tl.zeros(wa.shape, tl.float32)
    xs = tl.zeros([KS, BLOCK_C], tl.float32)  # sum of x over each word's inputs (for the zero point)
    xo = tl.zeros([KS, BLOCK_C], tl.float32)  # sum of x times the codes' float offsets (`_offset_x`)
    if PAIRED:
        part_u = tl.zeros(wb.shape, tl.float32)
    for b in tl.static_range(PACK):
        if FMT == 0:
            k = k_word + 16 * ((b // 2) % 2) + 8 * (b % 2) + b // 4
        else:
            k = k_word + b
        xb = _xq(x_ptr, nw_ptr, perm_ptr, k, rstd, NORM, PERM)
        xs += xb
        xo += _offset_x(xb, b, BITS)
        if BITS == 8 or b == 0 or b == 3 or b == 6:  # a new shifted copy (`_shifted`)
            va = _shifted(wa, b, BITS)
            if PAIRED:
                vb = _shifted(wb, b, BITS)
        xb = _scaled_x(xb, b, BITS)[None, :, :]
        part += _code(va, b, BITS) * xb
        if PAIRED:
            part_u += _code(vb, b, BITS) * xb
    xs = xs[None, :, :]
    part -= xo[None, :, :]
    if PAIRED:
        part_u -= xo[None, :, :]
    if GS % KT == 0:  # one group per chunk: a thread's 4 words share a scale, so fold them before scaling
        # (the last dim splits as the layout does: 4 threads x 4 words each; the sums stay in the thread)
        g = (_chunks(t, KS) * KT) // GS  # [KS, 1]
        xs = tl.sum(tl.reshape(xs, [1, KS, BLOCK_C // 4, 4]), axis=3)
        s, zc = _group_scale(s_ptr, z_ptr, rows_a[:, None, None], g[None, :, :], stride_s, n_mask[:, None, None],
                             FMT, HAS_ZERO)
        acc += tl.sum(tl.reshape(part, [part.shape[0], KS, BLOCK_C // 4, 4]), axis=3) * s + zc * xs
        if PAIRED:
            s, zc = _group_scale(s_ptr, z_ptr, rows_b[:, None, None], g[None, :, :], stride_s, n_mask[:, None, None],
                                 FMT, HAS_ZERO)
            acc_u += tl.sum(tl.reshape(part_u, [part_u.shape[0], KS, BLOCK_C // 4, 4]), axis=3) * s + zc * xs
    else:  # a group per word
        g = (k_word // GS)[None, :, :]
        s, zc = _group_scale(s_ptr, z_ptr, rows_a[:, None, None], g, stride_s, n_mask[:, None, None], FMT, HAS_ZERO)
        acc += part * s + zc * xs
        if PAIRED:
            s, zc = _group_scale(s_ptr, z_ptr, rows_b[:, None, None], g, stride_s, n_mask[:, None, None], FMT, HAS_ZERO)
            acc_u += part_u * s + zc * xs
    return acc, acc_u


@triton.jit
def _fp8_tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, s_ptr, rows_a, rows_b, n_mask, stride_s, rstd,
              GS: tl.constexpr, KS: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr, PAIRED: tl.constexpr,
              SCALE_END: tl.constexpr, RED: tl.constexpr):
    """acc[n, s, c] += w[n, k] * x[k] over step t's inputs k; with more than one group, each code times its scale.
    RED: acc[n, s, 0] += the chunk's sum instead (`_fp8_red_tile`)."""
    k = _chunks(t, KS) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [KS, BLOCK_C]
    x = _xq(x_ptr, nw_ptr, x_ptr, k, rstd, NORM, False)[None, :, :]
    if RED:
        acc, acc_u = _fp8_red_tile(acc, acc_u, wa, wb, t, x, s_ptr, rows_a, rows_b, n_mask, stride_s, GS, KS, BLOCK_C,
                                   PAIRED, SCALE_END)
    elif SCALE_END:  # one scale per row (per channel): applied once, after the sum
        acc += wa.to(tl.float32) * x
        if PAIRED:
            acc_u += wb.to(tl.float32) * x
    else:
        if GS % BLOCK_C == 0:
            g = ((_chunks(t, KS) * BLOCK_C) // GS)[None, :, :]  # [1, KS, 1]
        else:
            g = (k // GS)[None, :, :]
        sa = tl.load(s_ptr + rows_a[:, None, None].to(tl.int64) * stride_s + g, mask=n_mask[:, None, None], other=0.0)
        acc += (wa.to(tl.float32) * sa) * x
        if PAIRED:
            sb = tl.load(s_ptr + rows_b[:, None, None].to(tl.int64) * stride_s + g, mask=n_mask[:, None, None], other=0.0)
            acc_u += (wb.to(tl.float32) * sb) * x
    return acc, acc_u


@triton.jit
def _fp8_red_tile(acc, acc_u, wa, wb, t, x, s_ptr, rows_a, rows_b, n_mask, stride_s, GS: tl.constexpr,
                  KS: tl.constexpr, BLOCK_C: tl.constexpr, PAIRED: tl.constexpr, SCALE_END: tl.constexpr):
    """FP8 tiles of one 8- or 16-byte vector per row and chunk (BLOCK_C = 8 or 16, `candidates`): Triton gives each
    thread whole chunks, so the sum over a chunk stays in the thread and the accumulator is one fp32 per row and
    chunk, [BLOCK_N, KS, 1], not one per code (the 64-byte chunks' [BLOCK_N, KS, 64] accumulator over 4 threads
    left room for only 4 programs of 2 warps per SM). A block scale (GS a multiple of the chunk) multiplies the
    chunk's sum once, not each code."""
    if SCALE_END or GS % BLOCK_C == 0:
        pa = tl.sum(wa.to(tl.float32) * x, axis=2, keep_dims=True)
        if PAIRED:
            pb = tl.sum(wb.to(tl.float32) * x, axis=2, keep_dims=True)
        if SCALE_END:  # per channel: the row's scale is applied once, after the K loop
            acc += pa
            if PAIRED:
                acc_u += pb
        else:
            g = ((_chunks(t, KS) * BLOCK_C) // GS)[None, :, :]  # [1, KS, 1]
            acc += pa * tl.load(s_ptr + rows_a[:, None, None].to(tl.int64) * stride_s + g, mask=n_mask[:, None, None],
                                other=0.0)
            if PAIRED:
                acc_u += pb * tl.load(s_ptr + rows_b[:, None, None].to(tl.int64) * stride_s + g,
                                      mask=n_mask[:, None, None], other=0.0)
    else:  # groups narrower than a chunk: each code times its own scale
        k = _chunks(t, KS) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        g = (k // GS)[None, :, :]
        sa = tl.load(s_ptr + rows_a[:, None, None].to(tl.int64) * stride_s + g, mask=n_mask[:, None, None], other=0.0)
        acc += tl.sum((wa.to(tl.float32) * sa) * x, axis=2, keep_dims=True)
        if PAIRED:
            sb = tl.load(s_ptr + rows_b[:, None, None].to(tl.int64) * stride_s + g, mask=n_mask[:, None, None], other=0.0)
            acc_u += tl.sum((wb.to(tl.float32) * sb) * x, axis=2, keep_dims=True)
    return acc, acc_u


@triton.jit
def _tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, rows_a, rows_b, n_mask, stride_s, rstd,
          FMT: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, J: tl.constexpr, KS: tl.constexpr,
          BLOCK_C: tl.constexpr, NORM: tl.constexpr, PERM: tl.constexpr, PAIRED: tl.constexpr, HAS_ZERO: tl.constexpr,
          SCALE_END: tl.constexpr, RED: tl.constexpr):
    if FMT == 2:
        acc, acc_u = _fp8_tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, s_ptr, rows_a, rows_b, n_mask, stride_s, rstd,
                               GS, KS, BLOCK_C, NORM, PAIRED, SCALE_END, RED)
    else:
        acc, acc_u = _int_tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, rows_a, rows_b, n_mask,
                               stride_s, rstd, FMT, BITS, GS, J, KS, BLOCK_C, NORM, PERM, PAIRED, HAS_ZERO)
    return acc, acc_u


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, nw_ptr, r_ptr, pos_ptr, cs_ptr, perm_ptr,
                  N, K, UP, T, stride_w, stride_s, stride_cp, eps,
                  FMT: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, J: tl.constexpr,
                  BLOCK_N: tl.constexpr, KS: tl.constexpr, BLOCK_C: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                  EVEN_N: tl.constexpr, NORM: tl.constexpr, K_PAD: tl.constexpr, SILU: tl.constexpr,
                  RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr,
                  PAIRED: tl.constexpr, PERM: tl.constexpr, SCALE_END: tl.constexpr, RED: tl.constexpr,
                  PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, INTERPRETED: tl.constexpr):
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
    rows_a = _row_addr(offs_a, stride_w, FMT, J)
    rows_b = _row_addr(offs_b, stride_w, FMT, J)
    # The first tile of codes does not depend on the previous kernel: under PDL it loads while that one drains.
    wa, wb = _step_codes(w_ptr, rows_a, rows_b, 0, n_mask, KS, BLOCK_C, FMT, J, EVEN_N, PAIRED)
    if PREFETCH:  # and the second (the first again when T = 1): two steps of codes in flight from here on
        na, nb = _step_codes(w_ptr, rows_a, rows_b, tl.minimum(T - 1, 1), n_mask, KS, BLOCK_C, FMT, J, EVEN_N, PAIRED)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x, residual and y's memory belong to earlier kernels: nothing before this touches them
    rstd = 0.0
    if NORM:
        offs_f = tl.arange(0, K_PAD)
        h = tl.load(x_ptr + offs_f, mask=offs_f < K, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) / K + eps)
    # Integer codes with one group per chunk keep a sum per thread's 4 words (`_int_tile`); others one per word / byte.
    ACC_C: tl.constexpr = 1 if RED else BLOCK_C // 4 if FMT != 2 and GS % (BLOCK_C * (32 // BITS)) == 0 else BLOCK_C
    acc = tl.zeros([BLOCK_N, KS, ACC_C], tl.float32)
    acc_u = tl.zeros([BLOCK_N, KS, ACC_C], tl.float32)
    acc, acc_u = _tile(acc, acc_u, wa, wb, 0, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, offs_a, offs_b, n_mask,
                       stride_s, rstd, FMT, BITS, GS, J, KS, BLOCK_C, NORM, PERM, PAIRED, HAS_ZERO, SCALE_END, RED)
    if PREFETCH:  # step t's codes were loaded during step t - 1; this iteration loads step t + 1's
        for t in range(1, T - 1):
            wa, wb = _step_codes(w_ptr, rows_a, rows_b, t + 1, n_mask, KS, BLOCK_C, FMT, J, EVEN_N, PAIRED)
            acc, acc_u = _tile(acc, acc_u, na, nb, t, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, offs_a, offs_b, n_mask,
                               stride_s, rstd, FMT, BITS, GS, J, KS, BLOCK_C, NORM, PERM, PAIRED, HAS_ZERO, SCALE_END, RED)
            na, nb = wa, wb
        if T > 1:
            acc, acc_u = _tile(acc, acc_u, na, nb, T - 1, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, offs_a, offs_b, n_mask,
                               stride_s, rstd, FMT, BITS, GS, J, KS, BLOCK_C, NORM, PERM, PAIRED, HAS_ZERO, SCALE_END, RED)
    else:
        for t in range(1, T):
            wa, wb = _step_codes(w_ptr, rows_a, rows_b, t, n_mask, KS, BLOCK_C, FMT, J, EVEN_N, PAIRED)
            acc, acc_u = _tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, perm_ptr, s_ptr, z_ptr, offs_a, offs_b, n_mask,
                               stride_s, rstd, FMT, BITS, GS, J, KS, BLOCK_C, NORM, PERM, PAIRED, HAS_ZERO, SCALE_END, RED)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    if SCALE_END:  # FP8 per channel
        y *= tl.load(s_ptr + offs_a.to(tl.int64) * stride_s, mask=n_mask, other=0.0)
        u *= tl.load(s_ptr + offs_b.to(tl.int64) * stride_s, mask=n_mask, other=0.0)
    # `gemv._gemv_kernel`'s epilogue (inline: the interpreter resolves libdevice only in the kernel itself)
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


@dataclass
class QuantGemvWeight:
    """One layer's quantized weight as the fused GEMV reads it (views of the tensors the layer already holds).

    fmt INT4PACK: codes int32 [N/8, K/(32J), 32, J], scales = tinygemm's scales_and_zeros [K/GS, N, 2], zeros None.
    fmt PACKED: codes int32 [N, K/PACK], scales / zeros [N, G]. fmt FP8: codes e4m3 [N, K], scales float32 [N, G].
    perm: GPTQ act order (int formats), the input feature of each layout position."""

    fmt: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    bits: int
    n: int
    k: int
    j: int = 1
    perm: torch.Tensor | None = None
    config: dict | None = None

    @property
    def pack(self) -> int:
        return 1 if self.fmt == FP8 else 32 // self.bits

    @property
    def row_stride(self) -> int:
        """Elements between consecutive rows (INT4PACK: between 8-row blocks)."""
        return self.codes.shape[1] * 32 * self.j if self.fmt == INT4PACK else self.codes.stride(0)

    def chunk(self) -> int:
        """BLOCK_C: words (bytes for FP8) of a row per K chunk. INT4PACK: one ko tile (4J words, 32J inputs);
        Triton layout: 16 words; FP8: 64 bytes. A chunk is four 16-byte loads, one per thread of a row."""
        return 4 * self.j if self.fmt == INT4PACK else 16 if self.fmt == PACKED else 64

    def chunks(self) -> int:
        """K chunks of a row (None of a ragged K: `qgemv` needs whole chunks)."""
        per = self.chunk() * self.pack
        return self.k // per if self.k % per == 0 else 0


def default_config(qw: QuantGemvWeight, paired: bool = False) -> dict | None:
    """Tiles without load-time measurement: the first candidate that fits (`candidates`)."""
    cands = candidates(qw, paired)
    return cands[0] if cands else None


# (BLOCK_N output features, KS chunks, num_warps), likeliest first; then tiles for a K of few chunks (test models).
# From register counts and instructions per code compiled for sm_90 (Triton 3.9, Llama-3.1-8B shapes, 4-bit g128):
# 16 rows per thread fit in 168 registers for single products (4.0-4.2 instructions per code), 8 pairs for the
# paired ones (gate/up: 5.1 with the RMSNorm prologue; 16 pairs spill); fewer rows, more programs, more x work.
TILES = {(False, False): ((16, 16, 2), (8, 16, 2), (16, 8, 1)), (False, True): ((8, 16, 2), (8, 8, 1), (4, 16, 2)),
         (True, False): ((8, 16, 2), (8, 8, 1), (4, 32, 4)), (True, True): ((4, 16, 2), (4, 32, 4), (2, 16, 2))}
SMALL_K_TILES = ((4, 4, 1), (8, 2, 1), (8, 1, 1))
# FP8 tiles of 8- or 16-byte chunks summed in the thread (`_fp8_red_tile`), tried before the 64-byte ones above:
# (BLOCK_N, KS, num_warps, BLOCK_C). Compiled for sm_90 by scripts/gemv_fp8_sass.py (Triton 3.9; not yet timed on a
# GPU), K = 4096, residual: the 64-byte (8, 16, 2) takes 213 registers (an [8, 16, 64] fp32 accumulator, 128 a
# thread), so only 4 programs of 2 warps fit an SM, with 3.0 loop instructions per code and 2 barriers a step;
# 16-byte (16, 32, 4) 64 registers, 3.7 per code, 8 barriers a step (x exchanged through shared memory); 8-byte
# (4, 128, 4) / (8, 128, 4) 32 / 48 registers, 4.1 / 3.7 per code and no barrier: each thread's 8 activations are
# one 16-byte load laid out as its codes are, and the chunk's sum is a chain of FMAs. Paired (gate/up with the
# RMSNorm prologue): (2, 128, 4, 8) 32 registers, (8, 32, 4, 16) 72, the 64-byte (4, 16, 2) 216.
FP8_RED_TILES = {False: ((4, 128, 4, 8), (8, 128, 4, 8), (16, 32, 4, 16)),
                 True: ((2, 128, 4, 8), (4, 128, 4, 8), (8, 32, 4, 16))}

# Measured FP8 tiles per weight shape and kind of layer: (N, K, kind) -> config, kind as `fused_gemv.kind_of`
# ("paired": qkv / gate-up with the RMSNorm prologue, "residual": o / down). `fused_gemv.tune` takes an entry as
# is and measures `candidates` only for shapes not here. Filled from `scripts/bench_gemv.py --fp8 --sweep`,
# which prints these lines for the shapes it timed (GPU, batch 1, weights rotated past L2, CUDA graphs).
# Llama-3.1-8B, 2026-11-27: qkv and o on one H100 80GB HBM3 (2213 and 2259 GB/s against 1741 and 1528 for the
# tiles load picked; bf16 2534, 2545), gate_up and down on one H200 with this session's later tiles (3537 and 3473
# GB/s; bf16 on that GPU: 3845, 3896). Another GPU: sweep it and point TANDEM_FP8_TABLE at the JSON.
FP8_TABLE: dict[tuple[int, int, str], dict] = {
    (6144, 4096, "paired"): dict(BLOCK_N=4, KS=64, num_warps=4, num_stages=1, BLOCK_C=16, RED=True),
    (4096, 4096, "residual"): dict(BLOCK_N=2, KS=64, num_warps=4, num_stages=1, BLOCK_C=16, RED=True),
    (28672, 4096, "paired"): dict(BLOCK_N=2, KS=64, num_warps=2, num_stages=1, BLOCK_C=16, RED=True),
    (4096, 14336, "residual"): dict(BLOCK_N=1, KS=256, num_warps=4, num_stages=1, BLOCK_C=8, RED=True),
}


def load_fp8_table(path: str) -> int:
    """Add the fastest tiles of a `scripts/bench_gemv.py --fp8 --sweep` JSON (its rows' n, k, kind, best_config) to
    FP8_TABLE, over its built-in entries: the tiles measured on this GPU. Returns how many it added."""
    import json

    with open(path) as f:
        rows = json.load(f)["results"]
    found = {(r["n"], r["k"], r["kind"]): dict(r["best_config"]) for r in rows if r.get("best_config")}
    FP8_TABLE.update(found)
    return len(found)


# TANDEM_FP8_TABLE=<sweep JSON>: tune once on a GPU, then every engine on that kind of GPU loads those tiles.
if os.environ.get("TANDEM_FP8_TABLE"):
    load_fp8_table(os.environ["TANDEM_FP8_TABLE"])


# Tiles of the 4-bit kernel on tinygemm's layout (gemv_int4.py; "Q4": True), tried before TILES for INT4PACK weights:
# (BLOCK_N, KS, num_warps); a step is KS 16-byte chunks of every row (32 KS inputs), one per thread where KS >= 32 x
# num_warps (K = 4096: one step at KS = 128). Smaller KS for the narrow K of test models. Timed on an H100 (2026-11-27,
# bench_gemv.py --int4 --sweep): every tile slower than tinygemm (gemv_int4.py says why), so no table of them yet.
Q4_TILES = {False: ((8, 128, 4), (4, 64, 2), (8, 32, 1), (8, 16, 1), (8, 8, 1)),
            True: ((4, 128, 4), (4, 64, 2), (4, 32, 1), (4, 16, 1), (4, 8, 1))}


def _fits(qw: QuantGemvWeight, cfg: dict) -> bool:
    if cfg.get("Q4"):
        return qw.fmt == INT4PACK and _q4.fits(qw, cfg)
    per_step = cfg.get("BLOCK_C", qw.chunk()) * qw.pack * cfg["KS"]
    return qw.k % per_step == 0 and (not (cfg.get("RED") or cfg.get("PREFETCH")) or qw.fmt == FP8)


def table_config(qw: QuantGemvWeight, kind: str) -> dict | None:
    """FP8_TABLE's tiles for this weight (FP8, per channel or block-wise), if they fit it."""
    cfg = FP8_TABLE.get((qw.n, qw.k, kind)) if qw.fmt == FP8 else None
    return dict(cfg) if cfg is not None and _fits(qw, cfg) else None


def candidates(qw: QuantGemvWeight, paired: bool = False) -> list[dict]:
    """Tile candidates that fit the weight (a K step divides K), at most three (FP8: four), for the plain /
    residual product or (paired) the SiLU and RoPE epilogues, which stream two rows per output. A program takes
    BLOCK_N outputs and KS chunks of K per step ([BLOCK_N, KS, BLOCK_C] codes). 64-byte chunks: Triton's layout
    puts 4 threads on a chunk, 8 threads and then the warps on the KS chunks, and repeats the rows in each
    thread, so that every thread reuses its x values (loaded, normed and summed per input) over its rows,
    while the K split keeps many programs on a narrow layer (a 4096-row layer in 8-row programs: 512 of
    them). FP8 first tries 8- and 16-byte chunks, one per thread, each summed in the thread (FP8_RED_TILES). Measured
    per shape and kind by `parallel/quant/fused_gemv.tune` where FP8_TABLE has no entry."""
    out = []
    if qw.fmt == INT4PACK:
        out = [dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, Q4=True) for bn, ks, w in Q4_TILES[paired]]
    if qw.fmt == FP8:
        out = [dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1, BLOCK_C=c, RED=True)
               for bn, ks, w, c in FP8_RED_TILES[paired]]
    out += [dict(BLOCK_N=bn, KS=ks, num_warps=w, num_stages=1)
            for bn, ks, w in TILES[(qw.fmt == FP8, paired)] + SMALL_K_TILES]
    return [c for c in out if _fits(qw, c)][:4 if qw.fmt == FP8 else 3]


from parallel.kernels import gemv_int4 as _q4  # noqa: E402  (it imports this module's `_xq`)


def qgemv(x: torch.Tensor, qw: QuantGemvWeight, bias: torch.Tensor | None = None, config: dict | None = None, *,
          norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
          silu: bool = False, rope: _gemv.Rope | None = None) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) for x [1, K], with `gemv.gemv`'s fused RMSNorm prologue and
    SiLU-and-mul / RoPE / residual epilogues (same arguments, same rounding)."""
    if x.shape[0] != 1:
        raise ValueError(f"qgemv: one row, got {x.shape[0]}")
    k = x.shape[1]
    n = qw.n // 2 if silu else qw.n
    if norm_weight is not None and k > MAX_NORM_K:
        raise ValueError(f"qgemv: the RMSNorm prologue supports K <= {MAX_NORM_K}, got {k}")
    cfg = dict(config or qw.config or default_config(qw, silu or rope is not None))
    if cfg.get("W4MMA"):  # 4-bit codes in tinygemm's layout: w4_mma.py's tensor-core kernel (CUDA, NVRTC)
        from parallel.kernels.w4_mma import gemv_w4_mma_fused

        return gemv_w4_mma_fused(x, qw.codes, qw.scales, qw.group_size, qw.n, perm=qw.perm, bias=bias,
                                 norm_weight=norm_weight, eps=eps, residual=residual, silu=silu, rope=rope)
    if cfg.get("Q4"):  # 4-bit codes in tinygemm's layout: gemv_int4.py's kernel
        return _q4.qgemv4(x, qw, bias, cfg, norm_weight=norm_weight, eps=eps, residual=residual, silu=silu, rope=rope)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid_n = n
    if rope is not None:
        if n % rope.head_dim or rope.rot_rows % rope.head_dim or rope.head_dim % 2 or rope.cos_sin.stride(-1) != 1:
            raise ValueError("qgemv: RoPE needs whole heads of an even head_dim and a contiguous cos/sin table")
        grid_n = n // 2  # BLOCK_N counts (row, partner) pairs, as it counts (gate, up) pairs under SiLU
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 1 << ((rope.head_dim // 2).bit_length() - 1))  # a power of two
    pdl = x.is_cuda and torch.cuda.is_current_stream_capturing() and _gemv.pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    if rope is not None:  # the RoPE products are rounded to the dtype before their sum, as `fused_ops.rope` does
        extra["enable_fp_fusion"] = False
    x = x.contiguous()
    s = qw.scales
    block_c, red, prefetch = cfg.pop("BLOCK_C", qw.chunk()), cfg.pop("RED", False), cfg.pop("PREFETCH", False)
    per_step = block_c * qw.pack * cfg["KS"]  # inputs per K step
    if k % per_step or ((red or prefetch) and qw.fmt != FP8):
        raise ValueError(f"qgemv: tile {cfg} does not fit K={k} ({qw.fmt=}; RED and PREFETCH are FP8 only)")
    _qgemv_kernel[(triton.cdiv(grid_n, cfg["BLOCK_N"]),)](
        x, qw.codes, s, qw.zeros if qw.zeros is not None else s, bias if bias is not None else s, y,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x,
        rope.positions if rope else x, rope.cos_sin if rope else x, qw.perm if qw.perm is not None else x,
        grid_n, k, n if silu else 0, k // per_step, qw.row_stride, qw.n if qw.fmt == INT4PACK else s.stride(0),
        rope.cos_sin.stride(0) if rope else 0, eps,
        FMT=qw.fmt, BITS=qw.bits, GS=qw.group_size, J=qw.j, BLOCK_C=block_c, HAS_ZERO=qw.zeros is not None,
        HAS_BIAS=bias is not None, EVEN_N=grid_n % cfg["BLOCK_N"] == 0, NORM=norm_weight is not None,
        K_PAD=triton.next_power_of_2(k) if norm_weight is not None else 1, SILU=silu, RESIDUAL=residual is not None,
        ROPE=rope is not None, HEAD_DIM=rope.head_dim if rope else 2, ROT_ROWS=rope.rot_rows if rope else 0,
        PAIRED=silu or rope is not None, PERM=qw.perm is not None,
        SCALE_END=qw.fmt == FP8 and qw.scales.shape[1] == 1, RED=red, PREFETCH=prefetch, USE_PDL=pdl,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", **cfg, **extra)
    return y
