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
  [seq_len - q_len, seq_len); keys (prefix-cached context and the new tokens, already written)
  are read from the paged cache through the block table. Grid (Hq, B, q blocks), heaviest q blocks first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels.gemv import pdl_enabled as _pdl_enabled

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(k_cache + dst, k, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache + dst, v, mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D] (last dim contiguous)."""
    t, h, d = k.shape
    if t == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    assert k.stride(2) == 1 and v.stride(2) == 1 and kc.stride(3) == 1 and kc.stride(2) == d
    _write_kv_kernel[(t,)](k, v, kc, vc, slot_mapping,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kc.stride(0), kc.stride(1), kc.stride(2),
                           H=h, D=d, PAGE=kc.shape[1], BLOCK=triton.next_power_of_2(h * d), num_warps=4)


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


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_lens_ptr, out_ptr, part_o, part_lse,
                         k_new, v_new, slot_ptr,  # FUSE_WRITE: this step's k/v [B, Hkv, D] and their slots
                         qk_scale,  # softmax scale * log2(e)
                         stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cb, stride_cs, stride_ch, stride_bt,
                         stride_knt, stride_knh, stride_vnt, stride_vnh,
                         GQA: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSE_WRITE: tl.constexpr,
                         USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)

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
    k_first = tl.load(k_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v_first = tl.load(v_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    if USE_PDL:  # wait for the qkv GEMV, then let the next kernel launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)
    if FUSE_WRITE:
        # The new token (position seq_len - 1) is taken from registers, not re-read from the cache, and
        # the program whose slice holds it writes it to its slot (no other program reads that slot now).
        kn = tl.load(k_new + b.to(tl.int64) * stride_knt + kvh * stride_knh + offs_d)
        vn = tl.load(v_new + b.to(tl.int64) * stride_vnt + kvh * stride_vnh + offs_d)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        owner = (num_tiles - 1) // tiles_per_split
        if (split == owner) & (slot >= 0) & (num_tiles > 0):
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch + offs_d
            tl.store(k_cache + dst, kn)
            tl.store(v_cache + dst, vn)
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
        k = tl.load(k_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        if FUSE_WRITE:
            is_new = (offs_n == seq_len - 1)[:, None]
            k = tl.where(is_new, kn[None, :], k)
            v = tl.where(is_new, vn[None, :], v)
        m_i, l_i, acc = _decode_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        # partials: part_o [B, Hq, S, D] fp32 (normalised), part_lse [B, Hq, S] (log2 domain, -inf if empty)
        row = (b.to(tl.int64) * (tl.num_programs(1) * GQA) + heads) * NUM_SPLITS + split  # [G_PAD]
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_o + row[:, None] * D + offs_d[None, :], out, mask=mask_g[:, None])
        tl.store(part_lse + row, lse, mask=mask_g)


@triton.jit
def _decode_reduce_kernel(part_o, part_lse, out_ptr, stride_ot, stride_oh, HQ: tl.constexpr,
                          D: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < NUM_SPLITS
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


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, max_seq_len: int, out: torch.Tensor | None = None,
                     num_splits: int | None = None, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]. The new token's k/v are either already in the cache, or given as
    k_new/v_new [B, Hkv, D] with slot_mapping [B]: then this kernel writes them (one launch less)."""
    b, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    gqa = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    s = num_splits or num_decode_splits(b, hkv, max_seq_len, _sm_count(q.device))
    g_pad = max(16, triton.next_power_of_2(gqa))
    if s > 1:
        part_o = torch.empty(b, hq, s, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_n = decode_block_n(kc.shape[1])
    # Batch-1 graphs chain GEMV -> split -> reduce -> GEMV with programmatic dependent launches
    # (workers/kernels/gemv.py): each kernel is resident before its predecessor ends.
    pdl = b == 1 and torch.cuda.is_current_stream_capturing() and _pdl_enabled()
    launch = dict(launch_pdl=True) if pdl else {}
    fuse = k_new is not None
    if fuse:
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1 and slot_mapping is not None
    else:
        k_new = v_new = q
        slot_mapping = seq_lens
    _decode_split_kernel[(b, hkv, s)](
        q, kc, vc, block_tables, seq_lens, out, part_o, part_lse, k_new, v_new, slot_mapping, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GQA=gqa, G_PAD=g_pad, D=d, PAGE=kc.shape[1], BLOCK_N=block_n, NUM_SPLITS=s, FUSE_WRITE=fuse,
        USE_PDL=pdl, num_warps=4, num_stages=2, **launch)
    if s > 1:
        _decode_reduce_kernel[(b, hq)](part_o, part_lse, out, out.stride(0), out.stride(1), HQ=hq, D=d,
                                       NUM_SPLITS=s, S_PAD=triton.next_power_of_2(s), USE_PDL=pdl, num_warps=4, **launch)
    return out


# ---------------------------------------------------------------- prefill (varlen, causal, paged)

@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt,
                    GQA: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Heads vary fastest (GQA neighbours share K/V tiles in L2) and query blocks run last-first: the
    # causal blocks with the most keys start first, so the grid's tail is the short ones.
    h = tl.program_id(0)
    b = tl.program_id(1)
    qb = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    kvh = h // GQA
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    q_pos = ctx + offs_m  # absolute positions of the queries
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_end = ctx + tl.minimum((qb + 1) * BLOCK_M, q_len)  # last query of this block sees keys < kv_end
    # keys below ctx + qb * BLOCK_M are visible to every query of the block: no causal mask needed there
    full_end = ctx + qb * BLOCK_M
    full_end = (full_end // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        k = tl.load(k_cache + kv_off[:, None] + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_off[:, None] + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for start_n in range(full_end, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        blk = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        k = tl.load(k_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] laid end to end per sequence (query_start_loc [B+1]); k/v of the new tokens must
    already be in the cache. Returns [T, Hq, D]."""
    t, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    if max_query_len >= 128 and d <= 128 and q.element_size() == 2:
        # H100, 8K-token causal prefill, D=128 (scripts/bench_prefill_attention.py): 367 TFLOP/s vs 306 with (128, 64, 8, 2)
        block_m, block_n, warps, stages = 128, 64, 4, 3
    elif max_query_len >= 128 and d <= 128:  # fp32 tiles: three stages would not fit in shared memory
        block_m, block_n, warps, stages = 128, 64, 8, 2
    else:
        block_m = max(16, min(64, triton.next_power_of_2(max_query_len)))
        block_n, warps, stages = 64, 4, 2
    grid = (hq, b, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](q, kc, vc, block_tables, seq_lens, query_start_loc, out, scale * _LOG2E,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                          kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
                          GQA=hq // hkv, D=d, PAGE=kc.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
                          num_warps=warps, num_stages=stages)
    return out
