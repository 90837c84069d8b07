"""GPU memory around steps: how much the KV cache may take, and when the allocator's cache is emptied.

The KV budget comes from one profiling step, the largest serving can schedule, run on an empty
allocator cache right after the weights load (`ModelRunner._gpu_kv_budget`). Two things make a real
step of that size need more device memory than the profile's *allocated* peak:

* Within the step, PyTorch's caching allocator holds more than is allocated: a tensor placed in a
  larger free block splits it, and a block a NCCL send or receive used is reused only once that
  stream is done with it. The profile's *reserved* peak counts both, so the budget subtracts that.
* Across steps, smaller steps leave cached segments sized for them. A later, larger step splits them
  for its live tensors, and only wholly free segments go back to the device when a `cudaMalloc` fails,
  so the rest is stranded. On 2 H100s (Llama-3.1-8B shapes, SP=2, 2026-11-25) prefills of 16K and 64K
  tokens and then one of 131,056 ran out of memory in the last: 69.54 GiB allocated plus the 1.75 GiB
  asked for was the 0.9 x 79.18 GiB the profile planned for, but the rank's process held 77.99 GiB.
  `NewPeakRelease` empties the cache before a step larger than any since the last time, so the step
  lays out its segments on an empty cache as the profile did.
"""
from __future__ import annotations

from typing import Callable


def kv_budget_bytes(total: int, utilization: float, peak_reserved: int, probe_bytes: int) -> int:
    """Bytes for the KV cache: the utilisation's share of the device, less what the profiling step held.

    peak_reserved: the allocator's peak reserved bytes during the profiling step, weights included;
    probe_bytes: the profiling step's scratch KV inside that peak (the real cache takes its place).
    What PyTorch does not allocate (the CUDA context, NCCL's buffers) is left to the (1 - utilization) share.
    """
    return int(total * utilization - (peak_reserved - probe_bytes))


def graph_pool_bytes(step_activations: int, graph_tokens: int, profile_tokens: int) -> int:
    """What piecewise CUDA graphs of up to graph_tokens tokens hold: activations grow with the step's
    tokens, so that share of the profiling step's (profile_tokens), at least all of it where larger."""
    if graph_tokens <= 0 or profile_tokens <= 0:
        return 0
    return int(max(step_activations, 0) * min(1.0, graph_tokens / profile_tokens))


class NewPeakRelease:
    """Empties the allocator's cache (`release`) before a step with more tokens than any since the last
    release. Sizes count in powers of two, so an engine's lifetime sees about log2(max_num_batched_tokens)
    releases, nearly all in its first steps. `reset()` where the cache was emptied some other way."""

    def __init__(self, release: Callable[[], None] | None):
        self.release = release  # None (CPU): nothing to release
        self.high_water = 0  # the power of two at or above the largest step since the last release

    def reset(self) -> None:
        self.high_water = 0

    def before_step(self, num_tokens: int) -> bool:
        """Call before running a step of num_tokens tokens; True if the cache was emptied for it."""
        bucket = 1 << max(num_tokens - 1, 0).bit_length()
        if bucket <= self.high_water:
            return False
        self.high_water = bucket
        if self.release is None:
            return False
        self.release()
        return True
