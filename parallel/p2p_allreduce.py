"""All-reduce over NVLink peer-to-peer loads (torch symmetric memory), for the messages where NCCL is slow.

Why: TP runs two all-reduces per layer. At decode they are small ([batch, hidden]: 8 KB at batch 1 on
Llama-3.1-8B) and NCCL's ring takes 16-22 us each from a CUDA graph on 2 H200s in isolation, ~11 us in
the model (0.7 ms of a 3.6 ms batch-1 step). A one-shot all-reduce has every rank copy its input into a buffer all ranks have mapped,
meet at a barrier, and each read all peers' buffers and sum: one kernel, one hop. Measured on 2 H200s
(scripts/bench_allreduce.py, in a CUDA graph, 2026-11-26): 8 KB 6.7 us vs NCCL 22.5, 512 KB 10.9 vs 20.2,
2 MB 21.4 vs 41.3, 6 MB 48.1 vs 50.3, 16 MB 119.5 vs 92.8. Above 1 MB the two-shot kernel (each rank sums
its share of the message from every peer, then gathers the other shares) beats both, up to 32 MB (the limits
below). Each rank of the one-shot reads (n - 1) x the message, so on more GPUs the crossover comes sooner
(limits there are scaled down, not measured). Multicast (NVLS) stays off: it hangs on some hosts.

Ranks must see each other's GPUs (torch's symmetric memory refuses two ranks that both call theirs
cuda:0): Ray rank actors of a TP group on GPUs see their whole node (cluster/ray_runtime.py).

`P2PAllReduce(group, device)` is set on a group as `group.fast_all_reduce` (parallel/comm.py calls it
first); it returns False for a tensor it does not take (too large, wrong dtype), which then goes to NCCL.
Works inside CUDA graphs.
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel.state import Group

if TYPE_CHECKING:
    from parallel.kernels.pushed_reduce import PushedAllReduce

log = logging.getLogger(__name__)

# The mark of a pushed-partials slot not yet written: a 16-bit negative zero, as int16 (0x8000); in float64 slots
# (the TP greedy rows) a 64-bit negative zero, as int64.
EMPTY_BITS = -32768
EMPTY_BITS64 = -(1 << 63)


def mark_empty(slots: torch.Tensor) -> None:
    """Every value of 16-bit or float64 slots set to the not-yet-written mark (a negative zero)."""
    if slots.element_size() == 2:
        slots.view(torch.int16).fill_(EMPTY_BITS)
    elif slots.dtype == torch.float64:
        slots.view(torch.int64).fill_(EMPTY_BITS64)
    else:
        raise ValueError(f"pushed slots hold 16-bit or float64 values, not {slots.dtype}")

# Largest message for the one-shot kernel, by group size (2 GPUs: the two-shot wins above 1 MB, see below);
# more GPUs read (n - 1) x the message, so the crossover with NCCL comes sooner (not measured beyond 2).
MAX_BYTES = {2: 1 << 20, 4: 1 << 20, 8: 256 << 10}
# Above the one-shot limit and up to this, the two-shot all-reduce over the same buffer (each rank sums its
# 1/n of the message from every peer, then gathers the others' sums): prefill-sized messages (a mixed step of
# ~1K tokens all-reduces 8 MB, 64 times). 0: NCCL above the one-shot limit. Only where measured: on 2 H200s
# (scripts/bench_allreduce.py, in a CUDA graph, 2026-11-29) the two-shot took 19.0 us at 2 MB (one-shot 21.7,
# NCCL 37.1), 27.0 at 4 MB (36.9, 42.9), 41.7 at 8 MB (63.4, 56.6), 72.2 at 16 MB (-, 86.3), 140.5 at 32 MB
# (NCCL 163.6; eagerly 143.8 against 140.1), and 280 at 64 MB against NCCL's 272; the one-shot wins to 1 MB.
TWO_SHOT_MAX_BYTES: dict[int, int] = {2: 32 << 20}


PUSHED_ENV = "TANDEM_P2P_PUSHED"


def pushed_min_bytes(one_shot_max: int, environ: dict[str, str] | None = None) -> int | None:
    """TANDEM_P2P_PUSHED: the size above which messages go to the pushed all-reduce (parallel/kernels/
    pushed_reduce.py; opt-in, not yet measured on GPUs): unset or "off" none (None), "on" those above the one-shot
    kernel's limit (where the two-shot runs now: prefill steps, decode batches of 128 rows and more on Llama-3.1-8B),
    "from:K" those above K KiB. Another value is refused by name."""
    raw = (os.environ if environ is None else environ).get(PUSHED_ENV, "off").strip().lower()
    if raw in ("off", "0", ""):
        return None
    if raw in ("on", "1"):
        return one_shot_max
    name, _, kib = raw.partition(":")
    if name == "from" and kib.isdigit():
        return int(kib) << 10
    raise ValueError(f"{PUSHED_ENV}={raw!r}: expected 'off', 'on' or 'from:K' (KiB)")


def two_shot_enabled() -> bool:
    """TANDEM_P2P_TWO_SHOT=0 sends everything above the one-shot limit to NCCL (to compare)."""
    return os.environ.get("TANDEM_P2P_TWO_SHOT", "1") != "0"


class P2PAllReduce:
    # The pushed all-reduce (`enable_pushed_all_reduce`, TANDEM_P2P_PUSHED) and the size above which it takes a message.
    pushed: PushedAllReduce | None = None
    pushed_min: int = 0

    def __init__(self, group: Group, device: torch.device, dtype: torch.dtype, one_shot_max: int | None = None,
                 two_shot_max: int | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.device_group.group_name
        self.one_shot_max = MAX_BYTES.get(group.size, 0) if one_shot_max is None else one_shot_max
        if two_shot_max is None:
            two_shot_max = TWO_SHOT_MAX_BYTES.get(group.size, 0) if two_shot_enabled() else 0
        self.two_shot_max = two_shot_max
        self.max_bytes = max(self.one_shot_max, self.two_shot_max)
        self.dtype = dtype
        self.buffer = symm_mem.empty(self.max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        self.two_shot = torch.ops.symm_mem.two_shot_all_reduce_out

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place; False (x untouched) where this kernel does not take it."""
        n = x.numel()
        nbytes = n * x.element_size()
        if self.pushed is not None and nbytes > self.pushed_min and self.pushed(x):
            return True
        if x.dtype != self.dtype or not x.is_contiguous() or nbytes > self.max_bytes or n % 8:
            return False
        flat = x.view(-1)
        if nbytes <= self.one_shot_max:
            self.one_shot(self.buffer[:n], flat, "sum", self.group_name, flat)
        else:  # the two-shot kernel reads its input from the mapped buffer: stage x there first
            staged = self.buffer[:n]
            staged.copy_(flat)
            self.two_shot(staged, "sum", self.group_name, flat)
        return True


    def staging(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A [rows, cols] view of the mapped buffer for a producer to write a message the two-shot kernel takes
        (then `reduce_staged`), so it need not be copied there; None for a message that kernel does not take."""
        n = rows * cols
        nbytes = n * dtype.itemsize
        if dtype != self.dtype or n % 8 or not self.one_shot_max < nbytes <= self.two_shot_max:
            return None
        if self.pushed is not None and nbytes > self.pushed_min and n <= self.pushed.width:
            return None  # the pushed kernel takes it: the producer writes where it likes
        return self.buffer[:n].view(rows, cols)

    def reduce_staged(self, staged: torch.Tensor) -> torch.Tensor:
        """The group's sum of the message each rank wrote into `staging`'s view, in a new tensor."""
        out = torch.empty_like(staged)
        self.two_shot(staged.view(-1), "sum", self.group_name, out.view(-1))
        return out


def enable_p2p_all_reduce(group: Group, device: torch.device, dtype: torch.dtype) -> bool:
    """Give `group` a P2P all-reduce where every rank can set one up; all ranks agree, else none uses it."""
    if group.size == 1 or device.type != "cuda" or group.size not in MAX_BYTES:
        return False
    reducer, reason = None, ""
    try:
        reducer = P2PAllReduce(group, device, dtype)
        sizes = [1024] + ([reducer.max_bytes // dtype.itemsize] if reducer.two_shot_max > reducer.one_shot_max else [])
        for n in sizes:  # a check of each kernel: the sum of 1..n everywhere
            x = torch.full((n,), float(group.rank + 1), dtype=dtype, device=device)
            reducer(x)
            if not bool((x == group.size * (group.size + 1) / 2).all()):
                reason, reducer = f"wrong sums ({n} values)", None
                break
    except Exception as e:  # no symmetric memory in this build, no P2P between these GPUs, ...
        reason, reducer = f"{type(e).__name__}: {e}", None
    if _all_agree(reducer is not None, group):
        group.fast_all_reduce = reducer
        log.info("TP all-reduce over NVLink P2P: one-shot up to %d KiB, two-shot up to %d KiB, NCCL above",
                 reducer.one_shot_max >> 10, reducer.two_shot_max >> 10)
        return True
    log.warning("TP all-reduce: NCCL only (the P2P all-reduce is unavailable on %s: %s)",
                "this rank" if reason else "another rank", reason or "see its log")
    return False


def _all_agree(ok: bool, group: Group) -> bool:
    """Whether every rank of `group` says ok (over its CPU group)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return flag.item() == 1


@dataclass(frozen=True)
class PushedSite:
    """One row-parallel output's exchange slots, as the fused GEMVs (parallel/kernels/gemv.py) take them."""
    world: int
    parts: torch.Tensor  # [world, width]: this rank's slots; rank p's partial sum lands in row p
    reset: torch.Tensor  # [world, width]: the previous site's slots, which the kernel that takes this site empties
    ptrs: torch.Tensor  # int64 [world]: on the device, every rank's address of this rank's row at this site


class PushedPartials:
    """TP partial sums exchanged without an all-reduce kernel: the batch-1 fused decoder's (workers/models/
    fused_decode.py) 2 x layers row-parallel outputs a step, each at its own site.

    Why: a one-shot all-reduce between two GEMVs costs its launch, a barrier round trip and a read over NVLink
    (~10 us a call in a TP=2 batch-1 step, 64 calls). Here the row-parallel GEMV stores its partial sum straight
    into a slot of every rank's buffer (NVLink stores from its epilogue), and the next GEMV, which RMSNorms h
    anyway, rereads its own slots until no value is the empty mark (EMPTY_BITS: a pushed value is never -0),
    then sums them in rank order, so every rank gets the same h bit for bit. No barrier and no extra kernel:
    the data is its own flag (the Lamport scheme of TensorRT-LLM's all-reduce). The GEMV that takes site s marks
    site s - 1 empty again; every GEMV that read s - 1 has finished by then (stream order), and a peer writes
    s - 1 again only after this rank's later pushes, in the next step.

    Both ranks must run the same sites in the same order (TP ranks replay the same batch-1 CUDA graph); a rank
    that stops mid-step leaves its peers waiting, as a collective would.
    """

    def __init__(self, group: Group, buffer: torch.Tensor, width: int, sites: int):
        """buffer: this rank's symmetric-memory allocation of sites x world x width values (`enable_pushed_partials`
        makes it, and every rank agrees it has one, before this maps them: a collective)."""
        import torch.distributed._symmetric_memory as symm_mem

        self.world, self.rank, self.width, self.sites = group.size, group.rank, width, sites
        device, dtype = buffer.device, buffer.dtype
        self.buffer = buffer
        handle = symm_mem.rendezvous(self.buffer, group.device_group.group_name)
        offset = self.buffer.data_ptr() - handle.buffer_ptrs[group.rank]  # the same on every rank
        bases = [p + offset for p in handle.buffer_ptrs]
        row = group.rank * width * dtype.itemsize
        # site s's pointers: each rank's base + (s x world x width) elements + this rank's row
        self._ptrs = torch.tensor([[b + s * group.size * width * dtype.itemsize + row for b in bases]
                                   for s in range(sites)], dtype=torch.int64, device=device)
        self.slots = self.buffer.view(sites, group.size, width)
        self._owner: weakref.ref | None = None
        self._turn = 0  # `next_site`'s count
        mark_empty(self.buffer)
        torch.cuda.synchronize(device)
        dist.barrier(group=group.cpu_group)  # every rank's slots marked empty before any rank pushes

    def claim(self, model) -> bool:
        """Whether `model` may push here: the first model to ask owns the slots while it lives (every site's state
        between steps assumes one model's sequence of sites)."""
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            self._owner, owner = weakref.ref(model), model
        return owner is model

    def pointers(self) -> torch.Tensor:
        """[sites, world] int64: the address of this rank's row of each site on each rank."""
        return self._ptrs

    def site(self, s: int) -> PushedSite:
        return PushedSite(self.world, self.slots[s], self.slots[(s - 1) % self.sites], self._ptrs[s])

    def next_site(self) -> PushedSite:
        """The sites in turn, for exchanges made eagerly one after another (the TP greedy rows): every rank calls this
        as often as the others, as it would join a collective. Three sites at least: a peer writes a site again only
        after this rank has pushed into the site after it, so the one this rank empties is never one a peer may be
        writing."""
        site = self.site(self._turn)
        self._turn = (self._turn + 1) % self.sites
        return site


def push_partials_enabled() -> bool:
    """TANDEM_TP_PUSH_PARTIALS=0 keeps the batch-1 fused decoder on the all-reduce (to compare)."""
    return os.environ.get("TANDEM_TP_PUSH_PARTIALS", "1") != "0"


GREEDY_GATHER_ENV = "TANDEM_TP_GREEDY_GATHER"


def greedy_gather_pushed() -> bool:
    """TANDEM_TP_GREEDY_GATHER=push (the default): a TP head's greedy (max, id, log-sum-exp) rows go to every rank as
    pushed slots (`enable_pushed_greedy`) instead of through NCCL's all-gather (`nccl`). On 2 x H200 (2026-11-29,
    docs/benchmarks.md) batch-1 TP=2 388.3 / 388.1 tok/s pushed against 386.7 / 386.9 all-gathered, one call."""
    mode = os.environ.get(GREEDY_GATHER_ENV, "push").strip().lower()
    if mode not in ("nccl", "push"):
        raise ValueError(f"{GREEDY_GATHER_ENV}={mode!r}: expected 'nccl' or 'push'")
    return mode == "push"


def enable_pushed_greedy(group: Group, device: torch.device, max_rows: int) -> bool:
    """Give `group` slots for the TP greedy rows (`group.pushed_greedy`): 3 sites of every rank's [max_rows, 3]
    float64 rows, where the P2P all-reduce is up and TANDEM_TP_GREEDY_GATHER=push; all ranks agree."""
    if group.fast_all_reduce is None or not greedy_gather_pushed():
        return False
    pushed = _symmetric_slots(group, device, torch.float64, 3 * max_rows, 3, "the TP greedy rows")
    if pushed is None:
        return False
    group.pushed_greedy = pushed
    log.info("TP greedy decoding: each rank's (max, id, log-sum-exp) of up to %d rows pushed, not all-gathered",
             max_rows)
    return True


def _symmetric_slots(group: Group, device: torch.device, dtype: torch.dtype, width: int, sites: int,
                     what: str) -> PushedPartials | None:
    """PushedPartials over a new symmetric-memory buffer, or None (logged) where any rank could not allocate one."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer, reason = None, ""
    try:  # allocated apart from the mapping: a rank that cannot allocate must not leave the others in a collective
        buffer = symm_mem.empty(sites * group.size * width, dtype=dtype, device=device)
    except Exception as e:  # out of memory, ...
        reason = f"{type(e).__name__}: {e}"
    if not _all_agree(buffer is not None, group):
        log.warning("%s: no pushed slots on %s (%s); the collective stays", what,
                    "this rank" if reason else "another rank", reason or "see its log")
        return None
    return PushedPartials(group, buffer, width, sites)


def enable_pushed_partials(group: Group, device: torch.device, dtype: torch.dtype, width: int, sites: int) -> bool:
    """Give `group` pushed-partials slots (`group.pushed_partials`) where its P2P all-reduce is up (the same
    mapped memory) and the dtype is 16-bit; every rank decides the same from what all agreed on."""
    if group.fast_all_reduce is None or dtype not in (torch.bfloat16, torch.float16) or not push_partials_enabled():
        return False
    pushed = _symmetric_slots(group, device, dtype, width, sites, "TP batch-1 decode's partial sums")
    if pushed is None:
        return False
    group.pushed_partials = pushed
    log.info("TP batch-1 decode: row-parallel partial sums pushed to %d sites of %d values (no all-reduce kernel)",
             sites, width)
    return True


def enable_pushed_all_reduce(group: Group, device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Where TANDEM_P2P_PUSHED asks for it, give the group's P2P all-reduce the pushed kernel (parallel/kernels/
    pushed_reduce.py) for messages of up to `width` values (capped at the two-shot kernel's largest) above the
    configured size; needs the P2P all-reduce up and a 16-bit dtype. Every rank decides the same (all agree)."""
    from parallel.kernels.pushed_reduce import SITES, PushedAllReduce

    p2p = group.fast_all_reduce
    if not isinstance(p2p, P2PAllReduce) or dtype not in (torch.bfloat16, torch.float16):
        return False
    least = pushed_min_bytes(p2p.one_shot_max)
    width = min(width, TWO_SHOT_MAX_BYTES.get(group.size, 0) // dtype.itemsize)
    if least is None or not width:
        return False
    slots = _symmetric_slots(group, device, dtype, width, SITES, "the pushed all-reduce")
    if slots is None:
        return False
    reducer = PushedAllReduce(slots, group.rank, group.size)
    x = torch.full((min(width, 1 << 16),), float(group.rank + 1), dtype=dtype, device=device)
    ok = reducer(x) and bool((x == group.size * (group.size + 1) / 2).all())  # a check: 1..n summed everywhere
    if not _all_agree(ok, group):
        log.warning("TP all-reduce: the pushed kernel gave wrong sums on %s; the P2P kernels stay as they are",
                    "this rank" if not ok else "another rank")
        return False
    p2p.pushed, p2p.pushed_min = reducer, least
    log.info("TP all-reduce: messages above %d KiB and up to %d values pushed over NVLink (%d sites)",
             least >> 10, width, SITES)
    return True
