"""The KV handoff's lean path: kept buffers and pre-planned copies for short transfers on a GPU.

A 1K-token Llama-3.1-8B handoff (134 MB) spends about as long in the host's work before its one message is on the
wire as on the wire: on the 2 x H100 host each torch-level call costs 50-150 us of host time, and the sender made
several before its send was posted (the block index by `torch.tensor(..., device=cuda)`, which waits for its copy;
the buffer's `torch.empty`; the row copy's checks, grid and handle key; TANDEM_KV_PHASES logs, docs/benchmarks.md,
issue 27). A `Lane` keeps what a transfer needs, so that each message costs one launch and one NCCL call:

- the block index: a pinned host buffer (filled through numpy, no torch call) and a device buffer, one asynchronous
  copy between them on the transfer's stream;
- each message's buffer, by its layer slice, and its gather or scatter planned once (`block_copy.prepare_copy`);
- the plan's messages, by plan (`KVTransferAgent._messages` is pure Python, ~50 us there).

A lane serves one transfer at a time: taken from the agent's `Lanes` when the transfer starts, given back once its
stream has been synchronised (its copies, sends and receives are done, so the next transfer may overwrite its buffers,
on any thread's stream). A transfer that fails drops its lane (its buffers may still be in use on the GPU). Only
transfers of at most `LANE_BYTES` take one, on a GPU, over NCCL, of whole heads: the longer ones spend their time on
the wire, not on the host, and would keep gigabytes. At most `MAX_LANES` exist per agent: transfers beyond them (several
in flight at once) take the ordinary path.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

import torch

LANE_BYTES = 256 << 20  # a transfer of at most this many bytes takes a lane (MESSAGE_BYTES: one message by default)
MAX_LANES = 2  # lanes per agent: each keeps at most LANE_BYTES of buffers on the GPU between transfers
MAX_PLANS = 64  # plans' message lists kept per lane (a served replica's plans differ in their block indices)


class Lane:
    """One transfer's kept resources (see the module doc)."""

    def __init__(self, device: torch.device, max_blocks: int):
        self.device = device
        self.host_index = torch.empty(max_blocks, dtype=torch.long, pin_memory=device.type == "cuda")
        self.host_ids = self.host_index.numpy()  # the same memory: filled with no torch call
        self.index = torch.empty(max_blocks, dtype=torch.long, device=device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # n -> (host, device) index views
        self._storage: dict[Hashable, torch.Tensor] = {}  # (key, dtype) -> a message buffer's flat storage
        self._buffers: dict[Hashable, torch.Tensor] = {}  # (key, shape, dtype) -> its view of the storage
        self._copies: dict[Hashable, Callable[[], None]] = {}  # (buffer key, direction, programs) -> planned launch
        self.messages: OrderedDict[Hashable, list] = OrderedDict()  # a plan's key -> its messages (`KVTransferAgent`)

    def index_of(self, ids: list[int]) -> torch.Tensor:
        """ids as a device index, by one asynchronous copy on the current stream from the pinned buffer (safe: a lane
        is given back only after its transfer's stream was synchronised, so no earlier copy is still reading)."""
        n = len(ids)
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self.host_index[:n], self.index[:n])
        self.host_ids[:n] = ids
        views[1].copy_(views[0], non_blocking=True)
        return views[1]

    def buffer(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The kept buffer of this message (by the caller's key: its layer slice), of shape and dtype: a view of the
        key's storage, which grows to the largest shape asked for (prompts differ in length; one storage per key)."""
        view = self._buffers.get((key, shape, dtype))
        if view is not None:
            return view
        need = 1
        for size in shape:
            need *= size
        flat = self._storage.get((key, dtype))
        if flat is None or flat.numel() < need:
            # A larger storage: the views and planned copies of the old one are forgotten (they point into it).
            self._buffers.clear()
            self._copies.clear()
            flat = self._storage[(key, dtype)] = torch.empty(need, dtype=dtype, device=self.device)
        view = self._buffers[(key, shape, dtype)] = flat[:need].view(shape)
        return view

    def copy(self, key: Hashable, plan: Callable[[], Callable[[], None]]) -> Callable[[], None]:
        """The planned launch under key, planned by plan() the first time."""
        launch = self._copies.get(key)
        if launch is None:
            launch = self._copies[key] = plan()
        return launch

    def remember(self, key: Hashable, messages: list) -> None:
        self.messages[key] = messages
        while len(self.messages) > MAX_PLANS:
            self.messages.popitem(last=False)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._storage.values())

    def trim(self, limit: int) -> None:
        """Forget every buffer (and its planned copies) once they hold more than limit bytes."""
        if self.nbytes() > limit:
            self._storage.clear()
            self._buffers.clear()
            self._copies.clear()


class Lanes:
    """An agent's lanes: `take()` one for a transfer (None: all busy), `give(lane)` it back after the transfer's stream
    was synchronised; a lane not given back (its transfer failed) is forgotten."""

    def __init__(self, device: torch.device, max_blocks: int):
        self.device, self.max_blocks = device, max_blocks
        self._free: list[Lane] = []
        self._count = 0
        self._lock = threading.Lock()

    def take(self) -> Lane | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._count >= MAX_LANES:
                return None
            self._count += 1
        try:
            return Lane(self.device, self.max_blocks)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def give(self, lane: Lane) -> None:
        lane.trim(LANE_BYTES)  # so the agent keeps at most MAX_LANES x LANE_BYTES of buffers between transfers
        with self._lock:
            self._free.append(lane)

    def drop(self, lane: Lane) -> None:
        """A lane whose transfer failed: its buffers may still be in use on the GPU, so it is never reused."""
        with self._lock:
            self._count -= 1
