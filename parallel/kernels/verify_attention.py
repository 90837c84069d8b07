"""Attention for a few query tokens per sequence over a long paged context (a speculative verification
step: each sequence runs its last token and k drafts), split over the context like flash-decoding.

The prefill kernel (paged_attention.py) gives each query head one program per 16..64-query tile: at
batch 1 with k + 1 = 2..9 queries that is one program per head (32 for Llama-3.1-8B) on a 132-SM H100,
each walking the whole context alone, and the step's attention took 0.85 ms against 0.55 ms for a
decode step at a 1,024-token context (docs/benchmarks.md, issue 16), growing with the context.
Here, as in the decode kernel, a program takes one KV head and all of its GQA query heads, now for every
query token of the sequence (GQA x q rows of one tl.dot, so each K/V tile is read once for all of them),
over one of S slices of the context; `_decode_reduce_kernel` then merges the S partials of every
(token, head) by their log-sum-exp. S depends on the batch size and `max_seq_len` only, never on device
data, so the step can be captured in a CUDA graph (workers/spec_decode/graphs.py).

The query at position p sees the keys at positions <= p (causal within the new tokens). The step's own
k/v are given to the kernel, which writes them to their slots (one program per KV head does) and reads them
from those rows, not from the cache, rounded to the cache's format first (FP8), so every key is read as
later steps will read it; the backend's KV-write launch before the attention is gone. Without them
(`k_new=None`) the kernel reads everything from the cache, which `write_kv` must have filled.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.cuda_launch import sm_count
from parallel.kernels.direct_launch import launch
from parallel.kernels.paged_attention import (_LOG2E, _decode_reduce_kernel, _from_cache, _is_fp8,
                                              _to_cache, decode_block_n, num_decode_splits)

# Query rows (GQA heads x query tokens) one program holds: acc [rows, D] and the scores [rows, BLOCK_N]
# live in registers of 4 warps. Steps of longer queries go to the prefill kernel (`applies`).
MAX_ROWS = 64
MAX_QUERY = 16  # k + 1 for k <= 15; longer queries are prefill chunks


@triton.jit
def _verify_tile(q, k, v, visible, m_i, l_i, acc, qk_scale):
    """One K/V tile of online softmax; q [M, D], k/v [N, D], visible [M, N]. A row may see none of a
    tile (a tile past its position): its max stays -inf and nothing is added to it."""
    qk = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0 instead of nan
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _kv_tile(cache, new_ptr, kv_off, new_rows, stride_nt, stride_nh, kvh, offs_d, from_cache, is_new, kv_scale, like_ptr,
             FP8: tl.constexpr, FUSE_WRITE: tl.constexpr):
    """A K or V tile [BLOCK_N, D] in like_ptr's dtype. Positions before the step's tokens come from the cache;
    with FUSE_WRITE the step's own come from new_ptr (its k or v rows), rounded as the cache will hold them."""
    x = _from_cache(tl.load(cache + kv_off[:, None] + offs_d[None, :], mask=from_cache[:, None], other=0.0),
                    kv_scale, like_ptr, FP8)
    if FUSE_WRITE:
        xn = tl.load(new_ptr + new_rows[:, None] * stride_nt + kvh * stride_nh + offs_d[None, :], mask=is_new[:, None],
                     other=0.0)
        x = tl.where(is_new[:, None], _from_cache(_to_cache(xn, kv_scale, cache, FP8), kv_scale, like_ptr, FP8), x)
    return x


@triton.jit
def _write_new(cache, new_ptr, slot_ptr, q_start, q_len, stride_nt, stride_nh, kvh, offs_d,
               stride_cb, stride_cs, stride_ch, kv_scale, PAGE: tl.constexpr, Q_PAD: tl.constexpr, FP8: tl.constexpr):
    """The step's own k (or v) rows of one KV head into their cache slots; a negative slot (graph padding) is skipped."""
    offs_t = tl.arange(0, Q_PAD)
    slot = tl.load(slot_ptr + q_start + offs_t, mask=offs_t < q_len, other=-1).to(tl.int64)
    ok = slot >= 0
    rows = (q_start + offs_t).to(tl.int64)
    x = tl.load(new_ptr + rows[:, None] * stride_nt + kvh * stride_nh + offs_d[None, :], mask=ok[:, None], other=0.0)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kvh * stride_ch
    tl.store(cache + dst[:, None] + offs_d[None, :], _to_cache(x, kv_scale, cache, FP8), mask=ok[:, None])


@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr", "qsl_ptr", "slot_ptr"])  # slices in mixed steps
def _verify_split_kernel(q_ptr, k_cache, v_cache, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_o, part_lse,
                         k_new, v_new, slot_ptr,  # FUSE_WRITE: the step's k/v [T, Hkv, D] and their slots [T]
                         qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                         stride_cb, stride_cs, stride_ch, stride_bt,
                         stride_knt, stride_knh, stride_vnt, stride_vnh, kv_scale,
                         HQ: tl.constexpr, GQA: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, Q_PAD: tl.constexpr, FP8: tl.constexpr,
                         FUSE_WRITE: tl.constexpr):
    # Grid (B, Hkv, S). Row r of the program's tile is query token r // GQA of the sequence and query head
    # kvh * GQA + r % GQA; rows past the sequence's query count are masked throughout.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)

    offs_r = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, D)
    if FUSE_WRITE:
        # No program of this launch reads these slots (the step's own keys come from k_new/v_new below; a
        # block that takes new tokens is this sequence's alone), so the first slice's program writes them.
        if split == 0:
            _write_new(k_cache, k_new, slot_ptr, q_start, q_len, stride_knt, stride_knh, kvh, offs_d,
                       stride_cb, stride_cs, stride_ch, kv_scale, PAGE, Q_PAD, FP8)
            _write_new(v_cache, v_new, slot_ptr, q_start, q_len, stride_vnt, stride_vnh, kvh, offs_d,
                       stride_cb, stride_cs, stride_ch, kv_scale, PAGE, Q_PAD, FP8)
    tok = offs_r // GQA
    heads = kvh * GQA + offs_r % GQA
    mask_r = tok < q_len
    pos = tl.where(mask_r, ctx + tok, -1)  # a masked row sees no key
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None], other=0.0)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for tile in range(first, last):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        if FUSE_WRITE:
            from_cache = mask_n & (offs_n < ctx)
        else:  # the step's own k/v are in the cache already
            from_cache = mask_n
        is_new = mask_n & (offs_n >= ctx)
        new_rows = (q_start + offs_n - ctx).to(tl.int64)
        blk = tl.load(bt_row + offs_n // PAGE, mask=from_cache, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (offs_n % PAGE) * stride_cs + kvh * stride_ch
        k = _kv_tile(k_cache, k_new, kv_off, new_rows, stride_knt, stride_knh, kvh, offs_d, from_cache, is_new,
                     kv_scale, q_ptr, FP8, FUSE_WRITE)
        v = _kv_tile(v_cache, v_new, kv_off, new_rows, stride_vnt, stride_vnh, kvh, offs_d, from_cache, is_new,
                     kv_scale, q_ptr, FP8, FUSE_WRITE)
        visible = mask_n[None, :] & (offs_n[None, :] <= pos[:, None])
        m_i, l_i, acc = _verify_tile(q, k, v, visible, m_i, l_i, acc, qk_scale)

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if num_splits == 1:  # a runtime branch, not a constexpr: one compiled variant serves every split count
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None])
    else:
        # partials by (token, head, split), as `_decode_reduce_kernel` reads them with one program per token
        prow = (rows * HQ + heads) * num_splits + split
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_o + prow[:, None] * D + offs_d[None, :], out, mask=mask_r[:, None])
        tl.store(part_lse + prow, lse, mask=mask_r)


def tile_rows(gqa: int) -> int:
    """Rows of a program's query tile, fixed per model (GQA x MAX_QUERY, a power of two in [16, MAX_ROWS]):
    one compiled variant for every query length, so the start-up warm-up's 16-token prefill compiles the
    one that verification steps and short prompts use, and none compiles while serving."""
    return min(MAX_ROWS, max(16, triton.next_power_of_2(MAX_QUERY * gqa)))


def applies(max_query_len: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether this kernel takes a step whose longest query is max_query_len tokens: 2..MAX_QUERY that fit a tile."""
    gqa = num_heads // num_kv_heads
    return 1 < max_query_len <= MAX_QUERY and max_query_len * gqa <= tile_rows(gqa)


def verify_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float,
                     out: torch.Tensor | None = None, num_splits: int | None = None, kv_scale: float = 1.0,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], T the step's query tokens laid end to end per sequence (query_start_loc [B + 1]) -> [T, Hq, D],
    causal. The step's k/v are either in the cache already, or given as k_new/v_new [T, Hkv, D] with
    slot_mapping [T]: then this kernel writes them (no `write_kv` launch before it). max_seq_len bounds
    seq_lens (it sizes S)."""
    t, hq, d = q.shape
    kc, vc = kv_cache[0], kv_cache[1]
    hkv = kc.shape[2]
    gqa = hq // hkv
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    m_pad = tile_rows(gqa)
    if max_query_len * gqa > m_pad or max_query_len > MAX_QUERY:
        raise ValueError(f"verify_attention: {max_query_len} queries x GQA {gqa} exceed a tile of {m_pad} rows")
    s = num_splits or num_decode_splits(b, hkv, max_seq_len, sm_count(q.device))
    if s > 1:
        part_o = torch.empty(t, hq, s, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t, hq, s, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    fuse = k_new is not None
    if fuse:
        assert v_new is not None and slot_mapping is not None and k_new.stride(2) == 1 and v_new.stride(2) == 1
    else:
        k_new = v_new = q  # unread
        slot_mapping = seq_lens
    launch(
        _verify_split_kernel, (b, hkv, s),
        q, kc, vc, block_tables, seq_lens, query_start_loc, out, part_o, part_lse, k_new, v_new, slot_mapping,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), kv_scale,
        HQ=hq, GQA=gqa, M_PAD=m_pad, D=d, PAGE=kc.shape[1], BLOCK_N=decode_block_n(kc.shape[1]), Q_PAD=MAX_QUERY,
        FP8=_is_fp8(kc), FUSE_WRITE=fuse, num_warps=4, num_stages=2)
    if s > 1:
        # one program per token, every split's partials written: the merge reads all S
        launch(_decode_reduce_kernel, (t, hq), part_o, part_lse, out, seq_lens, out.stride(0), out.stride(1), HQ=hq,
               D=d, NUM_SPLITS=s, S_PAD=triton.next_power_of_2(s), BLOCK_N=decode_block_n(kc.shape[1]), SEQ_USED=False,
               USE_PDL=False, num_warps=4)
    return out
