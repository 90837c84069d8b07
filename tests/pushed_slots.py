"""TP ranks' pushed-partials slots played in one process, for the interpreter tests of the push / take kernels: each
rank has its own slots tensor [sites, world, width], all marked empty, and each rank's site holds every rank's
address of its row there, as symmetric memory maps them on GPUs (parallel/p2p_allreduce.PushedPartials)."""
from __future__ import annotations

from typing import Callable

import torch

from parallel.p2p_allreduce import PushedSite, mark_empty


def played_slots(world: int, sites: int, width: int, dtype: torch.dtype,
                 device: str = "cpu") -> tuple[list[torch.Tensor], Callable[[int, int], PushedSite]]:
    """(every rank's slots, site(rank, s)): rank `rank`'s view of site s, its reset the site before (cyclic)."""
    slots = [torch.empty(sites, world, width, dtype=dtype, device=device) for _ in range(world)]
    for t in slots:
        mark_empty(t)
    size = torch.empty(0, dtype=dtype).element_size()

    def site(rank: int, s: int) -> PushedSite:
        ptrs = torch.tensor([slots[p].data_ptr() + (s * world + rank) * width * size for p in range(world)],
                            dtype=torch.int64, device=device)
        return PushedSite(world, slots[rank][s], slots[rank][(s - 1) % sites], ptrs)

    return slots, site
