"""Where a replica's ranks run: one Ray placement group per TP group.

Ranks follow the grid of `parallel/state.py` (TP innermost), so TP group g is ranks
[g * tp, (g + 1) * tp). Each TP group is STRICT_PACK-ed onto one node, where its per-layer
all-reduces stay on NVLink or shared memory; pipeline stages (and SP groups) talk far less often and
may land on other nodes.
"""
from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from parallel.config import ParallelConfig
from workers.executor import ExecutorError


class RankPlacement:
    def __init__(self, parallel: ParallelConfig, use_cuda: bool, timeout_s: float):
        self.tp = parallel.tensor_parallel_size
        kind = "GPU" if use_cuda else "CPU"
        per_rank = parallel.gpus_per_rank if use_cuda else 1.0
        self.bundle = {kind: per_rank, **parallel.rank_resources}
        num_groups = parallel.world_size // self.tp
        _check_feasible(kind, parallel.world_size, self.tp, per_rank)
        self.groups: list[PlacementGroup] = [
            placement_group([dict(self.bundle) for _ in range(self.tp)], strategy="STRICT_PACK")
            for _ in range(num_groups)
        ]
        try:
            ray.get([pg.ready() for pg in self.groups], timeout=timeout_s)
        except GetTimeoutError:
            self.remove()
            raise ExecutorError(
                f"could not place {parallel.world_size} ranks ({num_groups} groups of {self.tp} "
                f"{kind + 's' if per_rank == 1 else f'ranks of {per_rank:g} {kind}'}, each group on one node) "
                f"within {timeout_s:.0f}s; the cluster has {ray.available_resources().get(kind, 0):g} {kind}s free"
            ) from None

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.groups[rank // self.tp],
                                                placement_group_bundle_index=rank % self.tp)

    def remove(self) -> None:
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray is shutting down: nothing left to free
                pass
        self.groups = []


def _check_feasible(kind: str, world_size: int, tp: int, per_rank: float = 1.0) -> None:
    """Fail at once where no amount of waiting helps: a placement group that can never fit waits forever."""
    total = ray.cluster_resources().get(kind, 0)
    per_node = [n["Resources"].get(kind, 0) for n in ray.nodes() if n.get("Alive")]
    if total < world_size * per_rank or max(per_node, default=0) < tp * per_rank:
        raise ExecutorError(
            f"{world_size} ranks{'' if per_rank == 1 else f' of {per_rank:g} {kind}'} need {world_size * per_rank:g} {kind}s, "
            f"{tp * per_rank:g} of them on one node (a TP group); the Ray cluster has "
            f"{total:g} {kind}s, at most {max(per_node, default=0):g} on one node (a Ray started earlier in this process "
            f"keeps its size: start it with enough, e.g. ray.init(num_cpus=...))"
        )
