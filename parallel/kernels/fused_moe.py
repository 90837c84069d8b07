"""Fused mixture-of-experts MLP in Triton: tokens sorted by expert, grouped GEMMs, no host sync.

Steps (all on the device, so a decode step with MoE can be captured in a CUDA graph):
1. `align_by_expert`: the T*k (token, slot) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M with a sentinel (T*k), and the expert of every BLOCK_M-row block. Sizes are
   upper bounds known on the host (T*k + E*(BLOCK_M-1) rows), so nothing is read back.
2. grouped GEMM 1: for each block, rows x[pair // k] times w13[e]^T -> [T*k, 2I] (in sorted-pair
   row order it writes back to pair rows).
3. SiLU-and-mul -> [T*k, I].
4. grouped GEMM 2: rows times w2[e]^T, scaled by the routing weight -> [T*k, H]; summed over k.
The expert loop in `workers/models/moe.py` stays the reference (and the CPU path).
FP8 experts (e4m3 weights, a float32 scale per (bn, bk) block, workers/models/moe.py) run weight-only: each
B tile is loaded in e4m3, scaled by its blocks' scales in fp32 and cast to the activations' dtype before the
dot, so the weights cross HBM at one byte each. K tiles are cut no larger than bk, so a tile's columns share
one scale column.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.fused_ops import silu_and_mul


# The pair count changes every step: specialising on it (multiple of 16 or not) would compile while serving.
@triton.jit(do_not_specialize=["num_valid"])
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
                         scale_ptr, N, K, num_valid,
                         stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn, stride_sk,
                         TOP_K_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, SCALED: tl.constexpr,
                         SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering so that consecutive programs share B tiles in L2
    group = GROUP_M * num_pid_n
    gid = pid // group
    first_m = gid * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    if size_m <= 0:
        return
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_valid
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    row = (pair // TOP_K_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + e * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN] view of w[e]^T
    mask_n = offs_n < N
    if SCALED:
        s_ptrs = scale_ptr + e * stride_se + (offs_n // SCALE_BN).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if SCALED:  # e4m3 weights: this K tile's scale of each output column (BLOCK_K <= SCALE_BK)
            s = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk, mask=mask_n, other=0.0)
            b = (b.to(tl.float32) * s[None, :]).to(a.dtype)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=valid, other=0.0)
        acc = acc * w[:, None]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], c, mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["n", "max_rows", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, scratch_ptr, n, expert_start, max_rows,
                  num_blocks, E: tl.constexpr, NBINS: tl.constexpr, N_PAD: tl.constexpr, NB_PAD: tl.constexpr,
                  BM: tl.constexpr, FILL: tl.constexpr):
    """One program does what `_align_torch` does in ~15 launches (decode-sized batches)."""
    offs = tl.arange(0, N_PAD)
    valid = offs < n
    e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32) - expert_start
    e = tl.where(valid & (e >= 0) & (e < E), e, E)  # not local (EP) or padding: bin E, dropped
    counts = tl.histogram(e, NBINS)
    bins = tl.arange(0, NBINS)
    cnt = tl.where(bins < E, counts, 0)
    padded = (cnt + BM - 1) // BM * BM
    pend = tl.cumsum(padded, 0)
    cend = tl.cumsum(cnt, 0)
    tl.store(scratch_ptr + bins, cend - cnt)
    tl.store(scratch_ptr + NBINS + bins, pend - padded)
    tl.store(scratch_ptr + 2 * NBINS + bins, pend)
    for r in range(0, max_rows, FILL):  # every row a sentinel first
        ro = r + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + ro, n, mask=ro < max_rows)
    tl.debug_barrier()
    skey = tl.sort(e * N_PAD + offs)  # by expert, then by pair index (stable)
    se = skey // N_PAD
    sj = skey % N_PAD
    keep = se < E
    se_c = tl.where(keep, se, 0)
    cstart = tl.load(scratch_ptr + se_c)
    pstart = tl.load(scratch_ptr + NBINS + se_c)
    tl.store(sorted_ids_ptr + pstart + (offs - cstart), sj.to(tl.int64), mask=keep)
    blocks = tl.arange(0, NB_PAD)
    owner = tl.zeros([NB_PAD], tl.int32)
    for x in range(E):
        owner += (tl.load(scratch_ptr + 2 * NBINS + x) <= blocks * BM).to(tl.int32)
    tl.store(block_expert_ptr + blocks, tl.minimum(owner, E - 1).to(tl.int64), mask=blocks < num_blocks)
    tl.store(num_padded_ptr, tl.sum(padded, 0).to(tl.int64))


_ALIGN_KERNEL_MAX_PAIRS = 4096


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_start: int = 0):
    """topk_ids [T, k] global expert ids; local experts are [expert_start, expert_start + num_experts)
    (others are dropped) -> sorted_ids [max_rows] (pair index, sentinel T*k), block_expert
    [max_rows // block_m], num_padded [1]. max_rows depends only on the shapes."""
    n = topk_ids.numel()
    max_rows = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    if n > _ALIGN_KERNEL_MAX_PAIRS or not topk_ids.is_cuda:
        return _align_torch(topk_ids - expert_start if expert_start else topk_ids, num_experts, block_m)
    dev = topk_ids.device
    nbins = triton.next_power_of_2(num_experts + 1)
    sorted_ids = torch.empty(max_rows, dtype=torch.int64, device=dev)
    num_blocks = max_rows // block_m
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=dev)
    num_padded = torch.empty(1, dtype=torch.int64, device=dev)
    scratch = torch.empty(3 * nbins, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](topk_ids.contiguous(), sorted_ids, block_expert, num_padded, scratch, n, expert_start, max_rows,
                        num_blocks, E=num_experts, NBINS=nbins, N_PAD=triton.next_power_of_2(n),
                        NB_PAD=triton.next_power_of_2(num_blocks), BM=block_m, FILL=1024, num_warps=8)
    return sorted_ids, block_expert, num_padded


def _align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] (local expert ids; ids outside [0, E) are dropped) ->
    sorted_ids [max_rows] (pair index, sentinel T*k), block_expert [max_rows // block_m], num_padded [1]."""
    dev = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    n = flat.numel()
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)  # dropped pairs sort last, into a bin of their own
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    e_sorted = key[order]
    max_rows = n + num_experts * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    sorted_ids = torch.full((max_rows + block_m,), n, dtype=torch.int64, device=dev)  # + one spare block
    rank = torch.arange(n, device=dev) - start.gather(0, e_sorted.clamp(max=num_experts - 1))
    dest = torch.where(e_sorted < num_experts, padded_start.gather(0, e_sorted.clamp(max=num_experts - 1)) + rank,
                       max_rows)  # dropped pairs land in the spare block, which no program reads
    sorted_ids.scatter_(0, dest, order)
    sorted_ids = sorted_ids[:max_rows]
    blocks = torch.arange(max_rows // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, blocks, right=True).clamp(max=num_experts - 1)
    num_padded = padded_end[-1:].clone()
    return sorted_ids, block_expert, num_padded


def _config(m_per_expert: float, n: int, k: int):
    if m_per_expert <= 16:  # decode: memory-bound, many narrow programs for more loads in flight
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _grouped_gemm(a, w, out, sorted_ids, block_expert, num_padded, weights, num_valid, top_k_div, mul_weight, cfg,
                  scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)):
    """scale [E, ceil(N / bn), ceil(K / bk)] with block (bn, bk): w is e4m3, element (n, k) scaled by
    scale[e, n // bn, k // bk]."""
    n, k = w.shape[1], w.shape[2]
    max_rows = sorted_ids.shape[0]
    if scale is not None and block[1] < k:  # a K tile must not straddle two scale columns
        cfg = {**cfg, "BLOCK_K": min(cfg["BLOCK_K"], block[1])}
    grid = (triton.cdiv(max_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    s = scale if scale is not None else weights  # an unread placeholder pointer when not scaled
    strides = scale.stride() if scale is not None else (0, 0, 0)
    _grouped_gemm_kernel[grid](a, w, out, sorted_ids, block_expert, num_padded, weights, s, n, k, num_valid,
                               a.stride(0), w.stride(0), w.stride(1), out.stride(0), *strides,
                               TOP_K_DIV=top_k_div, MUL_WEIGHT=mul_weight, SCALED=scale is not None,
                               SCALE_BN=block[0], SCALE_BK=max(block[1], 1), **cfg)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_start: int = 0, num_experts_total: int | None = None,
              fp8_scales: tuple | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_ids [T, k] global ids; topk_weights [T, k] fp32
    -> [T, H] (this rank's partial sum over its local experts w13/w2 = experts [expert_start, expert_start + E)
    of num_experts_total; None: all experts are local). fp8_scales: (w13_scale, w13_block, w2_scale, w2_block)
    for e4m3 w13/w2 (see `_grouped_gemm`)."""
    t, hdim = x.shape
    e, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    cfg = _config(t * top_k / e, two_i, hdim)
    sorted_ids, block_expert, num_padded = align_by_expert(topk_ids, e, cfg["BLOCK_M"], expert_start)
    n_pairs = t * top_k
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    # rows of pairs routed to no local expert stay unwritten in h1 and zero in y
    h1 = torch.empty(n_pairs, two_i, dtype=x.dtype, device=x.device)
    s13, b13, s2, b2 = fp8_scales if fp8_scales is not None else (None, (1, 1), None, (1, 1))
    _grouped_gemm(x, w13, h1, sorted_ids, block_expert, num_padded, weights, n_pairs, top_k, False, cfg, s13, b13)
    act = silu_and_mul(h1)
    # with every expert local, every pair's row is written; otherwise (EP) the others must read as zero
    all_local = expert_start == 0 and (num_experts_total is None or num_experts_total == e)
    y = (torch.empty if all_local else torch.zeros)(n_pairs, hdim, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, sorted_ids, block_expert, num_padded, weights, n_pairs, 1, True, cfg, s2, b2)
    return y.view(t, top_k, hdim).sum(dim=1)

