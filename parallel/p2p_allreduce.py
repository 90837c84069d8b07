"""All-reduce over NVLink peer-to-peer loads (torch symmetric memory), for the messages where NCCL is slow.

Why: TP runs two all-reduces per layer. At decode they are small ([batch, hidden]: 8 KB at batch 1 on
Llama-3.1-8B) and NCCL's ring takes 16-22 us each from a CUDA graph on 2 H200s in isolation, ~11 us in
the model (0.7 ms of a 3.6 ms batch-1 step). A one-shot all-reduce has every rank copy its input into a buffer all ranks have mapped,
meet at a barrier, and each read all peers' buffers and sum: one kernel, one hop. Measured on 2 H200s
(scripts/bench_allreduce.py, in a CUDA graph, 2026-11-26): 8 KB 6.7 us vs NCCL 22.5, 512 KB 10.9 vs 20.2,
2 MB 21.4 vs 41.3, 6 MB 48.1 vs 50.3, 16 MB 119.5 vs 92.8: NCCL's ring wins above ~6 MB, hence the limit.
Each rank reads (n - 1) x the message, so on more GPUs the crossover comes sooner (limits there are
scaled down, not measured). Multicast (NVLS) stays off: it hangs on some hosts.

Ranks must see each other's GPUs (torch's symmetric memory refuses two ranks that both call theirs
cuda:0): Ray rank actors of a TP group on GPUs see their whole node (cluster/ray_runtime.py).

`P2PAllReduce(group, device)` is set on a group as `group.fast_all_reduce` (parallel/comm.py calls it
first); it returns False for a tensor it does not take (too large, wrong dtype), which then goes to NCCL.
Works inside CUDA graphs.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from parallel.state import Group

log = logging.getLogger(__name__)

# Largest message for the one-shot kernel, by group size. 2 GPUs: the one-shot reads what a ring moves;
# more GPUs read (n - 1) x the message, so the crossover with NCCL comes sooner (not measured beyond 2).
MAX_BYTES = {2: 4 << 20, 4: 1 << 20, 8: 256 << 10}


class P2PAllReduce:
    def __init__(self, group: Group, device: torch.device, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.device_group.group_name
        self.max_bytes = MAX_BYTES.get(group.size, 0)
        self.dtype = dtype
        self.buffer = symm_mem.empty(self.max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place; False (x untouched) where this kernel does not take it."""
        n = x.numel()
        if x.dtype != self.dtype or not x.is_contiguous() or n * x.element_size() > self.max_bytes or n % 8:
            return False
        flat = x.view(-1)
        self.op(self.buffer[:n], flat, "sum", self.group_name, flat)
        return True


def enable_p2p_all_reduce(group: Group, device: torch.device, dtype: torch.dtype) -> bool:
    """Give `group` a P2P all-reduce where every rank can set one up; all ranks agree, else none uses it."""
    if group.size == 1 or device.type != "cuda" or group.size not in MAX_BYTES:
        return False
    reducer, reason = None, ""
    try:
        reducer = P2PAllReduce(group, device, dtype)
        x = torch.full((1024,), float(group.rank + 1), dtype=dtype, device=device)
        reducer(x)  # a check: the sum of 1..n everywhere
        if not bool((x == group.size * (group.size + 1) / 2).all()):
            reason, reducer = "wrong sums", None
    except Exception as e:  # no symmetric memory in this build, no P2P between these GPUs, ...
        reason, reducer = f"{type(e).__name__}: {e}", None
    ok = torch.tensor([1 if reducer is not None else 0], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group.cpu_group)
    if ok.item() == 1:
        group.fast_all_reduce = reducer
        log.info("TP all-reduce: one-shot over NVLink P2P up to %d KiB, NCCL above", reducer.max_bytes >> 10)
        return True
    log.warning("TP all-reduce: NCCL only (the P2P all-reduce is unavailable on %s: %s)",
                "this rank" if reason else "another rank", reason or "see its log")
    return False
