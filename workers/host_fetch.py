"""A step's results to the host through pinned memory and an event wait, not `.tolist()` on a GPU tensor.

`.tolist()` (and `.cpu()`) of a CUDA tensor copies into pageable memory: the call blocks inside the CUDA driver
until the step's kernels are done. Another thread's CUDA calls can wait behind it for that long: on one H100,
beside an engine thread fetching 10 ms steps with `.tolist()`, a side thread's small pinned host-to-device copy
took 7.2 ms (p50); with this fetch, 0.15 ms (scripts/bench_cuda_stall.py). The side thread that matters is a
decode replica's KV receive, which runs beside the engine's steps (workers/kv_transfer/transport.py).
"""
from __future__ import annotations

import threading

import torch

_ALIGN = 64  # each fetched tensor starts at a multiple of this many bytes of the staging buffer
_local = threading.local()  # per thread: its pinned staging buffer and its event


def _staging(nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    """This thread's pinned staging buffer (at least nbytes; grown by doubling) and its event."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        size = max(nbytes, 2 * (buf.numel() if buf is not None else 0), 1 << 16)
        _local.buf = buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        _local.event = torch.cuda.Event()
    return buf, _local.event


def host_lists(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's `.tolist()`, with one wait for all of them. CUDA tensors are copied (non-blocking, on the
    current stream) into this thread's pinned staging buffer, then an event on that stream is waited for;
    CPU tensors are listed as they are."""
    cuda = [t for t in tensors if t.is_cuda]
    if not cuda:
        return [t.tolist() for t in tensors]
    offsets, total = [], 0
    for t in cuda:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buf, event = _staging(total)
    hosts = []
    for t, offset in zip(cuda, offsets):
        host = buf[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    event.record()
    event.synchronize()  # lets go of the GIL while it waits
    lists = iter([h.tolist() for h in hosts])
    return [next(lists) if t.is_cuda else t.tolist() for t in tensors]
