"""Decode-batch W4A16 GEMV on tensor cores, in CUDA compiled at run time (NVRTC, `torch.cuda._compile_kernel`):
y[M, N] = x[M, K] @ W^T for M <= 8 rows, reading tinygemm's int4 layout in place (parallel/quant/tinygemm.py).

Why CUDA and not Triton: the Triton kernels (gemv_int4.py, and gemv_w4.py before this one replaced it) spent 3.5-4.3 instructions per int4 code on
unpacking, and Triton moves an unpacked tile into the tensor-core operand layout through shared memory; tinygemm
itself dequantizes each code in fp32 before its MMA. Here each lane's 16-byte load already *is* its MMA operand
fragment, so a code costs under one instruction:

    tinygemm's int32 [N/8, K/128, 32, 4] (inner_k_tiles 8): word [nt, ko, lane, j], lane = 4 g + a (g = row % 8),
    nibble b = 4 lo + 2 i1 + i0 holds row 8 nt + g, input 128 ko + 32 j + 16 i1 + 8 i0 + 2 a + lo.

That is the B operand of mma.m16n8k16 for one 8-row tile. Taken as the A operand (16 output rows = two 8-row tiles
nt = 2 r, 2 r + 1; k16 tile (ko, j, i1)), lane (g, a) needs rows g and g + 8 at inputs 2a, 2a + 1 (i0 = 0) and 2a + 8,
2a + 9 (i0 = 1): pair (i1, i0) of word j of the even tile gives a0a1 / a4a5, of the odd tile a2a3 / a6a7. The pair's
two nibbles sit at bits 4p and 4p + 16 (p = 2 i1 + i0), so `((w >> 4p) & 0x000F000F) | 0x43004300` (one LOP3 after
the shift) is the bf16 pair (128 + q_lo, 128 + q_hi), exactly. The MMA multiplies these against x as the B operand
(column m = batch row m; lanes with g >= M hold zeros) and accumulates in fp32. A second MMA with an all-ones A gives
sum(x) per batch row over the same inputs, and per (row, scale chunk of min(group, 128) inputs):

    y += scale * sum((128 + q) x) + (zero - 136 scale) * sum(x)         [tinygemm: w = (q - 8) scale + zero]

which is x @ the dequantized weight up to fp32 summation (the 136 sum(x) term cancels in fp32, a relative error near
2^-19 of the sum of |products|, well below the bf16 output's rounding).

Work split: a CTA owns R 16-row tiles (16 R output rows) and its KSPLIT warps split K by whole 128-input steps;
each warp prefetches U steps of its R tiles (2 R U 16-byte loads a lane in flight), the warps' partial sums meet in
shared memory, and warp 0 writes bf16. No atomics, no second kernel, no host sync: it captures into CUDA graphs.
Constraints (`fits`): inner_k_tiles 8 (K % 128 == 0), N % 16 == 0, group 32/64/128/256, sm80+, bf16 activations.
Tiles (`tile_for`) and speed: scripts/bench_w4_mma.py; on an H200 (2026-11-29) 43 us a Llama-3.1-8B decoder layer at
one row against tinygemm's 68 and the bf16 GEMV's 110 (docs/benchmarks.md, twenty-eighth session).

`gemv_w4_mma_fused` is the one-row variant the fused batch-1 decoder takes for 4-bit layers (parallel/quant/fused_gemv.py,
TANDEM_FUSED_INT4=auto): the RMSNorm prologue (x normed and act order's permutation applied into shared memory, only
where one of them is needed) and the SiLU-and-mul, RoPE or residual epilogue of parallel/kernels/gemv.py. One MMA tile
a group of warps, whose two 8-row halves are any two 8-row tiles of the layout: SiLU takes 8 gate rows and their 8 up
rows, RoPE rows j and j + head_dim / 2 of a head, so a lane holds both values its output needs; K is split as
`tile_for` splits it (the rows kernel's fp32 sums); where every CTA would stage the row many times an SM, a CTA takes
several tiles (`tiles_per_cta`). Under CUDA-graph capture on Hopper it is launched with programmatic dependent launch
(cuda_launch.py): it prefetches its first weight steps into L2 and then waits for the kernel ahead. On an H200
(2026-11-29) a Llama-3.1-8B batch-1 step took 2.15 ms that way against 2.29-2.32 on the unfused decoder, and 1.95 ms
after the fused kernel went to two steps a round and every lane loaded x without a branch, 1.82 ms after the RMSNorm
prologue was made cheaper (packed rounding, gate/up's tiles grouped 14 a CTA, x held in registers) (docs/benchmarks.md,
twenty-ninth to thirty-first sessions; scripts/bench_w4_chain.py times the layer chain alone, --trace its phases).
"""
from __future__ import annotations

import functools
import struct

import torch

from parallel.kernels.cuda_launch import launch_pdl, pdl_wanted, sm_count

MAX_ROWS = 8  # batch rows one launch takes (the MMA's N dimension)

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

#if PDL   // programmatic dependent launch (cuda_launch.py): wait for the kernel ahead; let the next one start
#define GDC_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define GDC_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define GDC_WAIT()
#define GDC_LAUNCH()
#endif

__device__ __forceinline__ u32 nib_pair(u32 w) {   // bf16 pair (128 + bits 0..3, 128 + bits 16..19) [- 136 if SUB]
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "n"(0x000F000F), "n"(0x43004300));
#if SUB
    asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(d) : "r"(0x3F803F80u), "r"(0xC308C308u));   // q - 8, exact
#endif
    return d;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {   // read once: keep it out of L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

#define TPS (CHUNK / 16)          // k16 tiles per scale chunk
#define CPK (128 / CHUNK)         // scale chunks per 128-input step

// One 128-input step ko of this warp's R tiles: wv[r][0] even 8-row tile, wv[r][1] odd, szv[r][c][h] the
// (scale, zero) pairs of rows g (h = 0) and g + 8 (h = 1) for chunk c. Adds into tot[r][4]. Every lane loads its x
// pairs, also lanes of batch columns past the last row (they read a real row's x: their output columns are never
// written, and an MMA's columns do not mix), so no lane branches around the load.
__device__ __forceinline__ void step(const uint4 (&wv)[R][2], const u32 (&szv)[R][CPK][2], const u32* __restrict__ x32,
                                     int ko, int a, float (&tot)[R][4]) {
    #pragma unroll
    for (int c = 0; c < CPK; ++c) {
        float acc[R][4];
        float sx[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int r = 0; r < R; ++r) { acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f; }
        #pragma unroll
        for (int tt = 0; tt < TPS; ++tt) {
            const int tile = c * TPS + tt;        // k16 tile in the step: j = tile / 2, i1 = tile % 2
            const int j = tile >> 1, i1 = tile & 1;
            // x pairs at inputs 128 ko + 16 tile + 2a (+8): u32 index 64 ko + 8 tile + a (+4)
            const int xi = 64 * ko + 8 * tile + a;
            const u32 b0 = x32[xi];
            const u32 b1 = x32[xi + 4];
            mma(sx, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, b0, b1);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const u32 we = (j == 0 ? wv[r][0].x : j == 1 ? wv[r][0].y : j == 2 ? wv[r][0].z : wv[r][0].w);
                const u32 wo = (j == 0 ? wv[r][1].x : j == 1 ? wv[r][1].y : j == 2 ? wv[r][1].z : wv[r][1].w);
                const int sh0 = 8 * i1, sh1 = 8 * i1 + 4;       // pair p = 2 i1 + i0 at bits 4p, 4p + 16
                mma(acc[r], nib_pair(we >> sh0), nib_pair(wo >> sh0), nib_pair(we >> sh1), nib_pair(wo >> sh1), b0, b1);
            }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float s = bf16_lo(szv[r][c][h]);
                const float zc = bf16_hi(szv[r][c][h]) - (SUB ? 0.f : 136.f) * s;
                tot[r][2 * h] += s * acc[r][2 * h] + zc * sx[0];
                tot[r][2 * h + 1] += s * acc[r][2 * h + 1] + zc * sx[1];
            }
        }
    }
}

__device__ __forceinline__ void load(const uint4* __restrict__ w4, const u32* __restrict__ sz, int ko, int KO, int N,
                                     const int (&tiles)[R][2], int lane, int g, uint4 (&wv)[R][2], u32 (&szv)[R][CPK][2]) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned nt = tiles[r][h];   // 32-bit indices (`fits` keeps them in range): fewer instructions
            wv[r][h] = ld_stream(w4 + ((nt * KO + ko) * 32u + lane));
            #pragma unroll
            for (int c = 0; c < CPK; ++c) szv[r][c][h] = sz[(unsigned)((128 * ko + CHUNK * c) / GS) * N + 8 * nt + g];
        }
    }
}

// This warp's K range of its R tiles into tot (summed over the KSPLIT warps of its tile group on return, in the
// group's first warp; the others return false). A CTA holds TPC tile groups of KSPLIT warps (the fused kernel's; else
// 1). x32: batch row g's input pairs (global, or the fused kernel's staged copy in shared memory; lanes of columns
// past the batch read a real row's). tiles[r]: the two 8-row tiles of tinygemm's layout that are rows 0-7
// and 8-15 of the r-th MMA tile.
__device__ __forceinline__ bool tiles_dot(const u32* x32, const uint4* __restrict__ w4, const u32* __restrict__ sz,
                                          const int (&tiles)[R][2], int N, int K, float (&tot)[R][4]) {
    __shared__ float part[TPC][KSPLIT > 1 ? KSPLIT - 1 : 1][R * 4][32];
    const int lane = threadIdx.x & 31;
    const int warp = TPC > 1 ? (threadIdx.x >> 5) % KSPLIT : threadIdx.x >> 5;   // in its tile group
    const int group = TPC > 1 ? (threadIdx.x >> 5) / KSPLIT : 0;
    const int g = lane >> 2, a = lane & 3;
    const int KO = K >> 7;
    const int ko0 = (KO * warp) / KSPLIT, ko1 = (KO * (warp + 1)) / KSPLIT;
    #pragma unroll
    for (int r = 0; r < R; ++r) { tot[r][0] = tot[r][1] = tot[r][2] = tot[r][3] = 0.f; }
    uint4 wv[U][R][2];
    u32 szv[U][R][CPK][2];
    int ko = ko0;
    for (; ko + U <= ko1; ko += U) {
        #pragma unroll
        for (int u = 0; u < U; ++u) load(w4, sz, ko + u, KO, N, tiles, lane, g, wv[u], szv[u]);
        #pragma unroll
        for (int u = 0; u < U; ++u) step(wv[u], szv[u], x32, ko + u, a, tot);
    }
    for (; ko < ko1; ++ko) {
        load(w4, sz, ko, KO, N, tiles, lane, g, wv[0], szv[0]);
        step(wv[0], szv[0], x32, ko, a, tot);
    }
    GDC_LAUNCH();  // every weight byte is read: the next kernel may start its own loads
    if (KSPLIT > 1) {
        if (warp > 0) {
            #pragma unroll
            for (int r = 0; r < R; ++r)
                #pragma unroll
                for (int i = 0; i < 4; ++i) part[group][warp - 1][4 * r + i][lane] = tot[r][i];
        }
        __syncthreads();
        if (warp > 0) return false;
        #pragma unroll
        for (int w = 0; w < KSPLIT - 1; ++w)
            #pragma unroll
            for (int r = 0; r < R; ++r)
                #pragma unroll
                for (int i = 0; i < 4; ++i) tot[r][i] += part[group][w][4 * r + i][lane];
    }
    return true;
}

extern "C" __global__ void __launch_bounds__(32 * KSPLIT)
w4_mma(const u32* __restrict__ x32, const uint4* __restrict__ w4, const u32* __restrict__ sz, u16* __restrict__ y,
       int M, int N, int K) {
    const int lane = threadIdx.x & 31, g = lane >> 2, a = lane & 3;
    int tiles[R][2];
    #pragma unroll
    for (int r = 0; r < R; ++r) { tiles[r][0] = 2 * (blockIdx.x * R + r); tiles[r][1] = tiles[r][0] + 1; }
    float tot[R][4];
    // lanes of batch columns g >= M read row M - 1 (`step`); nothing of those columns is written
    if (!tiles_dot(x32 + (long)min(g, M - 1) * (K >> 1), w4, sz, tiles, N, K, tot)) return;
    // C fragment: tot[r][0..1] = rows g, batch columns 2a, 2a + 1; tot[r][2..3] = rows g + 8
    const int m0 = 2 * a;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = 8 * tiles[r][0] + g;   // its partner row + 8 is tile tiles[r][1]'s row g
        if (m0 < M) { y[(long)m0 * N + row] = to_bf16(tot[r][0]); y[(long)m0 * N + row + 8] = to_bf16(tot[r][2]); }
        if (m0 + 1 < M) { y[(long)(m0 + 1) * N + row] = to_bf16(tot[r][1]); y[(long)(m0 + 1) * N + row + 8] = to_bf16(tot[r][3]); }
    }
}

#ifdef FUSED
#define STAGE (NORM || PERM)   // x is staged in shared memory (normed, permuted); else the product reads it in place
#define XR 2                   // 16-byte groups of x a thread of the RMSNorm prologue keeps in registers
__device__ __forceinline__ float rnd(float f) { return bf16_lo(to_bf16(f)); }   // rounded to bf16, as a float

// RMSNorm of 8 inputs: bf16(w * bf16(x * rstd)), two at a time in six instructions: x * rstd in fp32, both rounded by
// one cvt, times their weights by one bf16x2 FMA with -0 added (the exact product rounded once, the sign of a zero
// kept): the rounding of the scalar form in PERM's loop, at under half its instructions. Every CTA norms the whole
// row, so this is most of the prologue (2.8 against 4.9 us of gate/up's at one tile a CTA; bench_w4_chain --trace).
__device__ __forceinline__ uint4 norm8(uint4 v, uint4 wn, float rstd) {
    const u32 xv[4] = {v.x, v.y, v.z, v.w}, nv[4] = {wn.x, wn.y, wn.z, wn.w};
    u32 out[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(bf16_hi(xv[i]) * rstd), "f"(bf16_lo(xv[i]) * rstd));
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out[i]) : "r"(r), "r"(nv[i]), "r"(0x80008000u));
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// The product rounded to bf16, then its bias added and rounded: what the unfused quantized linear computes (its
// kernel's bf16 output + bias), so the fused and unfused decoders of a quantized model agree bit for bit.
__device__ __forceinline__ float add_bias(float acc, const u16* __restrict__ bias, int row) {
    const float v = rnd(acc);
    return BIAS ? rnd(v + bf16_lo(bias[row])) : v;
}

// One row, with the batch-1 decoder's small ops folded in (parallel/kernels/gemv.py's prologue and epilogues, the
// same rounding): NORM: x = RMSNorm(h) computed by every CTA into shared memory (with PERM, act order's permuted
// input order); SILU: [gate; up] weight, y = silu(gate) * up: the MMA tile's rows 0-7 are 8 gate rows (8-row tile t)
// and rows 8-15 their up rows (tile t + N / 16), so each lane holds a gate value and its up value; ROPE: rotate-half
// RoPE of the q/k rows of a fused qkv output, the MMA tile's halves are rows j and j + HALF of a head;
// RESID: y = round(round(x @ W^T) (+ bias)) + residual. Otherwise (and under NORM / PERM alone) y = x @ W^T (+ bias).
// R MMA tiles (RoPE: 1) a group of KSPLIT warps, which split K as the rows kernel's `tile_for` does (the same fp32
// sums); TPC groups a CTA, so the CTAs of an SM stage the row fewer times (`fused_tile`).
// A bias is added to the rounded product everywhere (`add_bias`), as the unfused quantized linear adds it.
// PDL (launched so under CUDA-graph capture, cuda_launch.py): the first weight steps are prefetched into L2 before
// the wait for the kernel ahead, which wrote x (and the residual); nothing before the wait reads or writes activations.
extern "C" __global__ void __launch_bounds__(32 * KSPLIT * TPC, MINB)
w4_mma_fused(const u16* __restrict__ x, const uint4* __restrict__ w4, const u32* __restrict__ sz, u16* __restrict__ y,
             const u16* __restrict__ nw, const u16* __restrict__ bias, const u16* __restrict__ res,
             const long long* __restrict__ perm, const POS_T* __restrict__ pos, const float* __restrict__ cs,
             unsigned long long* __restrict__ trace, int N, int K, int stride_cp, int rot_rows, int eps_bits) {
#if TRACE   // thread 0's %globaltimer at 5 points a CTA (start, past the wait, staged, summed, done): --trace of
            // scripts/bench_w4_chain.py
#define STAMP(i) if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); trace[5 * blockIdx.x + (i)] = t_; }
#else
#define STAMP(i)
#endif
    STAMP(0)
    extern __shared__ uint4 xs4[];                 // K / 8 groups of 8 staged inputs
    __shared__ float red[KSPLIT * TPC];
    const int tid = threadIdx.x, nth = 32 * KSPLIT * TPC, lane = tid & 31, g = lane >> 2, a = lane & 3;
    const int t = TPC > 1 ? blockIdx.x * TPC + (tid >> 5) / KSPLIT : blockIdx.x;   // this warp's MMA tile
    int tiles[R][2];
#if SILU   // R gate tiles and their up tiles (N / 16 8-row tiles on)
    #pragma unroll
    for (int r = 0; r < R; ++r) { tiles[r][0] = t * R + r; tiles[r][1] = tiles[r][0] + (N >> 4); }
#elif ROPE
#if R != 1
#error "RoPE pairs one MMA tile's halves: R = 1"
#endif
    { const int ht = HALF / 8, head = t / ht, i = t % ht;
      tiles[0][0] = 2 * ht * head + i; tiles[0][1] = tiles[0][0] + ht; }
#else
    #pragma unroll
    for (int r = 0; r < R; ++r) { tiles[r][0] = 2 * (t * R + r); tiles[r][1] = tiles[r][0] + 1; }
#endif
    {   // this warp's first U steps of weights into L2 (no registers held): under PDL before the wait, else while the
        // CTA stages x. (Loading them into registers here was slower in the chain: scripts/bench_w4_chain.py.)
        const int KO = K >> 7, warp = TPC > 1 ? (tid >> 5) % KSPLIT : tid >> 5;
        const int ko0 = (KO * warp) / KSPLIT, ko1 = (KO * (warp + 1)) / KSPLIT;
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (ko0 + u >= ko1) break;
            #pragma unroll
            for (int r = 0; r < R; ++r)
                #pragma unroll
                for (int h = 0; h < 2; ++h)
                    asm volatile("prefetch.global.L2 [%0];" :: "l"(w4 + ((long)tiles[r][h] * KO + ko0 + u) * 32 + lane));
        }
    }
    GDC_WAIT();
    STAMP(1)
#if STAGE
    {   // x (RMSNorm'd, permuted) into shared memory, 8 inputs (16 bytes) a thread at a time
        const uint4* x4 = (const uint4*)x;
        float rstd = 0.f;
#if NORM
        float ss = 0.f;
#if !PERM
        // a thread's first XR groups of x and of the norm weight into registers, both loads in one round trip: the
        // normalising pass below reads them from there (one L2 round trip less before the product: -0.9 us a
        // Llama-3.1-8B layer over qkv and gate/up on an H200, bench_w4_chain; XR covers the row from 256 threads)
        uint4 xr[XR], nr[XR];
        #pragma unroll
        for (int j = 0; j < XR; ++j) {
            const int q = tid + j * nth;
            if (q < (K >> 3)) {
                xr[j] = x4[q];
                nr[j] = ((const uint4*)nw)[q];
                const u32 w[4] = {xr[j].x, xr[j].y, xr[j].z, xr[j].w};
                #pragma unroll
                for (int i = 0; i < 4; ++i) { const float lo = bf16_lo(w[i]), hi = bf16_hi(w[i]); ss += lo * lo + hi * hi; }
            }
        }
        for (int q = tid + XR * nth; q < (K >> 3); q += nth) {
#else
        for (int q = tid; q < (K >> 3); q += nth) {
#endif
            const uint4 v = x4[q];
            const u32 w[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int i = 0; i < 4; ++i) { const float lo = bf16_lo(w[i]), hi = bf16_hi(w[i]); ss += lo * lo + hi * hi; }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[tid >> 5] = ss;
        __syncthreads();
        ss = 0.f;
        #pragma unroll
        for (int w = 0; w < KSPLIT * TPC; ++w) ss += red[w];
        rstd = rsqrtf(ss / K + __int_as_float(eps_bits));
#endif
#if NORM && !PERM
        #pragma unroll
        for (int j = 0; j < XR; ++j) {
            const int q = tid + j * nth;
            if (q < (K >> 3)) xs4[q] = norm8(xr[j], nr[j], rstd);
        }
        for (int q = tid + XR * nth; q < (K >> 3); q += nth) {
#else
        for (int q = tid; q < (K >> 3); q += nth) {
#endif
            u32 out[4];
#if PERM
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 pair = 0;
                #pragma unroll
                for (int lo = 0; lo < 2; ++lo) {
                    const int src = (int)perm[8 * q + 2 * i + lo];
                    u16 v = x[src];
#if NORM
                    v = to_bf16(bf16_lo(nw[src]) * rnd(bf16_lo(v) * rstd));
#endif
                    pair |= (u32)v << (16 * lo);
                }
                out[i] = pair;
            }
#else   // NORM (STAGE without PERM)
            const uint4 v = norm8(x4[q], ((const uint4*)nw)[q], rstd);
            out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
#endif
            xs4[q] = make_uint4(out[0], out[1], out[2], out[3]);
        }
        (void)rstd;
        __syncthreads();
    }
    const u32* xin = (const u32*)xs4;
#else
    const u32* xin = (const u32*)x;
#endif
    STAMP(2)
    float tot[R][4];
    if (!tiles_dot(xin, w4, sz, tiles, N, K, tot)) return;
    STAMP(3)
    if (a != 0) return;                            // batch column 0 lives in lanes 4g: rows g of each half
#if SILU
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row0 = 8 * tiles[r][0] + g, row1 = 8 * tiles[r][1] + g;   // row1 = row0 + N / 2
        const float v0 = add_bias(tot[r][0], bias, row0), v1 = add_bias(tot[r][2], bias, row1);
        const float sv = rnd(v0 / (1.f + expf(-v0)));
        y[row0] = to_bf16(sv * v1);
    }
#elif ROPE
    const int row0 = 8 * tiles[0][0] + g, row1 = 8 * tiles[0][1] + g;   // row1 = row0 + HALF
    const float v0 = add_bias(tot[0][0], bias, row0), v1 = add_bias(tot[0][2], bias, row1);
    if (row0 < rot_rows) {
        const int j = row0 % (2 * HALF);
        const float* c = cs + (long)pos[0] * stride_cp;
        const float c1 = rnd(c[j]), c2 = rnd(c[HALF + j]), s1 = rnd(c[2 * HALF + j]), s2 = rnd(c[3 * HALF + j]);
        y[row0] = to_bf16(rnd(__fmul_rn(v0, c1)) + rnd(__fmul_rn(-v1, s1)));
        y[row1] = to_bf16(rnd(__fmul_rn(v1, c2)) + rnd(__fmul_rn(v0, s2)));
    } else {
        y[row0] = to_bf16(v0);
        y[row1] = to_bf16(v1);
    }
#else
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 8 * tiles[r][h] + g;
            const float v = add_bias(tot[r][2 * h], bias, row);
            y[row] = to_bf16(RESID ? v + bf16_lo(res[row]) : v);
        }
#endif
    STAMP(4)
}
#endif
"""

WARPS_TARGET = 4096  # warps a launch aims for (16-row tiles x K-splitting warps)


WIDE_TILES_MIN = 4096  # 16-row tiles from which a CTA takes two (an LM head's 8,016)


def tile_for(n: int, k: int) -> dict:
    """The tile for an [N, K] weight, from scripts/bench_w4_mma.py on an H200 (2026-11-29, 26 tiles per shape): the
    fastest split K over the most warps a CTA takes (16) while the launch stays near 4,096 warps, four 128-input steps
    in flight a warp. qkv 6144 (384 tiles): 8 warps a CTA, 6.3 us; o and down (256 tiles): 16, 4.8 and 11.8 us;
    gate_up 28672 (1,792 tiles): 2, 20.7 us. Two 16-row tiles a CTA and the bf16 subtract-8 were slower there.
    From WIDE_TILES_MIN tiles (a quantized LM head: 128256 x 4096) two tiles a CTA over 4 warps, two steps in flight,
    measured fastest (H200, 2026-11-29 call 2: 73.8 us, 3.78 TB/s, against 81.0 us at the rule above)."""
    if n // 16 >= WIDE_TILES_MIN and n % 32 == 0:
        return dict(R=2, KSPLIT=4, U=2, SUB=0)
    return dict(R=1, KSPLIT=_ksplit(n // 16), U=4, SUB=0)


def _ksplit(ctas: int) -> int:
    """Warps a CTA splits K over: 16 (the most a CTA takes), halved down to 2 while ctas x it exceeds WARPS_TARGET."""
    ksplit = 16
    while ksplit > 2 and max(1, ctas) * ksplit > WARPS_TARGET:
        ksplit //= 2
    return ksplit


def _inner_k_tiles(packed: torch.Tensor) -> int:
    """tinygemm's inner_k_tiles of a packed weight [N/8, K/(16 IKT), 32, IKT/2] this kernel reads (8), else 0."""
    return 8 if packed.dim() == 4 and packed.shape[-1] == 4 else 0


def source(R: int, KSPLIT: int, U: int, GS: int, SUB: int = 0, fused: dict | None = None) -> str:
    """The kernels' CUDA source for one tile and group size (compile-time constants); `fused`: the one-row kernel's
    flags too (NORM, SILU, ROPE, RESID, BIAS, PERM, PDL: 0/1; HALF: head_dim / 2; POS_T: the positions' C type)."""
    chunk = min(GS, 128)
    head = f"#define R {R}\n#define KSPLIT {KSPLIT}\n#define U {U}\n#define GS {GS}\n#define CHUNK {chunk}\n#define SUB {SUB}\n"
    if fused is not None:
        head += "#define FUSED 1\n" + "".join(f"#define {k} {v}\n" for k, v in sorted(fused.items()))
    for flag, default in (("PDL", 0), ("TPC", 1), ("TRACE", 0)):
        if fused is None or flag not in fused:
            head += f"#define {flag} {default}\n"
    return head + _SOURCE


def fits(n: int, k: int, group_size: int, inner_k_tiles: int, rows: int = 1, R: int = 1) -> str | None:
    """None when the kernel takes this weight and row count, else why not."""
    if inner_k_tiles != 8:
        return f"inner_k_tiles {inner_k_tiles} (the kernel reads 8)"
    if k % 128:
        return f"K={k} is not a multiple of 128"
    if n % (16 * R):
        return f"N={n} is not a multiple of {16 * R}"
    if group_size not in (32, 64, 128, 256):
        return f"group size {group_size}"
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (1..{MAX_ROWS})"
    if n * k >= 1 << 36 or (k // min(group_size, 128)) * n >= 1 << 31:  # the kernel indexes in 32 bits
        return f"{n}x{k}: too large for the kernel's 32-bit indices"
    return None


@functools.lru_cache(maxsize=None)
def _kernel(R: int, KSPLIT: int, U: int, GS: int, SUB: int, device: int, fused: tuple = ()):
    from torch.cuda import _compile_kernel

    with torch.cuda.device(device):
        major, minor = torch.cuda.get_device_capability(device)
        src = source(R, KSPLIT, U, GS, SUB, dict(fused) if fused else None)
        return _compile_kernel(src, "w4_mma_fused" if fused else "w4_mma", compute_capability=f"{major}{minor}")


def gemv_w4_mma(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, n: int,
                cfg: dict | None = None) -> torch.Tensor:
    """x bf16 [M, K] (M <= 8), packed int32 [N/8, K/128, 32, 4], sz bf16 [K/group_size, N, 2] -> bf16 [M, N]."""
    m, k = x.shape
    cfg = cfg or tile_for(n, k)
    why = fits(n, k, group_size, _inner_k_tiles(packed), rows=m, R=cfg["R"])
    if why is not None or x.dtype != torch.bfloat16:
        raise ValueError(f"gemv_w4_mma: {why or f'activations in {x.dtype} (bf16 only)'}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    kern = _kernel(cfg["R"], cfg["KSPLIT"], cfg["U"], group_size, cfg.get("SUB", 0), x.device.index or 0)
    kern(grid=(n // (16 * cfg["R"]), 1, 1), block=(32 * cfg["KSPLIT"], 1, 1), args=[x, packed, sz, y, m, n, k])
    return y


SMEM_LIMIT = 48 * 1024  # a launch's shared memory without opting in to more


FUSED_STEPS = 2  # 128-input steps a warp of the fused kernel has in flight (U)


def fused_tile(n: int, k: int, sms: int = 132, override: dict | None = None, staged: bool = False) -> dict:
    """The one-row fused kernel's tile: one MMA tile (16 rows) a group of warps with the K split of the rows kernel's
    `tile_for` (the same fp32 sums), FUSED_STEPS steps a round (U does not change the sums; in the batch-1 chain of an
    H200, scripts/bench_w4_chain.py 2026-11-29, 2 took 56.0 us a Llama-3.1-8B layer against 58.9 at the rows kernel's
    4), TPC such groups a CTA (`tiles_per_cta` where the kernel stages the row: `staged`, else 1), `override`'s keys
    in their place, and MINB, the CTAs an SM must hold at once (`__launch_bounds__`): enough for the CTAs to run in
    one wave over `sms` SMs, but never below 64 registers a thread."""
    tile = {**tile_for(n, k), "U": FUSED_STEPS, **(override or {})}
    tile.setdefault("TPC", tiles_per_cta(n // 16 // tile["R"], tile["KSPLIT"], sms, k, tile["R"]) if staged else 1)
    threads = 32 * tile["KSPLIT"] * tile["TPC"]
    ctas = max(1, n // 16 // tile["R"] // tile["TPC"])
    tile.setdefault("MINB", max(1, min(-(-ctas // sms), 65536 // (64 * threads), 2048 // threads)))
    return tile


STAGED_CTAS_MIN = 8  # CTAs an SM would stage the row in, at one tile a CTA, before `tiles_per_cta` groups tiles


def tiles_per_cta(tiles: int, ksplit: int, sms: int, k: int, r: int = 1) -> int:
    """MMA tiles a CTA of the fused kernel takes where it stages the row (RMSNorm, act order's permutation): every CTA
    norms the whole row, so the CTAs of an SM repeat that work, and fewer, larger CTAs repeat it less. Where an SM
    would hold STAGED_CTAS_MIN or more one-tile CTAs: the most tiles that divide the launch, fit a CTA (1,024
    threads, shared memory) and leave no SM more tiles than one a CTA would; else 1. On an H200 (bench_w4_chain.py,
    2026-11-29) gate/up's 14 CTAs an SM became one of 14 tiles: -1.1 us a Llama-3.1-8B layer; qkv's 3 became one of 3
    (on 128 of the 132 SMs): +1.1 us, its prologue being latency, not repeated work."""
    per_sm = -(-tiles // sms)
    if per_sm < STAGED_CTAS_MIN:
        return 1
    best = 1
    for t in range(2, 1024 // (32 * ksplit) + 1):
        if (tiles % t == 0 and -(-(tiles // t) // sms) * t <= per_sm
                and fused_smem(k, {"R": r, "KSPLIT": ksplit, "TPC": t}) <= SMEM_LIMIT):
            best = t
    return best


def fused_ctas(n: int, k: int, staged: bool, sms: int = 132, override: dict | None = None) -> int:
    """CTAs the fused kernel launches for an [N, K] weight (`staged`: with the RMSNorm or act order's prologue)."""
    tile = fused_tile(n, k, sms, override, staged=staged)
    return n // 16 // tile["R"] // tile["TPC"]


def fused_smem(k: int, tile: dict) -> int:
    """Bytes of shared memory the fused kernel takes: the staged input row and the warps' partial sums."""
    groups = tile.get("TPC", 1)
    return 2 * k + 4 * groups * (max(1, tile["KSPLIT"] - 1) * tile["R"] * 4 * 32 + tile["KSPLIT"])


def fused_fits(n: int, k: int, group_size: int, inner_k_tiles: int, *, silu: bool = False,
               head_dim: int | None = None, tile: dict | None = None) -> str | None:
    """None when the one-row fused kernel takes this weight (SiLU pairs; RoPE heads of `head_dim`), else why not."""
    return _fused_why(n, k, group_size, inner_k_tiles, silu, head_dim, fused_tile(n, k, override=tile))


def _fused_why(n: int, k: int, group_size: int, inner_k_tiles: int, silu: bool, head_dim: int | None,
               tile: dict) -> str | None:
    """`fused_fits` for a worked-out tile (`fused_tile`'s): None, or why the kernel does not take the weight so."""
    why = fits(n, k, group_size, inner_k_tiles)
    if why is not None:
        return why
    if silu and n % 32:
        return f"N={n}: SiLU pairs 8-row gate and up tiles (N % 32 == 0)"
    if head_dim is not None and (head_dim % 16 or n % head_dim):
        return f"head_dim {head_dim} (RoPE pairs whole 8-row tiles: head_dim % 16 == 0)"
    if head_dim is not None and tile["R"] != 1:
        return f"RoPE pairs one MMA tile's halves (R = {tile['R']})"
    if (n // 16) % (tile["R"] * tile["TPC"]) or 32 * tile["KSPLIT"] * tile["TPC"] > 1024:
        return f"{tile['R']} x {tile['TPC']} tiles a CTA for N={n}"
    if fused_smem(k, tile) > SMEM_LIMIT:
        return f"K={k}: the staged input row and partial sums exceed {SMEM_LIMIT // 1024} KB of shared memory"
    return None


def gemv_w4_mma_fused(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, n: int, *,
                      perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                      silu: bool = False, rope=None, tile: dict | None = None,
                      trace: torch.Tensor | None = None) -> torch.Tensor:
    """One row: x[:, perm] (or x) @ W^T, rounded, + bias, with parallel/kernels/gemv.py's fused RMSNorm prologue
    (norm_weight, eps) and SiLU-and-mul / RoPE (a gemv.Rope) / residual epilogues, same arguments and rounding but for
    the bias, added after the product's rounding as the unfused quantized linear adds it. x bf16 [1, K] (the
    layer's input order: act order's `perm` is applied here), packed / sz as `gemv_w4_mma`'s -> bf16 [1, N] ([1, N/2]
    with silu). `tile`: keys of `fused_tile` to override (scripts/bench_w4_chain.py sweeps them). `trace`: int64
    [CTAs, 5] (`fused_ctas`) the kernel fills with thread 0's %globaltimer (ns) at its start, past the wait for the
    kernel ahead, after staging the row, after the product's sums and at its end (a diagnostic: bench_w4_chain
    --trace)."""
    if x.shape[0] != 1 or x.dtype != torch.bfloat16:
        raise ValueError(f"gemv_w4_mma_fused: one bf16 row, got {tuple(x.shape)} {x.dtype}")
    k = x.shape[1]
    staged = norm_weight is not None or perm is not None  # the kernel's STAGE
    tile = fused_tile(n, k, sm_count(x.device), tile, staged=staged)
    head_dim = rope.head_dim if rope is not None else None
    why = _fused_why(n, k, group_size, _inner_k_tiles(packed), silu, head_dim, tile)
    if why is not None:
        raise ValueError(f"gemv_w4_mma_fused: {why}")
    if rope is not None and (silu or residual is not None or rope.cos_sin.stride(-1) != 1):
        raise ValueError("gemv_w4_mma_fused: RoPE alone as the epilogue, with a contiguous cos/sin table")
    if silu and residual is not None:
        raise ValueError("gemv_w4_mma_fused: SiLU and the residual add do not combine")
    pos64 = rope is not None and rope.positions.dtype == torch.int64
    pdl = pdl_wanted(x)
    flags = dict(NORM=int(norm_weight is not None), SILU=int(silu), ROPE=int(rope is not None),
                 RESID=int(residual is not None), BIAS=int(bias is not None), PERM=int(perm is not None),
                 HALF=rope.head_dim // 2 if rope is not None else 16, POS_T="long long" if pos64 else "int", PDL=int(pdl))
    if perm is not None and perm.dtype != torch.int64:
        raise ValueError(f"gemv_w4_mma_fused: act order's permutation in int64, got {perm.dtype}")
    if not x.is_contiguous() or x.data_ptr() % 16:  # the staging reads x 16 bytes at a time
        x = x.contiguous().clone()
    if norm_weight is not None and norm_weight.data_ptr() % 16:
        norm_weight = norm_weight.clone()
    y = torch.empty(1, n // 2 if silu else n, dtype=torch.bfloat16, device=x.device)
    ctas = n // 16 // tile["R"] // tile["TPC"]  # TPC groups of R MMA tiles a CTA (SiLU: 8 gate + 8 up rows a tile)
    if trace is not None and (trace.dtype != torch.int64 or trace.numel() < 5 * ctas):
        raise ValueError("gemv_w4_mma_fused: trace takes int64 [CTAs, 5]")
    launch = {**flags, "MINB": tile["MINB"], "TPC": tile["TPC"], "TRACE": int(trace is not None)}
    kern = _kernel(tile["R"], tile["KSPLIT"], tile["U"], group_size, 0, x.device.index or 0,
                   tuple(sorted(launch.items())))
    eps_bits = struct.unpack("<i", struct.pack("<f", eps))[0]  # the kernel takes eps as float32 bits (an int arg)
    args = [x, packed, sz, y, norm_weight if norm_weight is not None else x, bias if bias is not None else x,
            residual if residual is not None else x, perm if perm is not None else x,
            rope.positions if rope is not None else x, rope.cos_sin if rope is not None else x,
            trace if trace is not None else x, n, k,
            rope.cos_sin.stride(0) if rope is not None else 0, rope.rot_rows if rope is not None else 0, eps_bits]
    grid, block, smem = (ctas, 1, 1), (32 * tile["KSPLIT"] * tile["TPC"], 1, 1), 2 * k if staged else 0
    if pdl:
        launch_pdl(kern, grid, block, args, shared_mem=smem)
    else:
        kern(grid=grid, block=block, args=args, shared_mem=smem)
    return y
