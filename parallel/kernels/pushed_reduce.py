"""An all-reduce whose data is its own flag, for TP's larger messages (TANDEM_P2P_PUSHED, parallel/p2p_allreduce.py).

Why: a TP=2 mixed step all-reduces 64 outputs of ~6.4 MB. The two-shot kernel that carries them (torch's symmetric
memory, parallel/p2p_allreduce.py) runs at most 24 CTAs and reads its peer's half over NVLink: ~36-42 us each on
2 x H200 (~170 GB/s), 2.3-2.8 ms of a ~14 ms step, while the link moves ~450 GB/s each way. Here each rank stores
its partial sum into every peer's slot (NVLink stores, which need no round trip) from CTAs spread over every SM,
and each rank waits in its own memory until no value of the peers' rows is the empty mark (a 16-bit -0, which a
pushed value never is: -0 goes as +0), then sums the rows in rank order, so every rank gets the same bits. The
batch-1 decoder's pushed partial sums do the same inside its GEMVs (gemv.py `push` / `take`); this is the
standalone kernel for [rows, hidden] outputs (prefill steps, decode batches), bytes over NVLink per rank: (world - 1)
x the message, as the two-shot's for two ranks.

The slots rotate over SITES sites; `state` (device int64: turn, tickets, then each site's last message size) picks
the site, so a CUDA graph replays whatever turn it comes at. A use empties the previous site's peer rows over that
use's length: a peer writes a site again only three uses later, after it has seen this rank's push of the use in
between, which this rank makes only after the emptying kernel has ended (stream order). The last CTA to finish a use
(a ticket) advances the turn. Every CTA is resident at once (a grid of at most CTAS_PER_SM a multiprocessor, each
walking blocks), so a CTA that waits never holds back a peer's push.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.gemv import _EMPTY, plus_zero, wait_filled

SITES = 3
BLOCK = 2048  # values a CTA handles at a time
CTAS_PER_SM = 2


@triton.jit
def _pushed_reduce_kernel(x_ptr, slots_ptr, ptrs_ptr, state_ptr, N, WIDTH, SITES: tl.constexpr, RANK: tl.constexpr,
                          WORLD: tl.constexpr, BLOCK: tl.constexpr, PUSH: tl.constexpr, SUM: tl.constexpr):
    """x [N] (in place) = the sum over ranks of each rank's x. slots [SITES, WORLD, WIDTH]: this rank's, row p of a
    site written by rank p; ptrs [SITES, WORLD]: the address of this rank's row of each site on each rank. PUSH and
    SUM: the two halves (both on GPUs; one after the other over every played rank in the interpreter)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    dt = x_ptr.dtype.element_ty
    turn = tl.load(state_ptr)
    site = turn % SITES
    blocks = tl.cdiv(N, BLOCK)
    if PUSH:
        for b in range(pid, blocks, grid):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            x = plus_zero(tl.load(x_ptr + offs, mask=mask, other=0.0))
            for p in tl.static_range(WORLD):
                if p != RANK:
                    base = tl.load(ptrs_ptr + site * WORLD + p).to(tl.pointer_type(dt))
                    tl.store(base + offs, x, mask=mask)
    if SUM:
        for b in range(pid, blocks, grid):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            acc = tl.zeros([BLOCK], tl.float32)
            for p in tl.static_range(WORLD):
                if p == RANK:
                    acc += plus_zero(tl.load(x_ptr + offs, mask=mask, other=0.0)).to(tl.float32)
                else:
                    acc += wait_filled(slots_ptr + (site * WORLD + p) * WIDTH + offs, mask).to(tl.float32)
            tl.store(x_ptr + offs, acc.to(dt), mask=mask)
        # The previous site's peer rows, empty again over the length its use wrote.
        prev = (turn + SITES - 1) % SITES
        prev_n = tl.load(state_ptr + 2 + prev).to(tl.int32)
        empty = tl.full([BLOCK], _EMPTY, tl.int16).to(dt, bitcast=True)
        for b in range(pid, tl.cdiv(prev_n, BLOCK), grid):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    tl.store(slots_ptr + (prev * WORLD + p) * WIDTH + offs, empty, mask=offs < prev_n)
        ticket = tl.atomic_add(state_ptr + 1, 1)
        if ticket == grid - 1:  # every CTA has read the turn: the next use takes the next site
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr + 2 + site, N.to(tl.int64))
            tl.store(state_ptr, turn + 1)


class PushedAllReduce:
    """A TP group's pushed all-reduce (`P2PAllReduce.pushed`, parallel/p2p_allreduce.enable_pushed_all_reduce):
    SITES sites of `width` values a rank in symmetric memory (`slots`, a PushedPartials over them) and the rotation's
    device state."""

    def __init__(self, slots, rank: int, world: int):
        self.slots, self.rank, self.world = slots, rank, world
        self.width = slots.width
        self.state = new_state(slots.buffer.device)
        self.max_ctas = max_ctas(slots.buffer.device)  # read once: every call asks for it

    def __call__(self, y: torch.Tensor) -> bool:
        """Sum y over the group in place and return True, or False (nothing done) for a message it does not take:
        longer than `width`, another dtype, not contiguous."""
        if y.numel() > self.width or y.dtype != self.slots.buffer.dtype or not y.is_contiguous():
            return False
        pushed_all_reduce(y.view(-1), self.slots.slots, self.slots.pointers(), self.state, self.rank, self.world,
                          grid=min(triton.cdiv(y.numel(), BLOCK), self.max_ctas))
        return True


def max_ctas(device: torch.device) -> int:
    """The most CTAs a launch takes on `device`: CTAS_PER_SM a multiprocessor on CUDA (all resident at once), no cap
    elsewhere (the interpreter runs them in turn)."""
    if device.type != "cuda":
        return 1 << 30
    return CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def new_state(device: torch.device | str) -> torch.Tensor:
    """The rotation's device state: turn 0, no tickets, no site written."""
    return torch.zeros(2 + SITES, dtype=torch.int64, device=device)


def pushed_all_reduce(x: torch.Tensor, slots: torch.Tensor, ptrs: torch.Tensor, state: torch.Tensor, rank: int,
                      world: int, push: bool = True, reduce: bool = True, grid: int | None = None) -> torch.Tensor:
    """Sum contiguous 16-bit x over the ranks in place (every rank calls it with its own part, in the same order as
    the others: a collective). slots [SITES, world, width], this rank's; ptrs [SITES, world] int64. `push` /
    `reduce` False: one half only (the interpreter tests play the ranks one after another). `grid`: CTAs (default
    every block's own, at most CTAS_PER_SM a multiprocessor on CUDA)."""
    n, width = x.numel(), slots.shape[-1]
    if x.element_size() != 2 or not x.is_contiguous() or n > width or slots.dtype != x.dtype:
        raise ValueError(f"pushed_all_reduce: {n} contiguous 16-bit values of the slots' dtype {slots.dtype}, at "
                         f"most {width}; got {x.dtype} x {n} (contiguous: {x.is_contiguous()})")
    if grid is None:
        grid = min(triton.cdiv(n, BLOCK), max_ctas(x.device))
    _pushed_reduce_kernel[(max(1, grid),)](x, slots, ptrs, state, n, width, SITES=SITES, RANK=rank, WORLD=world,
                                           BLOCK=BLOCK, PUSH=push, SUM=reduce, num_warps=4)
    return x
