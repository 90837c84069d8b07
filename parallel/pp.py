"""Point-to-point transfer of activations between adjacent pipeline stages.

One transfer is a fixed-size int64 header over the CPU group (a sequence number, then each tensor's
dtype and shape), followed by the tensors themselves over the device group. The header lets the
receiver allocate buffers without re-deriving the batch layout, and lets it check that both stages
agree on which micro-batch is arriving. Sends are asynchronous, so a stage goes on to its next
micro-batch while the next stage works on this one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.state import Group

_MAX_TENSORS = 4
_MAX_DIMS = 4
_FIELDS_PER_TENSOR = 2 + _MAX_DIMS  # dtype code, ndim, dims (zero padded)
HEADER_LEN = 2 + _MAX_TENSORS * _FIELDS_PER_TENSOR  # sequence number, tensor count, per-tensor fields
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


@dataclass
class PendingSend:
    """In-flight sends; the buffers are kept alive until `wait()` returns."""

    works: list[dist.Work] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        self.buffers.clear()

    def done(self) -> bool:
        """Whether every send has completed (without waiting); then the buffers are released."""
        if all(w.is_completed() for w in self.works):
            self.works.clear()
            self.buffers.clear()
            return True
        return False


def _header(seq_no: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a stage transfer carries at most {_MAX_TENSORS} tensors, got {len(tensors)}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = seq_no, len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"a stage transfer tensor has at most {_MAX_DIMS} dims, got shape {tuple(t.shape)}")
        base = 2 + i * _FIELDS_PER_TENSOR
        header[base], header[base + 1] = _DTYPES.index(t.dtype), t.dim()
        header[base + 2 : base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def _parse(header: torch.Tensor) -> tuple[int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    h = header.tolist()
    specs = []
    for i in range(h[1]):
        base = 2 + i * _FIELDS_PER_TENSOR
        ndim = h[base + 1]
        specs.append((_DTYPES[h[base]], tuple(h[base + 2 : base + 2 + ndim])))
    return h[0], specs


def send_to_next_stage(tensors: list[torch.Tensor], seq_no: int, group: Group) -> PendingSend:
    """Start sending `tensors` (e.g. hidden states and residual) to the next pipeline stage."""
    if group.is_last:
        raise RuntimeError("the last pipeline stage has no next stage")
    dst = group.ranks[group.rank + 1]
    tensors = [t.contiguous() for t in tensors]
    header = _header(seq_no, tensors)
    pending = PendingSend(buffers=[header, *tensors])
    pending.works.append(dist.isend(header, dst=dst, group=group.cpu_group))
    for t in tensors:
        pending.works.append(dist.isend(t, dst=dst, group=group.device_group))
    return pending


def recv_from_prev_stage(seq_no: int, group: Group, device: torch.device) -> list[torch.Tensor]:
    """Receive the tensors the previous stage sent for `seq_no`, in the order they were sent."""
    if group.is_first:
        raise RuntimeError("the first pipeline stage has no previous stage")
    src = group.ranks[group.rank - 1]
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src=src, group=group.cpu_group)
    got, specs = _parse(header)
    if got != seq_no:
        raise RuntimeError(f"pipeline stage {group.rank} expected micro-batch {seq_no} from stage {group.rank - 1}, got {got}")
    tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    works = [dist.irecv(t, src=src, group=group.device_group) for t in tensors]
    for w in works:
        w.wait()
    return tensors
