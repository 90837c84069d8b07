"""Process groups of one replica, built from a single rank grid.

Rank layout (TP innermost, so a TP group's ranks are adjacent, i.e. on one node):
    global_rank = (pp_rank * sp_size + sp_rank) * tp_size + tp_rank
Each group has a device group (NCCL on GPUs, gloo on CPU) for tensors and a gloo CPU group for
metadata. Without torch.distributed (one process) every group has size 1 and collectives are no-ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from parallel.config import ParallelConfig

if TYPE_CHECKING:
    from parallel.p2p_allreduce import PushedPartials


@dataclass
class Group:
    ranks: list[int] = field(default_factory=lambda: [0])  # global ranks, in group order
    rank: int = 0  # this process's index in `ranks`
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    # Sums a tensor over the group in place and returns True, or returns False for one it does not take
    # (parallel/p2p_allreduce.py); `reduce_partial_sums` tries it before NCCL.
    fast_all_reduce: Callable[[torch.Tensor], bool] | None = None
    # The batch-1 fused decoder's slots for row-parallel partial sums pushed over NVLink instead of all-reduced
    # (parallel/p2p_allreduce.PushedPartials), where the P2P all-reduce is up.
    pushed_partials: PushedPartials | None = None
    # A TP head's greedy (max, id, log-sum-exp) rows pushed to every rank the same way instead of all-gathered
    # (TANDEM_TP_GREEDY_GATHER=push, the default; parallel/p2p_allreduce.enable_pushed_greedy).
    pushed_greedy: PushedPartials | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


_TP = Group()
_PP = Group()
_SP = Group()
_EP = Group()


def tp_group() -> Group:
    return _TP


def pp_group() -> Group:
    return _PP


def sp_group() -> Group:
    return _SP


def ep_group() -> Group:
    return _EP


def rank_grid(config: ParallelConfig) -> list[list[list[int]]]:
    """grid[pp][sp][tp] -> global rank."""
    tp, sp, pp = config.tensor_parallel_size, config.sequence_parallel_size, config.pipeline_parallel_size
    return [[[(p * sp + s) * tp + t for t in range(tp)] for s in range(sp)] for p in range(pp)]


def _new_group(ranks: list[int], me: int, device_backend: str) -> Group | None:
    # Every process must call new_group for every group, in the same order, even ones it is not in.
    device_group = dist.new_group(ranks, backend=device_backend)
    cpu_group = dist.new_group(ranks, backend="gloo") if device_backend != "gloo" else device_group
    if me not in ranks:
        return None
    return Group(ranks=ranks, rank=ranks.index(me), device_group=device_group, cpu_group=cpu_group)


def init_groups(config: ParallelConfig) -> None:
    """Build TP/SP/PP/EP groups; torch.distributed must already be initialised with world_size ranks."""
    global _TP, _PP, _SP, _EP
    me, world = dist.get_rank(), dist.get_world_size()
    if world != config.world_size:
        raise ValueError(f"torch.distributed has {world} ranks but the parallel config needs {config.world_size}")
    backend = dist.get_backend()
    grid = rank_grid(config)
    tp_n, sp_n, pp_n = config.tensor_parallel_size, config.sequence_parallel_size, config.pipeline_parallel_size
    tp_groups = [grid[p][s] for p in range(pp_n) for s in range(sp_n)]
    sp_groups = [[grid[p][s][t] for s in range(sp_n)] for p in range(pp_n) for t in range(tp_n)]
    pp_groups = [[grid[p][s][t] for p in range(pp_n)] for s in range(sp_n) for t in range(tp_n)]
    # With EP, experts are spread over all ranks of a pipeline stage (its TP x SP ranks). Without it
    # the EP group is the trivial one, so `ep_group().size > 1` is exactly "experts are spread".
    ep_groups = [[r for s in range(sp_n) for r in grid[p][s]] for p in range(pp_n)] if config.expert_parallel_size > 1 else []
    found: dict[str, Group] = {"ep": Group(ranks=[me])}
    for name, groups in (("tp", tp_groups), ("sp", sp_groups), ("pp", pp_groups), ("ep", ep_groups)):
        for ranks in groups:
            g = _new_group(ranks, me, backend)
            if g is not None:
                found[name] = g
    if found["ep"].size > 1 and found["ep"].ranks == found["tp"].ranks:
        # EP over the TP group alone (no SP): one group, so what the TP group gains later (its P2P all-reduce,
        # parallel/p2p_allreduce.py) serves the MoE's partial sums too. As two objects, the MoE's 48 all-reduces of
        # an EP=2 decode step went to NCCL's ring: 0.8 ms of a 14.4 ms step on 2 H200s.
        found["ep"] = found["tp"]
    _TP, _SP, _PP, _EP = found["tp"], found["sp"], found["pp"], found["ep"]


def reset_groups() -> None:
    """Back to the single-process layout (tests, or a process that re-initialises)."""
    global _TP, _PP, _SP, _EP
    _TP, _PP, _SP, _EP = Group(), Group(), Group(), Group()
