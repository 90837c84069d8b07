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
def _greedy_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # launched early behind the LM head's GEMV (batch-1 graphs)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    m, s, idx = _lane_scan(x_ptr + row * stride_x, 0, V, BLOCK)
    best, first, total = _merge_lanes(m, s, idx)
    lse = best + tl.log(total)
    tl.store(out_ptr + row * 2, first.to(tl.float64))
    tl.store(out_ptr + row * 2 + 1, (best - lse).to(tl.float64))


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
def _greedy_merge_kernel(part_m, part_s, part_i, out_ptr, C, C_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """One program a row: its C chunks' partials -> (first argmax, its log-probability)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_PAD)
    mask = offs < C
    m = tl.load(part_m + row * C + offs, mask=mask, other=float("-inf"))
    s = tl.load(part_s + row * C + offs, mask=mask, other=0.0)
    i = tl.load(part_i + row * C + offs, mask=mask, other=2147483647)
    best, first, total = _merge_lanes(m, s, i)  # chunks are in column order: the lowest index is the first maximum
    lse = best + tl.log(total)
    tl.store(out_ptr + row * 2, first.to(tl.float64))
    tl.store(out_ptr + row * 2 + 1, (best - lse).to(tl.float64))


BLOCK = 2048  # columns a program reads at a time


def greedy_chunks(rows: int, vocab: int, sms: int) -> int:
    """Programs a row is split over: about two per SM over all rows, at least one BLOCK of columns each; 1 (one
    program a row, one kernel) once the rows alone fill the GPU."""
    return max(1, min(-(-vocab // BLOCK), -(-2 * sms // max(1, rows))))


def greedy_pack(logits: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """[B, V] logits (CUDA, any float dtype) -> [B, 2] float64 (argmax token id, its log-probability). chunks: the
    programs a row is split over (default `greedy_chunks`)."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, 2, dtype=torch.float64, device=logits.device)
    if not b:
        return out
    pdl = logits.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled()
    pdl_kw = dict(launch_pdl=True) if pdl else {}
    c = chunks or greedy_chunks(b, v, sm_count(logits.device))
    if c == 1:
        _greedy_kernel[(b,)](logits, out, v, logits.stride(0), BLOCK=BLOCK, USE_PDL=pdl, num_warps=8, num_stages=4,
                             **pdl_kw)
        return out
    chunk = -(-v // c)
    chunk = -(-chunk // BLOCK) * BLOCK  # whole BLOCKs a program: only the last one's tail is masked
    c = -(-v // chunk)
    part_m = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    part_s = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(b, c, dtype=torch.int32, device=logits.device)
    _greedy_chunk_kernel[(b, c)](logits, part_m, part_s, part_i, v, logits.stride(0), CHUNK=chunk, BLOCK=BLOCK,
                                 USE_PDL=pdl, num_warps=4, num_stages=2, **pdl_kw)
    _greedy_merge_kernel[(b,)](part_m, part_s, part_i, out, c, C_PAD=max(16, triton.next_power_of_2(c)), USE_PDL=pdl,
                               num_warps=1, **pdl_kw)
    return out
