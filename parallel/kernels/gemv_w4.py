"""Batch-1 W4A16 GEMV on tinygemm's int4 layout, read in place: y[1, N] = x[1, K] @ W^T for a 4-bit GPTQ / AWQ layer.

Status (measured on one H100, 2026-11-27, scripts/bench_gemv_w4.py: CUDA graphs, weights past L2, GB/s of int4 codes +
bf16 scale/zero pairs): SLOWER THAN TINYGEMM ON EVERY LLAMA-3.1-8B SHAPE, so the engine does not use it by default
(TABLE below; parallel/quant/tinygemm.py `choose_w4`; TANDEM_W4_GEMV=1 forces it, to compare).

    shape (N x K)          bf16 GEMV      tinygemm       this, best tile          its loads alone (MEMONLY)
    qkv 6144 x 4096        2,721  18.5 us  1,356   9.9 us    972  13.7 us (8,32,1)   1,895   7.1 us
    o 4096 x 4096          2,573  13.0      1,332   6.7       884  10.1    (4,32,1)   1,595   5.6
    gate_up 28672 x 4096   2,955  79.5      1,852  33.7     1,168  53.4    (8,32,1)/4 2,592  24.1
    down 4096 x 14336      2,825  41.6      1,677  18.6     1,105  28.2    (8,32,1)/2 2,165  14.4
    per decoder layer              152.6 us         68.8 us          105.5 us                  51.2 us
(tile: BLOCK_N, C, num_warps / split K.) The issue's 2.5x end to end needs ~52 us a layer or less; tinygemm gives 68.8.
What was learned:
  - the CUDA-core loop (below) costs 3.5-4.3 SASS instructions per code in its K loop (scripts/gemv_w4_sass.py) and
    ptxas gives the prefetching tiles 164-255 registers (8-12 warps an SM): it runs at half of its own loads-only time.
    Every winner is a one-warp tile with C = 32 chunks and BLOCK_N 4-8; BLOCK_N >= 16 spills (40-470 GB/s); Triton's
    cp.async pipeline (PREFETCH=0, NUM_STAGES 2-6) ran at a half to a fifth of the hand prefetch; register caps
    (MAXNREG) spill; split K helps gate_up / down by 2-7%.
  - the tensor-core variant (`_mma_kernel`: tl.dot of the unpacked bf16 tile against x spread over one column per
    group) reached only 519-831 GB/s: Triton moves the unpacked tile into the MMA operand layout through shared memory
    (PRMT / STS / LDSM: ~4 instructions per code in all, no fewer than the CUDA-core loop).
  - the loads-only ceiling of this access pattern is ~51 us a layer: even a free dequantization would only just reach
    the target, so the remaining gap to 2.5x is as much launch / ramp (PDL, fusion) as arithmetic.
Larger batches keep tinygemm (and dequantize + cuBLAS) on the same stored weight: no second copy, no new layout.

The layout (parallel/quant/tinygemm.py, inner_k_tiles 8):
    codes int32 [N/8, K/128, 32, 4]: word [nt, ko, t, j], t = 4 (row % 8) + a, nibble b at bits 4b holds the code of
    row 8 nt + t // 4, input 128 ko + 32 j + 16 i1 + 8 i0 + 2 a + lo, where b = 4 lo + 2 i1 + i0
    sz bf16 [K/GS, N, 2]: w = (q - 8) * scale + zero
A *chunk* is the 4 words j = 0..3 of one (row, ko, a): 16 contiguous bytes, 32 codes. Chunk c = 4 ko + a of a row starts
at word 128 ko + 4 a of its 8-row block (block stride K/128 * 128 words), row % 8 adds 16 words. Nibble b of word j of
chunk c is input 128 ko + 2 a + 32 j + 8 m + lo with m = b % 4, lo = b // 4: so x is read as bf16 pairs (one int32 at
pair index 64 ko + a + 16 j + 4 m gives lo = 0 in its low half, lo = 1 in its high half).

CUDA-core kernel (`_w4_kernel`). Dequantization without I2F: a shift puts nibbles (2s, 2s + 1) at bits 15 and 19
(shifts << 15, << 7, >> 1, >> 9), and `(v & mask) | EXP` (one LOP3: EXP is a register argument, a LOP3 takes one
immediate) is the float 256 + c (bit 15) or 256 + 16 c (bit 19), exactly. x of a bit-19 nibble is pre-scaled by 1/16
(exact), so each product is x c + (256 or 16) x; per chunk, the row-independent X0 = sum(256 x_even + 16 x_odd) is
subtracted once, leaving sum(c x) up to fp32 rounding of sums ~32x larger than it (~2^-19 relative). Then per chunk
and row (a chunk lies in one group when GS % 128 == 0):
    y += scale * sum(c x) + (zero - 8 scale) * sum(x)
which is x @ the dequantized weight up to fp32 summation order and that cancellation.
Tile: a program's step is a [BLOCK_N, C, 4] int32 tile (C chunks of each of BLOCK_N rows); Triton gives each thread
whole chunks (the 4 contiguous words: one 16-byte load) and, when C >= 32 x num_warps, all BLOCK_N rows of its chunks,
so each x value a thread loads serves BLOCK_N rows (the x gathers reach that layout through shared memory each step).
Steps are prefetched by hand (PREFETCH 1 or 2 steps ahead) or left to Triton's pipeliner (PREFETCH 0, NUM_STAGES).
SPLIT_K > 1 splits K over a second grid axis and adds fp32 partial sums with atomics into a zeroed fp32 buffer, then a
tiny cast. MEMONLY tiles do the loads without the arithmetic (wrong output): the access pattern's ceiling.
Tensor-core kernel (`_mma_kernel`, MMA tiles): see its docstring.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

EXP = 0x43800000  # 256.0's bits: `(v & mask) | EXP` is 256 + c (bit 15) or 256 + 16 c (bit 19)


@triton.jit
def _load_step(w_ptr, sz_ptr, rowoff, rows, t, NS, NCH, GS_TILES, n_mask, BLOCK_N: tl.constexpr, C: tl.constexpr,
               EVEN: tl.constexpr):
    """Step t's codes [BLOCK_N, C, 4] int32 and (scale, zero) pairs [BLOCK_N, C] (int32: scale in the low half)."""
    c = t * C + tl.arange(0, C)
    col = (c // 4) * 128 + (c % 4) * 4
    ptrs = w_ptr + rowoff[:, None, None] + col[None, :, None] + tl.arange(0, 4)[None, None, :]
    sz_ptrs = sz_ptr + ((c // 4) // GS_TILES).to(tl.int64)[None, :] * NS + rows[:, None]
    if EVEN:
        w = tl.load(ptrs)
        sz = tl.load(sz_ptrs)
    else:
        m = n_mask[:, None] & (c < NCH)[None, :]
        w = tl.load(ptrs, mask=m[:, :, None], other=0)
        sz = tl.load(sz_ptrs, mask=m, other=0)
    return w, sz


@triton.jit
def _nib(v, MASK: tl.constexpr, EXPR):
    """The float 256 + c (MASK at bit 15) or 256 + 16 c (bit 19) of the nibble under MASK."""
    return ((v & MASK) | EXPR).to(tl.float32, bitcast=True)


@triton.jit
def _xpairs(x32_ptr, p, NCH, c, EVEN: tl.constexpr):
    """x at the 8 nibbles of each word whose pair index (m = 0) is p, as fp32 (e_m: lo = 0, o_m: lo = 1), and the
    row-independent sums per word: xs = sum(x), x0 = sum(256 x_even-nibble + 16 x_odd-nibble)."""
    if EVEN:
        q0 = tl.load(x32_ptr + p)
        q1 = tl.load(x32_ptr + p + 4)
        q2 = tl.load(x32_ptr + p + 8)
        q3 = tl.load(x32_ptr + p + 12)
    else:
        cm = c < NCH
        q0 = tl.load(x32_ptr + p, mask=cm, other=0)
        q1 = tl.load(x32_ptr + p + 4, mask=cm, other=0)
        q2 = tl.load(x32_ptr + p + 8, mask=cm, other=0)
        q3 = tl.load(x32_ptr + p + 12, mask=cm, other=0)
    # bf16 -> fp32 is the 16 bits shifted up: lo = 0 is the low half, lo = 1 the high half
    e0 = (q0 << 16).to(tl.float32, bitcast=True)
    e1 = (q1 << 16).to(tl.float32, bitcast=True)
    e2 = (q2 << 16).to(tl.float32, bitcast=True)
    e3 = (q3 << 16).to(tl.float32, bitcast=True)
    o0 = (q0 & -65536).to(tl.float32, bitcast=True)
    o1 = (q1 & -65536).to(tl.float32, bitcast=True)
    o2 = (q2 & -65536).to(tl.float32, bitcast=True)
    o3 = (q3 & -65536).to(tl.float32, bitcast=True)
    xs = ((e0 + e2) + (o0 + o2)) + ((e1 + e3) + (o1 + o3))
    x0 = 256.0 * ((e0 + e2) + (o0 + o2)) + 16.0 * ((e1 + e3) + (o1 + o3))
    return e0, e2, o0, o2, e1 * 0.0625, e3 * 0.0625, o1 * 0.0625, o3 * 0.0625, xs, x0


@triton.jit
def _dot8(w, e0, e2, o0, o2, f1, f3, g1, g3, EXPR):
    """Per word: sum over its 8 nibbles of (256 + c) x (bit-15 nibbles) and (256 + 16 c) x / 16 (bit-19 ones), as one
    FFMA chain (nibble b = 2 s + lo4 of shift s pairs with x m = b % 4, lo = b // 4)."""
    v = w << 15
    acc = _nib(v, 0x00078000, EXPR) * e0
    acc += _nib(v, 0x00780000, EXPR) * f1
    v = w << 7
    acc += _nib(v, 0x00078000, EXPR) * e2
    acc += _nib(v, 0x00780000, EXPR) * f3
    v = w >> 1
    acc += _nib(v, 0x00078000, EXPR) * o0
    acc += _nib(v, 0x00780000, EXPR) * g1
    v = w >> 9
    acc += _nib(v, 0x00078000, EXPR) * o2
    acc += _nib(v, 0x00780000, EXPR) * g3
    return acc


@triton.jit
def _scaled(d, sz, xs):
    """scale * d + (zero - 8 scale) * xs for (scale, zero) bf16 pairs sz (int32: scale in the low half)."""
    s = (sz << 16).to(tl.float32, bitcast=True)
    z = (sz & -65536).to(tl.float32, bitcast=True)
    return s * d + (z - 8.0 * s) * xs


@triton.jit
def _step_sum(w, sz, x32_ptr, t, NCH, EXPR, C: tl.constexpr, EVEN: tl.constexpr):
    """VEC tiles: [BLOCK_N, C], each row's sum over each chunk of step t of x * dequantized weight."""
    c = t * C + tl.arange(0, C)
    p = (64 * (c // 4) + c % 4)[:, None] + 16 * tl.arange(0, 4)[None, :]  # [C, 4] pair index of word j, m = 0
    e0, e2, o0, o2, f1, f3, g1, g3, xs, x0 = _xpairs(x32_ptr, p, NCH, c[:, None], EVEN)
    acc = _dot8(w, e0[None], e2[None], o0[None], o2[None], f1[None], f3[None], g1[None], g3[None], EXPR)
    d = tl.sum(acc, axis=2) - tl.sum(x0, axis=1)[None, :]  # [BLOCK_N, C]: sum(c x)
    return _scaled(d, sz, tl.sum(xs, axis=1)[None, :])


@triton.jit
def _vec_sum(w, sz, x32_ptr, t, NCH, EXPR, C: tl.constexpr, EVEN: tl.constexpr, MEMONLY: tl.constexpr):
    if MEMONLY:  # diagnostic: the loads without the arithmetic (wrong output; scripts/bench_gemv_w4.py's ceiling)
        return (tl.sum(w, axis=2) ^ sz).to(tl.float32)
    return _step_sum(w, sz, x32_ptr, t, NCH, EXPR, C, EVEN)


@triton.jit
def _w4_kernel(x32_ptr, w_ptr, sz_ptr, y_ptr, yf_ptr, N, NCH, STEPS, BSTRIDE, NS, GS_TILES, EXPR,
               BLOCK_N: tl.constexpr, C: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
               NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, MEMONLY: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    rowoff = (rows // 8).to(tl.int64) * BSTRIDE + (rows % 8) * 16
    t0 = tl.program_id(1) * STEPS  # this split's first step (STEPS: steps per split)
    last = t0 + STEPS - 1
    acc = tl.zeros([BLOCK_N, C], tl.float32)
    if PREFETCH == 0:  # Triton's pipeliner (cp.async through shared memory) when NUM_STAGES > 1
        for t in tl.range(t0, t0 + STEPS, num_stages=NUM_STAGES):
            w, sz = _load_step(w_ptr, sz_ptr, rowoff, rows, t, NS, NCH, GS_TILES, n_mask, BLOCK_N, C, EVEN)
            acc += _vec_sum(w, sz, x32_ptr, t, NCH, EXPR, C, EVEN, MEMONLY)
    elif PREFETCH == 1:  # step t + 1 loads before step t is summed (past the last step: the last again, cached)
        w, sz = _load_step(w_ptr, sz_ptr, rowoff, rows, t0, NS, NCH, GS_TILES, n_mask, BLOCK_N, C, EVEN)
        for t in range(t0, t0 + STEPS):
            wn, szn = _load_step(w_ptr, sz_ptr, rowoff, rows, tl.minimum(t + 1, last), NS, NCH, GS_TILES, n_mask,
                                 BLOCK_N, C, EVEN)
            acc += _vec_sum(w, sz, x32_ptr, t, NCH, EXPR, C, EVEN, MEMONLY)
            w, sz = wn, szn
    else:  # three steps in flight: t + 2 loads before step t is summed
        w, sz = _load_step(w_ptr, sz_ptr, rowoff, rows, t0, NS, NCH, GS_TILES, n_mask, BLOCK_N, C, EVEN)
        wb, szb = _load_step(w_ptr, sz_ptr, rowoff, rows, tl.minimum(t0 + 1, last), NS, NCH, GS_TILES, n_mask,
                             BLOCK_N, C, EVEN)
        for t in range(t0, t0 + STEPS):
            wc, szc = _load_step(w_ptr, sz_ptr, rowoff, rows, tl.minimum(t + 2, last), NS, NCH, GS_TILES, n_mask,
                                 BLOCK_N, C, EVEN)
            acc += _vec_sum(w, sz, x32_ptr, t, NCH, EXPR, C, EVEN, MEMONLY)
            w, sz, wb, szb = wb, szb, wc, szc
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.atomic_add(yf_ptr + rows, y, mask=n_mask, sem="relaxed")


@triton.jit
def _bf16_pair(w, SH: tl.constexpr):
    """Nibbles b = SH / 4 and b + 4 of each word as the bf16 values 128 + q (exact): one LOP3 makes both halves."""
    v = ((w >> SH) & 0x000F000F) | 0x43004300
    return v.to(tl.int16).to(tl.bfloat16, bitcast=True), (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mma_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, yf_ptr, STEPS, BSTRIDE, NS, GS_TILES, BLOCK_N: tl.constexpr,
                G: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Tensor cores: per step, G 128-input tiles of BLOCK_N rows unpacked to bf16 128 + q (column 8 word + 4 e1 + 2 e2 +
    e3 holds nibble b = e1 + 2 e2 + 4 e3 of the word) and multiplied by X [128 G, 16], whose column g holds x at tile g's
    inputs (zero elsewhere): d[n, g] = sum over tile g of (128 + q) x, fp32. Per group of row n:
    sum(w x) = scale * d + (zero - 136 scale) * sum(x), since w = (q - 8) scale + zero (GS % 128 == 0)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rowoff = (rows // 8).to(tl.int64) * BSTRIDE + (rows % 8) * 16
    wi = tl.arange(0, G * 16)
    wcol = (wi // 16) * 128 + wi % 16  # a row's 16 words of a tile are contiguous; tiles 128 words apart
    q = tl.arange(0, G * 128)
    e = q % 8
    wl = (q // 8) % 16  # the word in its tile: 4 a + j
    kin = 128 * (q // 128) + 32 * (wl % 4) + 16 * ((e // 2) % 2) + 8 * (e % 2) + 2 * (wl // 4) + e // 4
    col = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    t0 = tl.program_id(1) * STEPS
    for t in tl.range(t0, t0 + STEPS, num_stages=NUM_STAGES):
        w = tl.load(w_ptr + rowoff[:, None] + t * (G * 128) + wcol[None, :])  # [BLOCK_N, 16 G] int32
        n0, n4 = _bf16_pair(w, 0)
        n1, n5 = _bf16_pair(w, 4)
        n2, n6 = _bf16_pair(w, 8)
        n3, n7 = _bf16_pair(w, 12)
        wj = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
        xv = tl.load(x_ptr + t * (G * 128) + kin)
        xg = tl.where(col[None, :] == (q // 128)[:, None], xv[:, None], 0.0).to(tl.bfloat16)  # [128 G, 16]
        wt = tl.reshape(wj, [BLOCK_N, G * 128])
        if INTERPRETED:  # Triton's interpreter multiplies bf16 dot operands as raw bits: fp32 there (CPU tests only)
            d = tl.dot(wt.to(tl.float32), xg.to(tl.float32))
        else:
            d = tl.dot(wt, xg)
        xs = tl.sum(xg.to(tl.float32), axis=0)
        sz = tl.load(sz_ptr + ((t * G + col) // GS_TILES)[None, :] * NS + rows[:, None], mask=(col < G)[None, :],
                     other=0)
        s = (sz << 16).to(tl.float32, bitcast=True)
        z = (sz & -65536).to(tl.float32, bitcast=True)
        acc += s * d + (z - 136.0 * s) * xs[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    else:
        tl.atomic_add(yf_ptr + rows, y, sem="relaxed")


@triton.jit
def _cast_kernel(yf_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(y_ptr + offs, tl.load(yf_ptr + offs, mask=m).to(y_ptr.dtype.element_ty), mask=m)


DEFAULT = dict(BLOCK_N=8, C=32, num_warps=1, PREFETCH=1, NUM_STAGES=1, SPLIT_K=1, MEMONLY=False, MAXNREG=None)
# (N, K) -> (the fastest tile scripts/bench_gemv_w4.py found, its us, tinygemm's us), one H100, 2026-11-27 17:17 UTC
# (round 2: CUDA graphs, weights past L2). None beats tinygemm, so `table_config` gives none of them to the engine by
# default (parallel/quant/tinygemm.py `choose_w4`); TANDEM_W4_GEMV=1 takes them anyway, to compare end to end.
_T = dict(C=32, num_warps=1, NUM_STAGES=1, MEMONLY=False, MAXNREG=None)
TABLE: dict[tuple[int, int], tuple[dict, float, float]] = {
    (6144, 4096): (dict(BLOCK_N=8, PREFETCH=1, SPLIT_K=1, **_T), 13.7, 9.9),  # qkv: 972 GB/s, tinygemm 1,356
    (4096, 4096): (dict(BLOCK_N=4, PREFETCH=1, SPLIT_K=1, **_T), 10.1, 6.7),  # o: 884, tinygemm 1,332
    (28672, 4096): (dict(BLOCK_N=8, PREFETCH=1, SPLIT_K=4, **_T), 53.4, 33.7),  # gate_up: 1,168, tinygemm 1,852
    (4096, 14336): (dict(BLOCK_N=8, PREFETCH=1, SPLIT_K=2, **_T), 28.2, 18.6),  # down: 1,105, tinygemm 1,677
}


def table_config(n: int, k: int, faster_only: bool = True) -> dict | None:
    """The table's tile for an [n, k] weight: only where it measured faster than tinygemm unless not faster_only."""
    if (n, k) not in TABLE:
        return None
    tile, us, tiny_us = TABLE[(n, k)]
    return dict(tile) if us < tiny_us or not faster_only else None


def fits(n: int, k: int, group_size: int, inner_k_tiles: int) -> str | None:
    """None if a weight of this shape in tinygemm's layout can take the kernel, else why not."""
    if inner_k_tiles != 8:
        return f"inner_k_tiles {inner_k_tiles} (the kernel reads 4-word runs: inner_k_tiles 8)"
    if group_size % 128:
        return f"group size {group_size} (a 128-input tile must lie in one group)"
    if k % 128 or n % 8:
        return f"shape {n}x{k}"
    return None


def gemv_w4(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, n: int,
            config: dict | None = None, out_fp32: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [1, K] (contiguous, in the layout's input order) @ the int4 weight (tinygemm layout `packed`, bf16
    scale/zero pairs `sz` [K/GS, N, 2]) -> bf16 [1, N]. No host sync: graph-capturable. Under SPLIT_K > 1 the fp32
    sums go to `out_fp32` (zeroed, [N]; a new buffer when None) before their cast (tests read them unrounded)."""
    cfg = {**DEFAULT, **(config or {})}
    if cfg.get("MMA"):
        return _gemv_mma(x, packed, sz, group_size, n, cfg, out_fp32)
    k = x.shape[-1]
    nch = k // 32
    split = cfg["SPLIT_K"]
    steps_total = triton.cdiv(nch, cfg["C"])
    if steps_total % split:
        raise ValueError(f"gemv_w4: SPLIT_K={split} does not divide the {steps_total} K steps of C={cfg['C']}")
    even = nch % cfg["C"] == 0 and n % cfg["BLOCK_N"] == 0
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    yf = y
    if split > 1:
        yf = out_fp32 if out_fp32 is not None else torch.zeros(n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
    _w4_kernel[grid](x.view(torch.int32), packed, sz.view(torch.int32), y, yf, n, nch, steps_total // split,
                     (k // 128) * 128, n, group_size // 128, EXP, BLOCK_N=cfg["BLOCK_N"], C=cfg["C"], EVEN=even,
                     PREFETCH=int(cfg["PREFETCH"]), NUM_STAGES=cfg["NUM_STAGES"], SPLIT_K=split,
                     MEMONLY=cfg["MEMONLY"], num_warps=cfg["num_warps"], num_stages=cfg["NUM_STAGES"],
                     **({"maxnreg": cfg["MAXNREG"]} if cfg["MAXNREG"] else {}))
    if split > 1:
        _cast_kernel[(triton.cdiv(n, 1024),)](yf, y, n, BLOCK=1024, num_warps=4)
    return y


def _gemv_mma(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, n: int, cfg: dict,
              out_fp32: torch.Tensor | None) -> torch.Tensor:
    """`gemv_w4` through `_mma_kernel` (cfg MMA: BLOCK_N, G tiles a step, num_warps, NUM_STAGES, SPLIT_K)."""
    k = x.shape[-1]
    bn, g, split = cfg["BLOCK_N"], cfg["G"], cfg["SPLIT_K"]
    if n % bn or k % (128 * g) or (k // (128 * g)) % split:
        raise ValueError(f"gemv_w4 (MMA): tile {cfg} does not divide {n}x{k}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    yf = y
    if split > 1:
        yf = out_fp32 if out_fp32 is not None else torch.zeros(n, dtype=torch.float32, device=x.device)
    _mma_kernel[(n // bn, split)](x, packed, sz.view(torch.int32), y, yf, k // (128 * g) // split, (k // 128) * 128, n,
                                  group_size // 128, BLOCK_N=bn, G=g, NUM_STAGES=cfg["NUM_STAGES"], SPLIT_K=split,
                                  INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=cfg["num_warps"], num_stages=cfg["NUM_STAGES"])
    if split > 1:
        _cast_kernel[(triton.cdiv(n, 1024),)](yf, y, n, BLOCK=1024, num_warps=4)
    return y
