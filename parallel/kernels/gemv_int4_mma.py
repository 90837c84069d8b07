"""Batch-1 4-bit GEMV on tensor cores, tinygemm's layout read in place (experimental: `scripts/bench_gemv.py --int4`).

gemv_int4.py's CUDA-core loop needs an FFMA, a LOP3 and half a shift per code plus the x work, 4-7 SASS instructions a
code in all: issue-bound well below HBM speed. Here the products go to the tensor cores (tl.dot, fp32 accumulation),
so a code costs only its dequantization: per two codes one PRMT, half a shift, one LOP3 and one bf16x2 FMA
(`_deq`: the magic-number conversion, (q & 15) | 0x4300 is the bf16 128 + q, minus 136 gives q - 8 exactly).

For one 128-input tile ko (one group: GS a multiple of 128) a row's 16 words (a, j) hold nibble b of input
    32 j + 16 i1 + 8 i0 + 2 a + lo     (b = 4 lo + 2 i1 + i0)
so for each b the tile is a [BLOCK_N, 16] bf16 matrix (row, word) of q - 8, and the product with x is a dot with the
[16, 16] matrix whose column 0 holds x at those inputs (the other columns 0: a batch of one padded to the tensor cores'
16). Eight such dots per tile into a fresh fp32 [BLOCK_N, 16], then scale * that + (zero - 8 scale) * sum(x) per row;
x is gathered (and RMS-normed) once per program and tile, for all its rows. Exact: q - 8 and bf16 x multiply exactly
and accumulate in fp32, so the result is x @ the dequantized weight up to fp32 summation order. bf16 activations
only (x is a bf16 dot operand). Epilogues and prologue as gemv_int4 (shared code).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from parallel.kernels import gemv as _gemv
from parallel.kernels.gemv_int4 import _epilogue, _scale_zero
from parallel.kernels.gemv_quant import _xq

# Two words in, nibble b of each out as bf16 (q - 8): PRMT puts byte b // 2 of the first word in byte 0 and of the second
# in byte 2 ($3: the selector), the shift ($5: 0 or 4) brings the nibble to bits 0-3 / 16-19, one LOP3 keeps it and ORs
# in 128.0's bits, one FMA subtracts 136. With pack=2 each output half belongs to its own input word.
_DEQ_ASM = tl.constexpr("""{
.reg .b32 t, one, neg;
prmt.b32 t, $1, $2, $3;
shr.b32 t, t, $5;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea;
mov.b32 one, 0x3F803F80;
mov.b32 neg, 0xC308C308;
fma.rn.bf16x2 $0, t, one, neg;
}""")


@triton.jit
def _deq(w, b: tl.constexpr, INTERPRETED: tl.constexpr):
    """[BLOCK_N, 16] int32 words -> nibble b of each, minus 8, as bf16 (exact)."""
    if INTERPRETED:  # the interpreter runs no PTX: the same values in plain ops
        q = (((w >> (4 * b)) & 15) - 8).to(tl.float32).to(tl.bfloat16)
    else:
        sel = tl.full(w.shape, (b // 2) | ((4 + b // 2) << 8), tl.int32)
        sh = tl.full(w.shape, 4 * (b % 2), tl.int32)
        q = tl.inline_asm_elementwise(_DEQ_ASM, "=r,r,r,r,r,r,r", [w, sel, sh], dtype=tl.bfloat16, is_pure=True, pack=2)
    return q


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b on tensor cores; the interpreter's bf16 dot is wrong, so there the same exact values in fp32."""
    if INTERPRETED:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, perm_ptr, sz_ptr, offs_a, offs_b, n_mask, NS, rstd,
          GS: tl.constexpr, NORM: tl.constexpr, PERM: tl.constexpr, PAIRED: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc (acc_u) [BLOCK_N, 16] += tile t's products of rows offs_a (offs_b), column 0 holding them."""
    widx = tl.arange(0, 16)
    kw = t * 128 + 32 * (widx % 4) + 2 * (widx // 4)  # word (a = widx // 4, j = widx % 4): input of its nibble 0
    col0 = tl.arange(0, 16)[None, :] == 0
    pa = tl.zeros(acc.shape, tl.float32)
    pb = tl.zeros(acc_u.shape, tl.float32)
    xs = tl.zeros([16], tl.float32)
    for b in tl.static_range(8):
        xb = _xq(x_ptr, nw_ptr, perm_ptr, kw + (16 * ((b // 2) % 2) + 8 * (b % 2) + b // 4), rstd, NORM, PERM)
        xs += xb
        xm = tl.where(col0, xb[:, None], 0.0).to(tl.bfloat16)  # [16 words, 16]: x in column 0
        pa = _dot(_deq(wa, b, INTERPRETED), xm, pa, INTERPRETED)
        if PAIRED:
            pb = _dot(_deq(wb, b, INTERPRETED), xm, pb, INTERPRETED)
    xsum = tl.sum(xs, axis=0)
    g = tl.full([1], 0, tl.int32) + (t * 128) // GS  # a tensor also where the interpreter's t is a Python int
    s, zc = _scale_zero(sz_ptr, offs_a, g, NS, n_mask)  # zc = zero - 8 scale; the dots already hold q - 8
    acc += s[:, None] * pa + tl.where(col0, (zc + 8.0 * s)[:, None] * xsum, 0.0)
    if PAIRED:
        s, zc = _scale_zero(sz_ptr, offs_b, g, NS, n_mask)
        acc_u += s[:, None] * pb + tl.where(col0, (zc + 8.0 * s)[:, None] * xsum, 0.0)
    return acc, acc_u


@triton.jit
def _mma_kernel(x_ptr, w_ptr, sz_ptr, b_ptr, y_ptr, nw_ptr, r_ptr, pos_ptr, cs_ptr, perm_ptr,
                N, K, UP, stride_w, NS, stride_cp, eps,
                T: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                EVEN_N: tl.constexpr, NORM: tl.constexpr, K_PAD: tl.constexpr, SILU: tl.constexpr,
                RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr,
                PAIRED: tl.constexpr, PERM: tl.constexpr, USE_PDL: tl.constexpr, INTERPRETED: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if ROPE:
        offs_a = (offs_n // HALF) * HEAD_DIM + offs_n % HALF
        offs_b = offs_a + HALF
    else:
        offs_a = offs_n
        offs_b = offs_n + UP
    widx = tl.arange(0, 16)[None, :]
    pa_ptr = w_ptr + ((offs_a // 8).to(tl.int64) * stride_w + (offs_a % 8) * 16)[:, None] + widx
    pb_ptr = w_ptr + ((offs_b // 8).to(tl.int64) * stride_w + (offs_b % 8) * 16)[:, None] + widx
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if NORM:
        offs_f = tl.arange(0, K_PAD)
        h = tl.load(x_ptr + offs_f, mask=offs_f < K, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], tl.float32)
    for t in range(0, T):
        if EVEN_N:
            wa = tl.load(pa_ptr + t * 128)
        else:
            wa = tl.load(pa_ptr + t * 128, mask=n_mask[:, None], other=0)
        wb = wa
        if PAIRED:
            if EVEN_N:
                wb = tl.load(pb_ptr + t * 128)
            else:
                wb = tl.load(pb_ptr + t * 128, mask=n_mask[:, None], other=0)
        acc, acc_u = _tile(acc, acc_u, wa, wb, t, x_ptr, nw_ptr, perm_ptr, sz_ptr, offs_a, offs_b, n_mask, NS, rstd,
                           GS, NORM, PERM, PAIRED, INTERPRETED)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _epilogue(tl.sum(acc, axis=1), tl.sum(acc_u, axis=1), offs_n, offs_a, offs_b, n_mask, y_ptr, b_ptr, r_ptr, pos_ptr,
              cs_ptr, stride_cp, HAS_BIAS, SILU, RESIDUAL, ROPE, HEAD_DIM, ROT_ROWS, INTERPRETED)


def fits(qw, cfg: dict, dtype: torch.dtype = torch.bfloat16) -> bool:
    """inner_k_tiles 8 (16 words a row and tile), groups of whole tiles, bf16 x, at least 16 rows a program (tl.dot)."""
    return (qw.j == 4 and qw.bits == 4 and qw.k % 128 == 0 and qw.group_size % 128 == 0 and dtype == torch.bfloat16
            and cfg["BLOCK_N"] >= 16)


def qgemv_mma(x: torch.Tensor, qw, bias: torch.Tensor | None, cfg: dict, *, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0, residual: torch.Tensor | None = None, silu: bool = False,
              rope: _gemv.Rope | None = None) -> torch.Tensor:
    """`gemv_quant.qgemv` for an INT4PACK weight on tensor cores (cfg: BLOCK_N >= 16, num_warps, num_stages)."""
    k = x.shape[1]
    n = qw.n // 2 if silu else qw.n
    cfg = {key: v for key, v in cfg.items() if key in ("BLOCK_N", "num_warps", "num_stages")}
    if not fits(qw, cfg, x.dtype):
        raise ValueError(f"qgemv_mma: tile {cfg} does not fit (K={k}, j={qw.j}, group {qw.group_size}, {x.dtype})")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid_n = n
    if rope is not None:
        if n % rope.head_dim or rope.rot_rows % rope.head_dim or rope.head_dim % 2 or rope.cos_sin.stride(-1) != 1:
            raise ValueError("qgemv_mma: RoPE needs whole heads of an even head_dim and a contiguous cos/sin table")
        grid_n = n // 2
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 1 << ((rope.head_dim // 2).bit_length() - 1))
        if cfg["BLOCK_N"] < 16:
            raise ValueError("qgemv_mma: RoPE pairs of a head_dim under 32 leave fewer than 16 rows a program")
    pdl = x.is_cuda and torch.cuda.is_current_stream_capturing() and _gemv.pdl_enabled()
    extra = dict(launch_pdl=True) if pdl else {}
    if rope is not None:
        extra["enable_fp_fusion"] = False
    x = x.contiguous()
    _mma_kernel[(triton.cdiv(grid_n, cfg["BLOCK_N"]),)](
        x, qw.codes, qw.scales.view(torch.int32), bias if bias is not None else x, y,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x,
        rope.positions if rope else x, rope.cos_sin if rope else x, qw.perm if qw.perm is not None else x,
        grid_n, k, n if silu else 0, qw.row_stride, qw.n, rope.cos_sin.stride(0) if rope else 0, eps,
        T=k // 128, GS=qw.group_size, HAS_BIAS=bias is not None, EVEN_N=grid_n % cfg["BLOCK_N"] == 0,
        NORM=norm_weight is not None, K_PAD=triton.next_power_of_2(k) if norm_weight is not None else 1, SILU=silu,
        RESIDUAL=residual is not None, ROPE=rope is not None, HEAD_DIM=rope.head_dim if rope else 2,
        ROT_ROWS=rope.rot_rows if rope else 0, PAIRED=silu or rope is not None, PERM=qw.perm is not None,
        USE_PDL=pdl, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", **cfg, **extra)
    return y
