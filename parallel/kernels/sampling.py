"""Greedy decoding: per row of logits, the first argmax and its log-probability.

`Sampler.greedy_pack` in PyTorch is eight kernels (cast, argmax, gather, the log-sum-exp's max,
subtract, exp, sum, log, stack); at batch 1 they cost ~60 us of a 4.4 ms Llama-3.1-8B step. Here
each program streams its columns once with an online log-sum-exp (running max, rescaled sum) and
keeps the first index of the maximum, as torch.argmax does. With many rows one program takes a row;
with few, one program per row leaves the GPU nearly idle (a 128K vocabulary row took 28.5 us on an
H200, 2026-11-29), so the row is split into chunks over many programs, each writing its (max, first
index, sum of exp) for a second, one-program-a-row kernel to merge.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.cuda_launch import sm_count
from parallel.kernels.gemv import pdl_enabled


@triton.jit
def _lane_scan(base, start, end, BLOCK: tl.constexpr):
    """Columns [start, end) of one row, BLOCK lanes: each lane's running max, sum of exp(x - max) and first index
    of its max."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK], tl.float32)  # per-lane sum of exp(x - m)
    idx = tl.zeros([BLOCK], tl.int32)  # per-lane first index of its max
    for first in range(start, end, BLOCK):
        cols = first + offs
        x = tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        idx = tl.where(x > m, cols, idx)  # strictly greater: a lane keeps its first maximum
        s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
        s = tl.where(new_m == float("-inf"), 0.0, s)  # exp(-inf - -inf) is NaN
        m = new_m
    return m, s, idx


@triton.jit
def _merge_lanes(m, s, idx):
    """Per-lane (max, sum of exp, first index) -> the row's max, its lowest column (torch.argmax: the first
    maximum) and sum of exp(x - max)."""
    best = tl.max(m, 0)
    first = tl.min(tl.where(m == best, idx, 2147483647), 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - best)), 0)
    return best, first, total


@triton.jit
def _store_row(out_ptr, row, best, first, total, offset, PARTS: tl.constexpr, push_ptrs=None,
               PUSH: tl.constexpr = 0):
    """A row's result: (first argmax, its log-probability), or with PARTS (max, first argmax + offset, log-sum-exp),
    a TP rank's share of a greedy choice over the whole vocabulary (`greedy_combine` merges the ranks'). PUSH > 0:
    the three go into every rank's slot of a pushed site instead (push_ptrs: each rank's address of this rank's
    rows there), -0 written as +0 (-0 marks a slot not yet written; equal under every comparison made of them)."""
    lse = best + tl.log(total)
    if PUSH > 0:
        best64 = tl.where(best == 0.0, 0.0, best).to(tl.float64)
        lse64 = tl.where(lse == 0.0, 0.0, lse).to(tl.float64)
        for p in tl.static_range(PUSH):
            base = tl.load(push_ptrs + p).to(tl.pointer_type(tl.float64))
            tl.store(base + row * 3, best64)
            tl.store(base + row * 3 + 1, (first + offset).to(tl.float64))
            tl.store(base + row * 3 + 2, lse64)
    elif PARTS:
        tl.store(out_ptr + row * 3, best.to(tl.float64))
        tl.store(out_ptr + row * 3 + 1, (first + offset).to(tl.float64))
        tl.store(out_ptr + row * 3 + 2, lse.to(tl.float64))
    else:
        tl.store(out_ptr + row * 2, first.to(tl.float64))
        tl.store(out_ptr + row * 2 + 1, (best - lse).to(tl.float64))


@triton.jit
def _greedy_kernel(x_ptr, out_ptr, V, stride_x, offset, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                   PARTS: tl.constexpr = False, push_ptrs=None, PUSH: tl.constexpr = 0):
    if USE_PDL:  # launched early behind the LM head's GEMV (batch-1 graphs)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    m, s, idx = _lane_scan(x_ptr + row * stride_x, 0, V, BLOCK)
    best, first, total = _merge_lanes(m, s, idx)
    _store_row(out_ptr, row, best, first, total, offset, PARTS, push_ptrs, PUSH)


@triton.jit
def _greedy_chunk_kernel(x_ptr, part_m, part_s, part_i, V, stride_x, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Program (row, c): columns [c * CHUNK, (c + 1) * CHUNK) of the row -> its max, sum of exp and first index of
    the max at part_*[row, c]."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * CHUNK
    m, s, idx = _lane_scan(x_ptr + row * stride_x, start, tl.minimum(start + CHUNK, V), BLOCK)
    best, first, total = _merge_lanes(m, s, idx)
    at = row * tl.num_programs(1) + c
    tl.store(part_m + at, best)
    tl.store(part_s + at, total)
    tl.store(part_i + at, first)


@triton.jit
def _greedy_merge_kernel(part_m, part_s, part_i, out_ptr, C, offset, C_PAD: tl.constexpr, USE_PDL: tl.constexpr,
                         PARTS: tl.constexpr = False, push_ptrs=None, PUSH: tl.constexpr = 0):
    """One program a row: its C chunks' partials -> (first argmax, its log-probability), or PARTS' three numbers."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_PAD)
    mask = offs < C
    m = tl.load(part_m + row * C + offs, mask=mask, other=float("-inf"))
    s = tl.load(part_s + row * C + offs, mask=mask, other=0.0)
    i = tl.load(part_i + row * C + offs, mask=mask, other=2147483647)
    best, first, total = _merge_lanes(m, s, i)  # chunks are in column order: the lowest index is the first maximum
    _store_row(out_ptr, row, best, first, total, offset, PARTS, push_ptrs, PUSH)


_EMPTY64 = tl.constexpr(-(1 << 63))  # parallel/p2p_allreduce.EMPTY_BITS64: a float64 -0, a slot not yet written


@triton.jit
def _is_empty(v):
    return tl.max((v.to(tl.int64, bitcast=True) == _EMPTY64).to(tl.int32), 0) > 0


@triton.jit
def _greedy_combine_kernel(parts_ptr, out_ptr, N, stride_tp, reset_ptr, reset_n, TP: tl.constexpr,
                           TP_PAD: tl.constexpr, WAIT: tl.constexpr = False, RESET_BLOCK: tl.constexpr = 1024):
    """Program `row`: the TP ranks' (max, token id, log-sum-exp) of their vocabulary slices (parts [TP, N, 3],
    float64, rank r's rows at r * stride_tp) -> out [2, N]: the token of the largest max, the lowest rank's on a tie
    (slices are in ascending id order, so the first maximum of the whole row), and its log-probability against the
    log-sum-exp of all ranks (computed in float64, rounded to float32 as `_LogitsHead.greedy_packed`'s PyTorch form
    rounds it). WAIT (pushed rows): reread the row's values (volatile, past L1) until none is the empty mark; then
    program 0 marks the previous site's reset_n values (reset_ptr) empty again."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, TP_PAD)
    mask = r < TP
    at = r.to(tl.int64) * stride_tp + row * 3
    if WAIT:
        value = tl.load(parts_ptr + at, mask=mask, other=0.0, volatile=True)
        token = tl.load(parts_ptr + at + 1, mask=mask, other=0.0, volatile=True)
        lse = tl.load(parts_ptr + at + 2, mask=mask, other=0.0, volatile=True)
        while _is_empty(value) | _is_empty(token) | _is_empty(lse):
            value = tl.load(parts_ptr + at, mask=mask, other=0.0, volatile=True)
            token = tl.load(parts_ptr + at + 1, mask=mask, other=0.0, volatile=True)
            lse = tl.load(parts_ptr + at + 2, mask=mask, other=0.0, volatile=True)
        value = tl.where(mask, value, float("-inf"))
        lse = tl.where(mask, lse, float("-inf"))
        if tl.program_id(0) == 0:
            empty = tl.full([RESET_BLOCK], _EMPTY64, tl.int64).to(tl.float64, bitcast=True)
            for start in range(0, reset_n, RESET_BLOCK):
                offs = start + tl.arange(0, RESET_BLOCK)
                tl.store(reset_ptr + offs, empty, mask=offs < reset_n)
    else:
        value = tl.load(parts_ptr + at, mask=mask, other=float("-inf"))
        token = tl.load(parts_ptr + at + 1, mask=mask, other=0.0)
        lse = tl.load(parts_ptr + at + 2, mask=mask, other=float("-inf"))
    best = tl.max(value, 0)
    first = tl.min(tl.where(value == best, r, TP_PAD), 0)
    chosen = tl.sum(tl.where(r == first, token, 0.0), 0)
    m = tl.max(lse, 0)
    total = m + tl.log(tl.sum(tl.where(mask, tl.exp(lse - m), 0.0), 0))
    tl.store(out_ptr + row, chosen)
    tl.store(out_ptr + N + row, (best - total).to(tl.float32).to(tl.float64))  # fp32's value, as the PyTorch form


BLOCK = 2048  # columns a program reads at a time


def greedy_chunks(rows: int, vocab: int, sms: int) -> int:
    """Programs a row is split over: about two per SM over all rows, at least one BLOCK of columns each; 1 (one
    program a row, one kernel) once the rows alone fill the GPU."""
    return max(1, min(-(-vocab // BLOCK), -(-2 * sms // max(1, rows))))


def greedy_pack(logits: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """[B, V] logits (CUDA, any float dtype) -> [B, 2] float64 (argmax token id, its log-probability). chunks: the
    programs a row is split over (default `greedy_chunks`)."""
    return _greedy(logits, chunks, 0, parts=False)


def greedy_parts(logits: torch.Tensor, offset: int, chunks: int | None = None, push=None) -> torch.Tensor | None:
    """A TP rank's vocabulary slice of logits [B, V / tp] (its first column is token `offset`) -> [B, 3] float64:
    each row's max, the token id of its first maximum, and its log-sum-exp; float64 holds any token id exactly, so
    one all-gather carries all three (`greedy_combine`). push: a site of float64 pushed slots (parallel/
    p2p_allreduce.enable_pushed_greedy) whose rows are each rank's [max_rows, 3]: the rows go into every rank's slot
    there instead, and None is returned (`greedy_combine(..., site=)` waits for them)."""
    return _greedy(logits, chunks, offset, parts=True, push=push)


def greedy_combine(parts: torch.Tensor | None, site=None, rows: int | None = None) -> torch.Tensor:
    """[tp, B, 3] float64, every rank's `greedy_parts` in rank order -> [2, B] float64: the greedy token over the
    whole vocabulary (the first maximum) and its log-probability, as one rank's `greedy_pack` of full logits.
    site (with rows = B): the ranks' rows pushed at that site instead, waited for; the site before it is emptied."""
    if site is not None:
        parts = site.parts  # [tp, 3 * max_rows]
        tp, b, stride = parts.shape[0], rows, parts.stride(0)
        reset, reset_n = site.reset, site.reset.numel()
    else:
        tp, b, _ = parts.shape
        parts = parts.contiguous()
        stride, reset, reset_n = b * 3, parts, 0
    out = torch.empty(2, b, dtype=torch.float64, device=parts.device)
    if b:
        _greedy_combine_kernel[(b,)](parts, out, b, stride, reset, reset_n, TP=tp,
                                     TP_PAD=max(2, triton.next_power_of_2(tp)), WAIT=site is not None, num_warps=1)
    return out


def _greedy(logits: torch.Tensor, chunks: int | None, offset: int, parts: bool, push=None) -> torch.Tensor | None:
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if push is not None and 3 * b > push.parts.shape[1]:
        raise ValueError(f"greedy_parts: {b} rows, the pushed site holds {push.parts.shape[1] // 3}")
    out = torch.empty(b, 3 if parts else 2, dtype=torch.float64, device=logits.device)
    push_kw = dict(push_ptrs=push.ptrs, PUSH=push.world) if push is not None else {}
    if not b:
        return None if push is not None else out
    pdl = logits.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled()
    pdl_kw = dict(launch_pdl=True) if pdl else {}
    c = chunks or greedy_chunks(b, v, sm_count(logits.device))
    if c == 1:
        _greedy_kernel[(b,)](logits, out, v, logits.stride(0), offset, BLOCK=BLOCK, USE_PDL=pdl, PARTS=parts,
                             num_warps=8, num_stages=4, **push_kw, **pdl_kw)
        return None if push is not None else out
    chunk = -(-v // c)
    chunk = -(-chunk // BLOCK) * BLOCK  # whole BLOCKs a program: only the last one's tail is masked
    c = -(-v // chunk)
    part_m = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    part_s = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(b, c, dtype=torch.int32, device=logits.device)
    _greedy_chunk_kernel[(b, c)](logits, part_m, part_s, part_i, v, logits.stride(0), CHUNK=chunk, BLOCK=BLOCK,
                                 USE_PDL=pdl, num_warps=4, num_stages=2, **pdl_kw)
    _greedy_merge_kernel[(b,)](part_m, part_s, part_i, out, c, offset, C_PAD=max(16, triton.next_power_of_2(c)),
                               USE_PDL=pdl, PARTS=parts, num_warps=1, **push_kw, **pdl_kw)
    return None if push is not None else out
