"""Paged attention in Triton: KV write by slot mapping, split-K decode, varlen causal prefill.

Cache layout (one layer): k_cache / v_cache [num_blocks, block_size, Hkv, D]; a sequence's token p
lives in block block_table[p // block_size] at offset p % block_size.

* `write_kv`: new tokens' k/v [T, Hkv, D] into their slots; a negative slot (CUDA-graph padding) is skipped.
* `decode_attention`: one query per sequence. Grid (B, Hkv, S): each program takes one KV head and
  all GQA query heads that share it (so each K/V tile is read once per group) over one of S
  contiguous slices of the context (flash-decoding); a second kernel merges the S partial results
  by their log-sum-exp. S depends only on the batch size and `max_seq_len`, never on the device
  data, so a step can be captured in a CUDA graph.
* `prefill_attention`: variable-length, causal, queries of each sequence at positions
  [seq_len - q_len, seq_len). Keys of the cached context (prefix hits, earlier chunks) are read
  from the paged cache through the block table; the step's own keys straight from the k/v the
  projection produced (contiguous rows; TMA loads on Hopper). Grid (Hq, B, q blocks), heaviest q blocks first.

FP8 cache (float8_e4m3fn, `kv_cache_dtype="fp8"`): every kernel writes clamp(x / kv_scale) in e4m3 and
reads value * kv_scale in the queries' dtype (workers/attention/kv_quant.py); the step's own keys are
rounded the same way, so a token attends to exactly what later steps will read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.cuda_launch import sm_count
from parallel.kernels.direct_launch import launch
from parallel.kernels.gemv import pdl_enabled as _pdl_enabled

try:  # TMA descriptors (Triton >= 3.4, Hopper and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

_LOG2E = 1.4426950408889634


@triton.jit
def _to_cache(x, kv_scale, cache_ptr, FP8: tl.constexpr):
    """A value for the cache: e4m3 of x / kv_scale, clamped to its finite range (FP8), else x as is."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) / kv_scale, -448.0, 448.0).to(cache_ptr.dtype.element_ty)
    return x


@triton.jit
def _from_cache(x, kv_scale, like_ptr, FP8: tl.constexpr):
    """A cache value in like_ptr's dtype (FP8: upcast times kv_scale)."""
    if FP8:
        x = (x.to(tl.float32) * kv_scale).to(like_ptr.dtype.element_ty)
    return x


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # slot_mapping[d:] in mixed steps
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, kv_scale,
                     H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    i = tl.arange(0, BLOCK)
    mask = i < H * D
    h = i // D
    d = i % D
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache + dst, _to_cache(k, kv_scale, k_cache, FP8), mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache + dst, _to_cache(v, kv_scale, v_cache, FP8), mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: float = 1.0) -> None:
    """kv_cache [2, num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D] (last dim contiguous)."""
    t, h, d = k.shape
    if t == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    assert k.stride(2) == 1 and v.stride(2) == 1 and kc.stride(3) == 1 and kc.stride(2) == d
    launch(_write_kv_kernel, (t,), k, v, kc, vc, slot_mapping,
           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           kc.stride(0), kc.stride(1), kc.stride(2), kv_scale,
           H=h, D=d, PAGE=kc.shape[1], BLOCK=triton.next_power_of_2(h * d), FP8=_is_fp8(kc), num_warps=4)


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------- decode (split-K)

@triton.jit
def _decode_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale):
    """One K/V tile of online softmax: q [G, D], k/v [BLOCK_N, D] -> updated (m_i, l_i, acc)."""
    qk = tl.dot(q, tl.trans(k)) * qk_scale  # [G_PAD, BLOCK_N], log2 domain
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width changes every step
def _decode_split_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_lens_ptr, out_ptr, part_o, part_lse,
                         k_new, v_new, slot_ptr,  # FUSE_WRITE: this step's k/v [B, Hkv, D] and their slots
                         qk_scale,  # softmax scale * log2(e)
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cb, stride_cs, stride_ch, stride_bt,
                         stride_knt, stride_knh, stride_vnt, stride_vnh, kv_scale,
                         GQA: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FUSE_WRITE: tl.constexpr,
                         USE_PDL: tl.constexpr, FP8: tl.constexpr):
    # The split count is the grid's third dimension, not a compile-time constant: one compiled kernel
    # serves every count (SPLIT: partials for the merge kernel, else the output directly).
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    if SPLIT and first >= last:
        # A split past the sequence's tiles reads and writes nothing (the new token's slot is a non-empty split's,
        # the merge skips it): it leaves before the wait for q. A batch-1 graph is captured with 32 splits for the
        # longest context, so at a short one most of its 256 programs are these. At context 128 the W4 chain ran
        # 0.9 us a layer faster with 4 splits than with 32 while they waited for the qkv GEMV and loaded q, 0.36 us
        # with this exit (scripts/bench_w4_chain.py --attn-splits 4, one H200, 2026-11-29).
        return

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    heads = kvh * GQA + offs_g
    mask_g = offs_g < GQA
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # The slice's first K/V tile holds earlier steps' tokens only (this step's token comes from registers
    # below), so it is loaded before waiting for the kernel that produces q: under PDL (batch-1 graphs) that
    # load overlaps the qkv GEMV's tail. Block tables and seq_lens were copied in before the graph started.
    offs_n = first * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < seq_len  # all false for a slice with no tiles
    blk = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
    kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
    k_first = _from_cache(tl.load(k_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0),
                          kv_scale, q_ptr, FP8)
    v_first = _from_cache(tl.load(v_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0),
                          kv_scale, q_ptr, FP8)
    if USE_PDL:  # wait for the qkv GEMV, then let the next kernel launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)
    if FUSE_WRITE:
        # The new token (position seq_len - 1) is taken from registers, not re-read from the cache, and
        # the program whose slice holds it writes it to its slot (no other program reads that slot now).
        kn = _to_cache(tl.load(k_new + b.to(tl.int64) * stride_knt + kvh * stride_knh + offs_d), kv_scale, k_cache, FP8)
        vn = _to_cache(tl.load(v_new + b.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d), kv_scale, v_cache, FP8)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        owner = (num_tiles - 1) // tiles_per_split
        if (split == owner) & (slot >= 0) & (num_tiles > 0):
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch + offs_d
            tl.store(k_cache + dst, kn)
            tl.store(v_cache + dst, vn)
        kn = _from_cache(kn, kv_scale, q_ptr, FP8)  # what later steps will read
        vn = _from_cache(vn, kv_scale, q_ptr, FP8)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if first < last:
        k, v = k_first, v_first
        if FUSE_WRITE:
            is_new = (offs_n == seq_len - 1)[:, None]
            k = tl.where(is_new, kn[None, :], k)
            v = tl.where(is_new, vn[None, :], v)
        m_i, l_i, acc = _decode_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale)
    for tile in range(first + 1, last):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        blk = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        k = _from_cache(tl.load(k_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0),
                        kv_scale, q_ptr, FP8)
        v = _from_cache(tl.load(v_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0),
                        kv_scale, q_ptr, FP8)
        if FUSE_WRITE:
            is_new = (offs_n == seq_len - 1)[:, None]
            k = tl.where(is_new, kn[None, :], k)
            v = tl.where(is_new, vn[None, :], v)
        m_i, l_i, acc = _decode_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale)

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    elif first < last:  # a split with no tiles writes nothing: the merge reads only the splits in use
        # partials: part_o [B, Hq, S, D] fp32 (normalised), part_lse [B, Hq, S] (log2 domain, -inf if empty)
        row = (b.to(tl.int64) * (tl.num_programs(1) * GQA) + heads) * num_splits + split  # [G_PAD]
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_o + row[:, None] * D + offs_d[None, :], out, mask=mask_g[:, None])
        tl.store(part_lse + row, lse, mask=mask_g)


@triton.jit
def _decode_reduce_kernel(part_o, part_lse, out_ptr, seq_lens_ptr, stride_ot, stride_oh, HQ: tl.constexpr,
                          D: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          SEQ_USED: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    used = NUM_SPLITS
    if SEQ_USED:  # program b is sequence b: only the splits that hold its tiles wrote partials (a short sequence
        # in a graph captured for the longest fills few of them)
        num_tiles = tl.cdiv(tl.load(seq_lens_ptr + b), BLOCK_N)  # seq_lens was copied in before the step
        used = tl.cdiv(num_tiles, tl.cdiv(num_tiles, NUM_SPLITS))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < used
    base = (b.to(tl.int64) * HQ + h) * NUM_SPLITS
    lse = tl.load(part_lse + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    o = tl.load(part_o + (base + offs_s)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def decode_block_n(block_size: int) -> int:
    return 64


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Enough programs for ~2 waves, no more splits than 64-token tiles. Depends on host ints only."""
    tiles = max(1, -(-max_seq_len // 64))
    want = max(1, -(-2 * num_sms // max(1, num_seqs * num_kv_heads)))
    s = min(want, tiles, 64)
    return 1 << (s.bit_length() - 1)  # a power of two, rounded down


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, max_seq_len: int, out: torch.Tensor | None = None,
                     num_splits: int | None = None, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None, kv_scale: float = 1.0,
                     tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]. The new token's k/v are either already in the cache, or given as
    k_new/v_new [B, Hkv, D] with slot_mapping [B]: then this kernel writes them (one launch less).
    Splits with no tile of their sequence write nothing, and the merge reads only the splits in use.
    tile: the split kernel's (BLOCK_N keys a step, warps, pipeline stages) in place of (64, 4, 2), for sweeps
    (scripts/bench_decode_attention.py --tiles)."""
    b, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    gqa = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    s = num_splits or num_decode_splits(b, hkv, max_seq_len, sm_count(q.device))
    g_pad = max(16, triton.next_power_of_2(gqa))
    if s > 1:
        part_o = torch.empty(b, hq, s, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_n, warps, stages = tile or (decode_block_n(kc.shape[1]), 4, 2)
    # Batch-1 graphs chain GEMV -> split -> reduce -> GEMV with programmatic dependent launches
    # (parallel/kernels/gemv.py): each kernel is resident before its predecessor ends.
    pdl = b == 1 and q.is_cuda and torch.cuda.is_current_stream_capturing() and _pdl_enabled()
    pdl_kw = dict(launch_pdl=True) if pdl else {}
    fuse = k_new is not None
    if fuse:
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1 and slot_mapping is not None
    else:
        k_new = v_new = q
        slot_mapping = seq_lens
    launch(
        _decode_split_kernel, (b, hkv, s),
        q, kc, vc, block_tables, seq_lens, out, part_o, part_lse, k_new, v_new, slot_mapping, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), kv_scale,
        GQA=gqa, G_PAD=g_pad, D=d, PAGE=kc.shape[1], BLOCK_N=block_n, SPLIT=s > 1, FUSE_WRITE=fuse,
        USE_PDL=pdl, FP8=_is_fp8(kc), num_warps=warps, num_stages=stages, **pdl_kw)
    if s > 1:
        launch(_decode_reduce_kernel, (b, hq), part_o, part_lse, out, seq_lens, out.stride(0), out.stride(1), HQ=hq,
               D=d, NUM_SPLITS=s, S_PAD=triton.next_power_of_2(s), BLOCK_N=block_n, SEQ_USED=True, USE_PDL=pdl,
               num_warps=4, **pdl_kw)
    return out


# ---------------------------------------------------------------- prefill (varlen, causal, paged)

@triton.jit
def _prefill_tile(q, k, v, m_i, l_i, acc, qk_scale, visible, MASK: tl.constexpr):
    """One K/V tile of online softmax; q [M, D], k/v [N, D], visible [M, N] (used only with MASK)."""
    qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:  # scale folded into the exponent's subtraction (one FMA per score)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # the MMA accumulates into the rescaled acc
    return m_new, l_i, acc


# Every step changes the block-table width, and a mixed step's slices (seq_lens[d:]...) their alignment:
# specialising on either compiled 14 new variants while serving an 8B offline run (H100).
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr", "qsl_ptr"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, k_cache, v_cache, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                    qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt, kv_scale,
                    GQA: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr):
    # Heads vary fastest (GQA neighbours share K/V tiles in L2) and query blocks run last-first: the
    # causal blocks with the most keys start first, so the grid's tail is the short ones.
    h = tl.program_id(0)
    b = tl.program_id(1)
    qb = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qb * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b) - q_len
    kvh = h // GQA
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within this sequence's new tokens
    offs_d = tl.arange(0, D)
    mask_m = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # 1. Cached context [0, ctx), through the block table: every query sees all of it.
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    ctx_full = (ctx // BLOCK_N) * BLOCK_N
    for start_n in range(0, ctx_full, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        k = _from_cache(tl.load(k_cache + kv_off[:, None] + offs_d[None, :]), kv_scale, q_ptr, FP8)
        v = _from_cache(tl.load(v_cache + kv_off[:, None] + offs_d[None, :]), kv_scale, q_ptr, FP8)
        m_i, l_i, acc = _prefill_tile(q, k, v, m_i, l_i, acc, qk_scale, None, False)
    if ctx_full < ctx:
        offs_n = ctx_full + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx
        blk = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        k = _from_cache(tl.load(k_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0),
                        kv_scale, q_ptr, FP8)
        v = _from_cache(tl.load(v_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0),
                        kv_scale, q_ptr, FP8)
        m_i, l_i, acc = _prefill_tile(q, k, v, m_i, l_i, acc, qk_scale, mask_n[None, :], True)
    # 2. This step's own keys, read from the k/v the projection just produced (contiguous rows, no
    # block-table gather). New keys below qb * BLOCK_M are visible to every query of the block;
    # the diagonal tiles take the causal mask.
    full_end = qb * BLOCK_M
    diag_end = tl.minimum(full_end + BLOCK_M, q_len)
    for start_n in range(0, full_end, BLOCK_N):
        if TMA:
            k = k_desc.load([q_start + start_n, kvh * D])
            v = v_desc.load([q_start + start_n, kvh * D])
        else:
            offs_n = (q_start + start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
            k = tl.load(k_ptr + offs_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :])
            v = tl.load(v_ptr + offs_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :])
        if FP8:  # the step's own keys as the cache holds them
            k = _from_cache(_to_cache(k, kv_scale, k_cache, FP8), kv_scale, q_ptr, FP8)
            v = _from_cache(_to_cache(v, kv_scale, v_cache, FP8), kv_scale, q_ptr, FP8)
        m_i, l_i, acc = _prefill_tile(q, k, v, m_i, l_i, acc, qk_scale, None, False)
    for start_n in range(full_end, diag_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < q_len
        if TMA:  # rows past the sequence are the next one's (or zero-filled past T): masked below
            k = k_desc.load([q_start + start_n, kvh * D])
            v = v_desc.load([q_start + start_n, kvh * D])
        else:
            kv_rows = (q_start + offs_n).to(tl.int64)
            k = tl.load(k_ptr + kv_rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=mask_n[:, None], other=0.0)
            v = tl.load(v_ptr + kv_rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None], other=0.0)
        if FP8:
            k = _from_cache(_to_cache(k, kv_scale, k_cache, FP8), kv_scale, q_ptr, FP8)
            v = _from_cache(_to_cache(v, kv_scale, v_cache, FP8), kv_scale, q_ptr, FP8)
        visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        m_i, l_i, acc = _prefill_tile(q, k, v, m_i, l_i, acc, qk_scale, visible, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def prefill_tiles(max_query_len: int, head_dim: int, element_size: int, tma: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel. From an H100 sweep at 8K tokens,
    D=128, bf16 (scripts/bench_prefill_attention.py): with TMA loads 128 x 128 tiles, 8 warps, 3 stages
    (546 TFLOP/s); with plain loads 128 x 64 (443) -- three stages of 128 x 128 K/V tiles need Hopper's
    shared memory."""
    if max_query_len >= 128 and head_dim <= 128 and element_size == 2:
        return (128, 128, 8, 3) if tma else (128, 64, 8, 3)
    if max_query_len >= 128 and head_dim <= 128:  # fp32 tiles: three stages would not fit in shared memory
        return 128, 64, 8, 2
    return max(16, min(64, triton.next_power_of_2(max_query_len))), 64, 4, 2


def _tma_supported(*xs: torch.Tensor) -> bool:
    """TMA needs Hopper or newer and 16-byte aligned bases and row strides."""
    x = xs[0]
    if _TensorDescriptor is None or not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in xs)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      max_query_len: int, scale: float, out: torch.Tensor | None = None,
                      tiles: tuple[int, int, int, int] | None = None, tma: bool | None = None,
                      kv_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D]: this step's tokens laid end to end per sequence (query_start_loc
    [B+1]). The context before them is read from the paged cache; their own keys from k/v (which
    `write_kv` also puts in the cache). Returns [T, Hq, D]. `tiles`/`tma` override the defaults (benchmarks)."""
    t, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    assert k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == d and v.stride(1) == d
    use_tma = _tma_supported(k, v) if tma is None else tma
    block_m, block_n, warps, stages = tiles or prefill_tiles(max_query_len, d, q.element_size(), use_tma)
    k_desc = v_desc = None
    if use_tma:  # 2-D views [T, Hkv * D] with their row strides: one TMA box is one head's BLOCK_N rows
        k_desc = _TensorDescriptor(k, [t, hkv * d], [k.stride(0), 1], [block_n, d])
        v_desc = _TensorDescriptor(v, [t, hkv * d], [v.stride(0), 1], [block_n, d])
    grid = (hq, b, triton.cdiv(max_query_len, block_m))
    launch(_prefill_kernel, grid, q, k, v, k_desc, v_desc, kc, vc, block_tables, seq_lens, query_start_loc, out,
           scale * _LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           out.stride(0), out.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
           kv_scale, GQA=hq // hkv, D=d, PAGE=kc.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, TMA=use_tma,
           FP8=_is_fp8(kc), num_warps=warps, num_stages=stages)
    return out
