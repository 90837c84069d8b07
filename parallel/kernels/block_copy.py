"""Copy whole KV blocks between a paged cache and a packed buffer: the KV handoff's gather and scatter.

A block of one layer's K (or V) is one contiguous row of block_size x heads x head_dim values, so moving n
blocks is n x layers x 2 row copies whose only indexing is the block id. PyTorch's `index_select` /
`index_copy_` work element by element (an index computation per 8-byte word): on an H100 a 1K-token handoff's
gather took 0.30 ms and its scatter 0.27 ms for 128 MiB, about 0.9 TB/s of memory traffic, as long as the NVLink
send between them (docs/benchmarks.md, "Tenth session"). Here each program copies a contiguous slice of one row
with wide vector loads and no per-word index arithmetic. Not yet measured on a GPU: `bench_kv_transfer.py`'s
gather and scatter columns time it (they call `gather_blocks` / `scatter_blocks`, which use it on GPUs).

Both sides are 4-D word views `[layers, 2, blocks, row]` (the caller's `_as_words` of the cache, and the
buffer viewed alike): strides are free in the first three dims, a row is contiguous.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from parallel.kernels.direct_launch import Handles, int_kind, interpreted

# Words (8 KiB of int64) per program, and warps per program. A 1K-token handoff's copies move 128 MiB at ~2.55 TB/s of
# HBM traffic, 8K and 32K at 2.8-2.9 (scripts/bench_kv_gather.py): TANDEM_KV_COPY_BLOCK / TANDEM_KV_COPY_WARPS set
# others, for that script to compare in separate processes (a handle's key holds neither: one value per process).
BLOCK = int(os.environ.get("TANDEM_KV_COPY_BLOCK") or 1024)
NUM_WARPS = int(os.environ.get("TANDEM_KV_COPY_WARPS") or 4)

# At most this many programs per copy (0: one per row slice, the whole GPU). A handoff's gather and scatter run beside
# NCCL's send/recv kernels of the previous/next message; a grid that fills every SM makes those kernels wait for SMs.
# Capped, each program loops over its share of the row slices. TANDEM_KV_COPY_PROGRAMS sets it; bench_kv_transfer.py
# --copy-programs compares values in one run.
MAX_PROGRAMS = int(os.environ.get("TANDEM_KV_COPY_PROGRAMS", "0") or 0)
# After a kernel's first launch, later launches with the same specialisation go through its compiled handle
# (parallel/kernels/direct_launch.py): a 1K-token handoff's critical path is host time, one gather launch on the
# sender and the scatter's on the receiver (docs/benchmarks.md, issue 27). TANDEM_KV_DIRECT=0 keeps the JIT path
# (bench_kv_transfer.py's d0 variant sets DIRECT to compare both in one run).
DIRECT = os.environ.get("TANDEM_KV_DIRECT", "1") != "0"
_HANDLES = Handles()


@triton.jit
def _copy_one(src_ptr, dst_ptr, ids_ptr, row_words, i, lk, chunk,
              src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """One program's slice `chunk` of row (listed block i, layer * 2 + K/V lk)."""
    block = tl.load(ids_ptr + i).to(tl.int64)
    # 64-bit offsets: a cache holds more than 2^31 words.
    i, layer, kv = i.to(tl.int64), (lk // 2).to(tl.int64), (lk % 2).to(tl.int64)
    if GATHER:  # cache block `block` -> buffer slot i
        src_row = layer * src_s0 + kv * src_s1 + block * src_s2
        dst_row = layer * dst_s0 + kv * dst_s1 + i * dst_s2
    else:  # buffer slot i -> cache block `block`
        src_row = layer * src_s0 + kv * src_s1 + i * src_s2
        dst_row = layer * dst_s0 + kv * dst_s1 + block * dst_s2
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    tl.store(dst_ptr + dst_row + offs, tl.load(src_ptr + src_row + offs, mask=mask), mask=mask)


# Not specialised on the sizes and strides (the buffer's change with each transfer's block count): one compiled
# kernel per direction and dtype, which `warm_up` builds before a pair's first handoff needs it.
@triton.jit(do_not_specialize=["row_words", "src_s0", "src_s1", "src_s2", "dst_s0", "dst_s1", "dst_s2"])
def _copy_rows_kernel(src_ptr, dst_ptr, ids_ptr, row_words,
                      src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr):
    _copy_one(src_ptr, dst_ptr, ids_ptr, row_words, tl.program_id(0), tl.program_id(1), tl.program_id(2),
              src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2, GATHER, BLOCK)


# The capped grid: program p takes row slices p, p + programs, ... (slice fastest, then block, then layer/KV).
@triton.jit(do_not_specialize=["row_words", "n_ids", "chunks", "total",
                               "src_s0", "src_s1", "src_s2", "dst_s0", "dst_s1", "dst_s2"])
def _copy_rows_loop_kernel(src_ptr, dst_ptr, ids_ptr, row_words, n_ids, chunks, total,
                           src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2,
                           GATHER: tl.constexpr, BLOCK: tl.constexpr):
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        rest = w // chunks
        _copy_one(src_ptr, dst_ptr, ids_ptr, row_words, rest % n_ids, rest // n_ids, w % chunks,
                  src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2, GATHER, BLOCK)


# Block to block, between two caches: the same-node KV handoff's one copy (workers/kv_transfer/transport.py, peer IPC),
# which reads the prefill GPU's cache over NVLink (mapped by CUDA IPC) and writes the decode GPU's, with no buffer
# between: row (listed block i, layer * 2 + K/V) of src block src_ids[i] goes to dst block dst_ids[i]. The full grid:
# remote reads are slow to answer, so as many programs as there are row slices keep the most loads in flight.
@triton.jit(do_not_specialize=["row_words", "src_s0", "src_s1", "src_s2", "dst_s0", "dst_s1", "dst_s2"])
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, row_words,
                        src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2, BLOCK: tl.constexpr):
    i, lk, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    layer, kv = (lk // 2).to(tl.int64), (lk % 2).to(tl.int64)  # 64-bit offsets: a cache holds more than 2^31 words
    src_row = layer * src_s0 + kv * src_s1 + src_block * src_s2
    dst_row = layer * dst_s0 + kv * dst_s1 + dst_block * dst_s2
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    tl.store(dst_ptr + dst_row + offs, tl.load(src_ptr + src_row + offs, mask=mask), mask=mask)


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each [l, kv, block] row of the 4-D-or-more view t is one contiguous run (what the kernel copies).
    From the shape and strides alone: indexing out a row to ask it cost ~10 us a call, three calls a copy, on the
    handoff's critical path (a 1K-token transfer's host time, scripts/profile_kv_transfer.py)."""
    if not (t.shape[0] and t.shape[2]):
        return True
    expected = 1
    for size, stride in zip(reversed(t.shape[3:]), reversed(t.stride()[3:])):
        if size != 1 and stride != expected:  # a dim of one may carry any stride, as in Tensor.is_contiguous
            return False
        expected *= size
    return True


def copy_rows(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, gather: bool, programs: int | None = None) -> None:
    """gather: dst[:, :, i] = src[:, :, index[i]]; else dst[:, :, index[i]] = src[:, :, i]. src and dst: the same
    dtype, shapes equal except dim 2, each row (dims 3 on) contiguous; index: int64 block ids on their device.
    programs: at most this many programs (None: MAX_PROGRAMS; 0: no cap)."""
    planned = _plan(src, dst, index, gather, programs)
    if planned is not None:
        _launch(*planned, gather)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
    """dst[:, :, dst_index[i]] = src[:, :, src_index[i]] for each i: src and dst are two caches' word views
    [layers, 2, blocks, row...] (the same dtype, layer count and row shape; each row contiguous), the indices int64
    block ids of equal length on the launching device. src may be another GPU's memory mapped here (CUDA IPC)."""
    _check_caches("copy_blocks", src, dst)
    if src_index.numel() != dst_index.numel():
        raise ValueError(f"copy_blocks: {src_index.numel()} source blocks for {dst_index.numel()} destinations")
    shape = src.shape
    n, row_words = src_index.numel(), math.prod(shape[3:])
    if n == 0 or shape[0] == 0 or row_words == 0:
        return
    grid = (n, shape[0] * 2, triton.cdiv(row_words, BLOCK))
    args = (src, dst, src_index, dst_index, row_words, src.stride(0), src.stride(1), src.stride(2),
            dst.stride(0), dst.stride(1), dst.stride(2))
    _HANDLES.launch(_key("blocks", args, 4, (BLOCK,)), lambda: _copy_blocks_kernel[grid](*args, BLOCK=BLOCK, num_warps=NUM_WARPS),
                    grid, args, (BLOCK,))


def prepare_copy(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, gather: bool,
                 programs: int | None = None) -> Callable[[], None]:
    """copy_rows(src, dst, index, gather, programs) checked and planned once, for tensors the caller keeps (their
    storage, shapes and the index's values may change between calls; their sizes and strides may not): the returned
    call launches it again with no shape checks, grid arithmetic or handle key to work out. The KV handoff's lean path
    (workers/kv_transfer/lanes.py) launches its gathers and scatters so: each torch-level call costs 50-150 us of host
    time on the 2 x H100 host, and a 1K-token handoff's critical path is that host time (docs/benchmarks.md, issue 27)."""
    planned = _plan(src, dst, index, gather, programs)
    if planned is None:
        return lambda: None
    kernel, grid, args = planned
    key = _rows_key(kernel, args, gather)
    const = (gather, BLOCK)
    jit = lambda: kernel[grid](*args, GATHER=gather, BLOCK=BLOCK, num_warps=NUM_WARPS)  # noqa: E731 - the first launch compiles
    return lambda: _HANDLES.launch(key, jit, grid, args, const)


def _plan(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, gather: bool,
          programs: int | None) -> tuple[Any, tuple[int, ...], tuple] | None:
    """copy_rows' checks, and its (kernel, grid, args); None where there is nothing to copy."""
    _check_caches("copy_rows", src, dst)
    shape = src.shape
    layers, kv = shape[0], shape[1]
    n, row_words = index.numel(), math.prod(shape[3:]) if shape[2] else 0
    if n == 0 or layers == 0 or row_words == 0:
        return None
    chunks = triton.cdiv(row_words, BLOCK)
    strides = (src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2))
    cap = MAX_PROGRAMS if programs is None else programs
    total = n * layers * kv * chunks
    if 0 < cap < total:
        return _copy_rows_loop_kernel, (cap,), (src, dst, index, row_words, n, chunks, total, *strides)
    return _copy_rows_kernel, (n, layers * kv, chunks), (src, dst, index, row_words, *strides)


def _check_caches(what: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Both copies' checks: [layers, 2 (K and V), blocks, row...] views of the same dtype, layer count and row shape
    (block counts may differ), each row contiguous."""
    shape, dst_shape = src.shape, dst.shape
    if shape[1] != 2:
        raise ValueError(f"{what}: dim 1 is K and V (2), not {shape[1]}")
    if src.dtype != dst.dtype or shape[:2] != dst_shape[:2] or shape[3:] != dst_shape[3:]:
        raise ValueError(f"{what}: {tuple(shape)} {src.dtype} and {tuple(dst_shape)} {dst.dtype} do not match")
    # A contiguous tensor's rows are (the flag is kept by torch: no stride walk on a handoff's critical path).
    if not ((src.is_contiguous() or rows_contiguous(src)) and (dst.is_contiguous() or rows_contiguous(dst))):
        raise ValueError(f"{what}: a block's row must be contiguous on both sides")


def _launch(kernel, grid: tuple[int, ...], args: tuple, gather: bool) -> None:
    """kernel[grid](*args) with its constexprs; through the compiled kernel's handle where one was kept (`_key`)."""
    _HANDLES.launch(_rows_key(kernel, args, gather), lambda: kernel[grid](*args, GATHER=gather, BLOCK=BLOCK, num_warps=NUM_WARPS),
                    grid, args, (gather, BLOCK))


def _rows_key(kernel, args: tuple, gather: bool) -> tuple | None:
    """copy_rows' handle key (`_key`): its kernel (full grid or loop) and direction; three tensor arguments."""
    return _key((kernel is _copy_rows_loop_kernel, gather), args, 3, (BLOCK,))


def _key(kind: object, args: tuple, tensors: int, const: tuple) -> tuple | None:
    """A compiled kernel's handle key: everything Triton specialises these kernels on: the device it launches on (the
    current one), the first `tensors` arguments' dtypes and 16-byte alignment, the integer arguments' types (their
    range: none is specialised on its value, `do_not_specialize`), and the constexprs. None (the JIT path every time)
    off DIRECT or off a GPU."""
    if not (DIRECT and args[0].is_cuda and not interpreted()):
        return None
    pointers = args[:tensors]
    return (kind, torch.cuda.current_device(), *(t.dtype for t in pointers), *(t.data_ptr() % 16 == 0 for t in pointers),
            tuple(int_kind(v) for v in args[tensors:]), const)


def warm_up(device: torch.device, dtype: torch.dtype = torch.int64) -> None:
    """Compile both directions' kernels, full and capped grid, for `dtype` (the caches' 8-byte words) on scratch
    tensors, so that the first handoff does not wait for Triton (KVTransferAgent.warm calls it)."""
    cache = torch.zeros(1, 2, 2, 16, dtype=dtype, device=device)
    buf = torch.zeros(1, 2, 1, 16, dtype=dtype, device=device)
    index = torch.zeros(1, dtype=torch.long, device=device)
    for programs in (0, 1):  # the full grid, and the capped grid's loop (2 row slices over 1 program)
        copy_rows(cache, buf, index, gather=True, programs=programs)
        copy_rows(buf, cache, index, gather=False, programs=programs)
    copy_blocks(cache, cache, index, index + 1)
