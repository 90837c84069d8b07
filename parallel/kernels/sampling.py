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
def _store_row(out_ptr, row, best, first, total, offset, PARTS: tl.constexpr):
    """A row's result: (first argmax, its log-probability), or with PARTS (max, first argmax + offset, log-sum-exp),
    a TP rank's share of a greedy choice over the whole vocabulary (`greedy_combine` merges the ranks')."""
    lse = best + tl.log(total)
    if PARTS:
        tl.store(out_ptr + row * 3, best.to(tl.float64))
        tl.store(out_ptr + row * 3 + 1, (first + offset).to(tl.float64))
        tl.store(out_ptr + row * 3 + 2, lse.to(tl.float64))
    else:
        tl.store(out_ptr + row * 2, first.to(tl.float64))
        tl.store(out_ptr + row * 2 + 1, (best - lse).to(tl.float64))


@triton.jit
def _greedy_kernel(x_ptr, out_ptr, V, stride_x, offset, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                   PARTS: tl.constexpr = False):
    if USE_PDL:  # launched early behind the LM head's GEMV (batch-1 graphs)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    m, s, idx = _lane_scan(x_ptr + row * stride_x, 0, V, BLOCK)
    best, first, total = _merge_lanes(m, s, idx)
    _store_row(out_ptr, row, best, first, total, offset, PARTS)


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
                         PARTS: tl.constexpr = False):
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
    _store_row(out_ptr, row, best, first, total, offset, PARTS)


@triton.jit
def _greedy_combine_kernel(parts_ptr, out_ptr, N, TP: tl.constexpr, TP_PAD: tl.constexpr):
    """Program `row`: the TP ranks' (max, token id, log-sum-exp) of their vocabulary slices (parts [TP, N, 3],
    float64) -> out [2, N]: the token of the largest max, the lowest rank's on a tie (slices are in ascending id
    order, so the first maximum of the whole row), and its log-probability against the log-sum-exp of all ranks
    (computed in float64, rounded to float32 as `_LogitsHead.greedy_packed`'s PyTorch form rounds it)."""
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, TP_PAD)
    mask = r < TP
    at = (r.to(tl.int64) * N + row) * 3
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


def greedy_parts(logits: torch.Tensor, offset: int, chunks: int | None = None) -> torch.Tensor:
    """A TP rank's vocabulary slice of logits [B, V / tp] (its first column is token `offset`) -> [B, 3] float64:
    each row's max, the token id of its first maximum, and its log-sum-exp; float64 holds any token id exactly, so
    one all-gather carries all three (`greedy_combine`)."""
    return _greedy(logits, chunks, offset, parts=True)


def greedy_combine(parts: torch.Tensor) -> torch.Tensor:
    """[tp, B, 3] float64, every rank's `greedy_parts` in rank order -> [2, B] float64: the greedy token over the
    whole vocabulary (the first maximum) and its log-probability, as one rank's `greedy_pack` of full logits."""
    tp, b, _ = parts.shape
    out = torch.empty(2, b, dtype=torch.float64, device=parts.device)
    if b:
        _greedy_combine_kernel[(b,)](parts.contiguous(), out, b, TP=tp, TP_PAD=max(2, triton.next_power_of_2(tp)),
                                     num_warps=1)
    return out


def _greedy(logits: torch.Tensor, chunks: int | None, offset: int, parts: bool) -> torch.Tensor:
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, 3 if parts else 2, dtype=torch.float64, device=logits.device)
    if not b:
        return out
    pdl = logits.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled()
    pdl_kw = dict(launch_pdl=True) if pdl else {}
    c = chunks or greedy_chunks(b, v, sm_count(logits.device))
    if c == 1:
        _greedy_kernel[(b,)](logits, out, v, logits.stride(0), offset, BLOCK=BLOCK, USE_PDL=pdl, PARTS=parts,
                             num_warps=8, num_stages=4, **pdl_kw)
        return out
    chunk = -(-v // c)
    chunk = -(-chunk // BLOCK) * BLOCK  # whole BLOCKs a program: only the last one's tail is masked
    c = -(-v // chunk)
    part_m = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    part_s = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(b, c, dtype=torch.int32, device=logits.device)
    _greedy_chunk_kernel[(b, c)](logits, part_m, part_s, part_i, v, logits.stride(0), CHUNK=chunk, BLOCK=BLOCK,
                                 USE_PDL=pdl, num_warps=4, num_stages=2, **pdl_kw)
    _greedy_merge_kernel[(b,)](part_m, part_s, part_i, out, c, offset, C_PAD=max(16, triton.next_power_of_2(c)),
                               USE_PDL=pdl, PARTS=parts, num_warps=1, **pdl_kw)
    return out
