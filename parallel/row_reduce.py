"""A row-parallel linear's GEMM and the all-reduce of its output, for prefill-sized inputs under TP.

Why: a TP=2 mixed step (~250 decodes and ~800 prefill tokens on Llama-3.1-8B) all-reduces 64 outputs of ~6 MB; on
2 x H200 that is 2.35 ms of a rank's 15 ms of GPU time, with nothing else running (issue 26: the mixed step is at
0.64x one GPU's, the goal 0.6x). Two ways to take some of it off the step (TANDEM_TP_ROW_REDUCE):

- `direct` (default): the GEMM writes its output straight into the P2P all-reduce's mapped buffer, which the two-shot kernel
  reads, instead of into a tensor that is then copied there (parallel/p2p_allreduce.py stages its input so): one
  ~6 MB device copy less per all-reduce. The same sums.
- `overlap:N`: the rows are cut into N chunks; each chunk's GEMM runs on the compute stream and its all-reduce on a
  high-priority side stream of the device, so chunk i's all-reduce runs while chunk i + 1's GEMM does (the GEMM is
  compute-bound, the two-shot kernel NVLink-bound on a few SMs). What is left exposed is the last chunk's
  all-reduce. Each row's product and each element's sum are what the whole GEMM gives, unless cuBLAS picks a
  different kernel (e.g. split-K) for the smaller row count.
- `staged`: F.linear, then the all-reduce (`comm.reduce_partial_sums`).
With TANDEM_P2P_PUSHED (parallel/p2p_allreduce.py) the P2P all-reduce sends these sizes to its pushed kernel, which
needs no staging: `direct` then runs the GEMM and that all-reduce.

Measured on 2 x H200 (`scripts/two_gpu_suite.sh row_reduce`, 2026-11-29, docs/benchmarks.md): `direct` saves ~5.5 us
a layer at 776 rows and took the mixed step from 0.635x to 0.570x one GPU's (mean) in the same call, so it is the
default; `overlap:2` was slower than `staged` (the two-shot kernel's SMs and its NVLink traffic slow the GEMM
beside it more than the overlap hides), so it stays opt-in for A/Bs. Both serve plain
(unquantized) weights, for inputs of at least ROW_REDUCE_MIN_ROWS rows (decode batches and batch 1 keep their
paths); `direct` on CUDA only, and on CPU ranks (gloo) `overlap:N` runs its chunks one after another.
"""
from __future__ import annotations

import os

import torch

from parallel.comm import reduce_partial_sums
from parallel.state import Group

ROW_REDUCE_ENV = "TANDEM_TP_ROW_REDUCE"
ROW_REDUCE_MIN_ROWS = 512  # below: decode batches, whose all-reduces are small and already in CUDA graphs


def row_reduce_mode() -> tuple[str, int]:
    """(mode, chunks) from TANDEM_TP_ROW_REDUCE: ("staged", 1), ("direct", 1) or ("overlap", N >= 2); another
    value is refused by name."""
    raw = os.environ.get(ROW_REDUCE_ENV, "direct").strip().lower()
    if raw in ("staged", "direct"):
        return raw, 1
    name, _, count = raw.partition(":")
    if name == "overlap" and count.isdigit() and 2 <= int(count) <= 8:
        return "overlap", int(count)
    raise ValueError(f"{ROW_REDUCE_ENV}={raw!r}: expected 'staged', 'direct' or 'overlap:N' with N from 2 to 8")


def takes(x: torch.Tensor, weight: torch.Tensor, group: Group, mode: str | None = None) -> bool:
    """Whether `linear_reduce` serves this call in `mode` (default: the configured one; else the caller runs
    F.linear, then the all-reduce)."""
    if group.size == 1 or x.dim() != 2 or x.shape[0] < ROW_REDUCE_MIN_ROWS or weight.dtype != x.dtype:
        return False
    mode = mode or row_reduce_mode()[0]
    if mode == "staged":
        return False
    if mode == "direct":
        return x.is_cuda and group.fast_all_reduce is not None and hasattr(group.fast_all_reduce, "staging")
    return True


def try_linear_reduce(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor | None:
    """`linear_reduce` in the configured mode where that mode serves the call (`takes`), else None: the caller runs
    F.linear, then the all-reduce. Decode-sized calls return before the mode is read."""
    if group.size == 1 or x.dim() != 2 or x.shape[0] < ROW_REDUCE_MIN_ROWS:
        return None
    mode, chunks = row_reduce_mode()
    return linear_reduce(x, weight, group, mode, chunks) if takes(x, weight, group, mode) else None


def linear_reduce(x: torch.Tensor, weight: torch.Tensor, group: Group, mode: str, chunks: int = 1) -> torch.Tensor:
    """x [M, K/tp] @ weight [N, K/tp]^T summed over the group: [M, N] (no bias: the caller adds it after the sum),
    mode "direct", or "overlap" in `chunks` chunks."""
    if mode == "direct":
        return _direct(x, weight, group)
    return _overlapped(x, weight, group, chunks)


def _direct(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    reducer = group.fast_all_reduce
    staged = reducer.staging(x.shape[0], weight.shape[0], x.dtype)
    if staged is None:  # the size the two-shot kernel does not take: the usual path
        return reduce_partial_sums(torch.mm(x, weight.t()), group)
    torch.mm(x, weight.t(), out=staged)
    return reducer.reduce_staged(staged)


def chunk_bounds(rows: int, chunks: int, align: int = 64) -> list[tuple[int, int]]:
    """Row ranges of `chunks` nearly equal chunks, each boundary on a multiple of `align` (GEMM tiles stay
    whole); fewer chunks where the rows do not fill them."""
    step = -(-rows // chunks)
    step = -(-step // align) * align
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _overlapped(x: torch.Tensor, weight: torch.Tensor, group: Group, chunks: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    bounds = chunk_bounds(x.shape[0], chunks)
    if not x.is_cuda:  # gloo ranks: the chunks in turn
        for a, b in bounds:
            torch.mm(x[a:b], weight.t(), out=y[a:b])
            reduce_partial_sums(y[a:b], group)
        return y
    compute = torch.cuda.current_stream(x.device)
    side = _side_stream(group, x.device)
    for a, b in bounds:
        torch.mm(x[a:b], weight.t(), out=y[a:b])
        side.wait_stream(compute)  # this chunk's product is written
        with torch.cuda.stream(side):
            reduce_partial_sums(y[a:b], group)  # in place; the next chunk's GEMM goes on meanwhile
    compute.wait_stream(side)  # every chunk summed before anything reads y
    return y


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(group: Group, device: torch.device) -> torch.cuda.Stream:
    """The high-priority stream of this device for the overlapped all-reduces (the groups' calls on a device follow
    one another in one model's order, so they can share it)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[device]
