"""One ring-attention step in Triton: a query chunk against one K/V chunk, with its log-sum-exp.

`chunk_attention(q, k, v, scale, q_pos, k_pos)`: q [Tq, Hq, D], k/v [Tk, Hkv, D] (GQA: query head h
reads KV head h // (Hq / Hkv), KV heads never repeated); q_pos [Tq] / k_pos [Tk] ascending absolute
positions of the rows (a query sees the keys at positions <= its own), or both None (every query sees
every key). Returns out [Tq, Hq, D] and lse [Tq, Hq] fp32 (-inf, out 0, for a row that sees no key).
`chunk_attention_merge_` instead merges the chunk's attention into running fp32 accumulators
(out, lse) in place, exactly (the LSE merge of parallel/ring_attention.py), so a ring step allocates nothing
the size of the chunk's output.

Flash-attention-2 style: one program per (query head, BLOCK_M query rows), online softmax over BLOCK_N key
tiles in registers, exp2 with log2(e) folded into the scale. Positions may be any ascending sets (the SP
layout interleaves the ranks' blocks), so the host computes per query tile, with one `searchsorted`,
how many keys its first query sees (`k_full`: those tiles run unmasked) and how many its last query sees
(`k_end`: keys past it are in the whole tile's future and are never loaded); only the tiles in between
compare positions. A chunk pair wholly in the queries' future costs an empty program per tile; one wholly
in their past runs unmasked. Memory: the inputs, the output and [Tq / BLOCK_M, 2] bounds, O(chunk).
Heads vary fastest in the grid (the GQA group's programs share K/V tiles in L2) and query tiles run
last-first (the causal tiles with the most keys start first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.paged_attention import prefill_tiles

try:  # TMA descriptors (Triton >= 3.4, Hopper and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

_LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _tile(q, k, v, m_i, l_i, acc, qk_scale, visible, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One K/V tile of online softmax in the log2 domain; q [M, D], k/v [N, D], visible [M, N] (MASK only)."""
    if IEEE:  # fp32 inputs: exact fp32 products, not TF32
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet stays at -inf: subtract 0 instead (exp2(-inf) = 0, no nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
    else:  # every score visible: the scale rides on the max subtraction (one FMA per score)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_safe)  # the old sums were relative to the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _load_kv(ptr, desc, start_n, valid, col, stride_t, offs_d, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
             BOUNDED: tl.constexpr):
    """K or V rows [start_n, start_n + BLOCK_N) of the KV head whose values start at column `col` (TMA: one
    box; else plain loads, masked by `valid` when BOUNDED: a tile that may run past the keys in use)."""
    if TMA:  # rows past Tk come back zero-filled; the caller masks them
        x = desc.load([start_n, col])
    else:
        rows = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        ptrs = ptr + rows[:, None] * stride_t + col + offs_d[None, :]
        if BOUNDED:
            x = tl.load(ptrs, mask=valid[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, qpos_ptr, kpos_ptr, bounds_ptr, o_ptr, lse_ptr,
                  tq, qk_scale, stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_lt, stride_lh,
                  GQA: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, MERGE: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr):
    h = tl.program_id(0)
    qb = tl.num_programs(1) - 1 - tl.program_id(1)
    k_full = tl.load(bounds_ptr + 2 * qb)  # keys [0, k_full) are seen by every query of the tile
    k_end = tl.load(bounds_ptr + 2 * qb + 1)  # keys [k_end, Tk) by none of them
    if MERGE:
        if k_end == 0:  # nothing to add: the accumulators stay as they are
            return
    kv_col = (h // GQA) * D  # KV head h // GQA; k/v rows hold Hkv heads of D contiguous values
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < tq
    rows = offs_m.to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    qpos = offs_m  # unused without CAUSAL
    if CAUSAL:  # rows past Tq get position -1: they see nothing in masked tiles (and are never stored)
        qpos = tl.load(qpos_ptr + offs_m, mask=mask_m, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full_end = (k_full // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        k = _load_kv(k_ptr, k_desc, start_n, None, kv_col, stride_kt, offs_d, BLOCK_N, TMA, False)
        v = _load_kv(v_ptr, v_desc, start_n, None, kv_col, stride_vt, offs_d, BLOCK_N, TMA, False)
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, None, False, IEEE)
    for start_n in range(full_end, k_end, BLOCK_N):  # the tiles that straddle some query's position
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < k_end
        k = _load_kv(k_ptr, k_desc, start_n, mask_n, kv_col, stride_kt, offs_d, BLOCK_N, TMA, True)
        v = _load_kv(v_ptr, v_desc, start_n, mask_n, kv_col, stride_vt, offs_d, BLOCK_N, TMA, True)
        visible = mask_n[None, :]
        if CAUSAL:
            kpos = tl.load(kpos_ptr + offs_n, mask=mask_n, other=0)
            visible = visible & (qpos[:, None] >= kpos[None, :])
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, visible, True, IEEE)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptrs = o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    l_ptrs = lse_ptr + rows * stride_lt + h * stride_lh
    if MERGE:  # out, lse := the merge of (out, lse) and this chunk's partial, as merge_into does
        prev_o = tl.load(o_ptrs, mask=mask_m[:, None], other=0.0)
        prev_lse = tl.load(l_ptrs, mask=mask_m, other=float("-inf"))
        hi = tl.maximum(prev_lse, lse)
        hi = tl.where(hi == float("-inf"), 0.0, hi)
        w_prev = tl.exp(prev_lse - hi)
        w_new = tl.exp(lse - hi)
        total = w_prev + w_new
        out = (prev_o * w_prev[:, None] + out * w_new[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
        lse = tl.where(total > 0, hi + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])
    tl.store(l_ptrs, lse, mask=mask_m)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: one float dtype, head dim a power of two in [16, 256],
    Hq a multiple of Hkv, unit stride along D and the KV heads packed (k/v rows [Hkv * D])."""
    d = q.shape[-1]
    return (q.dtype in DTYPES and k.dtype == v.dtype == q.dtype and 16 <= d <= 256 and d & (d - 1) == 0
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and q.stride(2) == 1
            and all(x.stride(2) == 1 and x.stride(1) == d for x in (k, v)))


def _tma_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA loads need Hopper or newer and 16-byte aligned bases and row strides."""
    if _TensorDescriptor is None or not k.is_cuda or torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    return all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in (k, v))


def _bounds(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, tq: int, tk: int, block_m: int,
            device: torch.device) -> torch.Tensor:
    """[ceil(Tq / BLOCK_M), 2] int32: per query tile, the keys its first query sees and those its last sees."""
    n = triton.cdiv(tq, block_m)
    if q_pos is None:
        return torch.full((n, 2), tk, dtype=torch.int32, device=device)
    first = torch.arange(0, tq, block_m, device=device)
    last = torch.clamp(first + block_m, max=tq) - 1
    firsts, lasts = q_pos[first], q_pos[last]
    return torch.stack([torch.searchsorted(k_pos, firsts, right=True),
                        torch.searchsorted(k_pos, lasts, right=True)], dim=1).to(torch.int32)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None,
           k_pos: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"want q [Tq, Hq, D], k and v [Tk, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not supported(q, k, v):
        raise ValueError(f"chunk_attention needs fp16/bf16/fp32 q, k, v of one dtype, D a power of two in [16, 256], "
                         f"Hq a multiple of Hkv and packed heads; got {q.dtype}/{k.dtype}/{v.dtype}, "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos go together: both position tensors (causal) or both None")
    if q_pos is not None and (q_pos.shape != (q.shape[0],) or k_pos.shape != (k.shape[0],)):
        raise ValueError(f"q_pos must be [Tq] and k_pos [Tk]; got {tuple(q_pos.shape)}, {tuple(k_pos.shape)}")


def _launch(q, k, v, scale, q_pos, k_pos, out, lse, merge: bool, tiles, tma) -> None:
    """Run the kernel over out [Tq, Hq, D] / lse [Tq, Hq] (merging into them when `merge`)."""
    _check(q, k, v, q_pos, k_pos)
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    if tq == 0:
        return
    if tk == 0:  # no keys: nothing seen (and no pointer to hand the kernel)
        if not merge:
            out.zero_()
            lse.fill_(float("-inf"))
        return
    use_tma = _tma_ok(k, v) if tma is None else tma
    block_m, block_n, warps, stages = tiles or prefill_tiles(tq, d, q.element_size(), use_tma)
    if q_pos is not None:
        q_pos, k_pos = q_pos.to(q.device, torch.int32), k_pos.to(q.device, torch.int32)
    bounds = _bounds(q_pos, k_pos, tq, tk, block_m, q.device)
    k_desc = v_desc = None
    if use_tma:  # 2-D views [Tk, Hkv * D] with their row strides: one box is one head's BLOCK_N rows
        k_desc = _TensorDescriptor(k, [tk, hkv * d], [k.stride(0), 1], [block_n, d])
        v_desc = _TensorDescriptor(v, [tk, hkv * d], [v.stride(0), 1], [block_n, d])
    grid = (hq, triton.cdiv(tq, block_m))
    _chunk_kernel[grid](q, k, v, k_desc, v_desc, q_pos, k_pos, bounds, out, lse, tq, scale * _LOG2E,
                        q.stride(0), q.stride(1), k.stride(0), v.stride(0), out.stride(0), out.stride(1),
                        lse.stride(0), lse.stride(1), GQA=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                        CAUSAL=q_pos is not None, MERGE=merge, TMA=use_tma, IEEE=q.dtype == torch.float32,
                        num_warps=warps, num_stages=stages)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32, tiles: tuple[int, int, int, int] | None = None,
                    tma: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Tq, Hq, D] over k/v [Tk, Hkv, D] -> out [Tq, Hq, D] (out_dtype), lse [Tq, Hq] fp32.

    q_pos [Tq], k_pos [Tk]: ascending absolute positions (causal by position), or both None (no mask).
    tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages), default as the prefill kernel's; tma: force TMA
    loads of K/V on or off (default: on where Hopper and alignment allow)."""
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    _launch(q, k, v, scale, q_pos, k_pos, out, lse, False, tiles, tma)
    return out, lse


def chunk_attention_merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None,
                           k_pos: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None,
                           tma: bool | None = None) -> None:
    """acc := merge(acc, attention of q over k/v), in place and exact; acc_out [Tq, Hq, D] fp32 and
    acc_lse [Tq, Hq] fp32 (lse -inf: nothing seen yet). Arguments otherwise as `chunk_attention`."""
    if acc_out.shape != q.shape or acc_lse.shape != q.shape[:2] or acc_out.dtype != torch.float32 \
            or acc_lse.dtype != torch.float32 or acc_out.stride(2) != 1:
        raise ValueError(f"accumulators must be fp32 out {tuple(q.shape)} (unit stride on D) and lse "
                         f"{tuple(q.shape[:2])}; got {acc_out.dtype} {tuple(acc_out.shape)}, "
                         f"{acc_lse.dtype} {tuple(acc_lse.shape)}")
    _launch(q, k, v, scale, q_pos, k_pos, acc_out, acc_lse, True, tiles, tma)
