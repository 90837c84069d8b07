"""Resharding plan: which prefill rank sends which KV slice to which decode rank.

Each rank of a replica holds the KV of some layers (its pipeline stage) and some KV heads (its TP
shard; with tp > num_kv_heads a head is replicated on several ranks). The two pools may be laid out
differently, so each decode rank gathers its (layers x heads) from whichever prefill ranks hold them.
Sources for replicated heads are spread over the replicas to balance senders.
"""
from __future__ import annotations

from dataclasses import dataclass


def kv_head_range(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The global KV heads a TP rank holds (same rule as parallel.linear.QKVParallelLinear)."""
    if tp_size >= num_kv_heads:
        h = tp_rank // (tp_size // num_kv_heads)
        return range(h, h + 1)
    per = num_kv_heads // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


@dataclass(frozen=True)
class RankShard:
    """What one rank of a replica holds: a slice of layers and of KV heads (global indices)."""

    rank: int  # rank inside its replica
    layers: range
    heads: range


@dataclass(frozen=True)
class Transfer:
    src: int  # prefill rank
    dst: int  # decode rank
    layers: range  # global layer indices
    heads: range  # global KV head indices

    def local_slices(self, src_shard: RankShard, dst_shard: RankShard) -> tuple[slice, slice, slice, slice]:
        """(src layer slice, src head slice, dst layer slice, dst head slice) into each side's cache."""
        def rel(r: range, base: range) -> slice:
            return slice(r.start - base.start, r.stop - base.start)

        return rel(self.layers, src_shard.layers), rel(self.heads, src_shard.heads), rel(self.layers, dst_shard.layers), rel(self.heads, dst_shard.heads)


def replica_shards(tp_size: int, pp_size: int, num_layers: int, num_kv_heads: int) -> list[RankShard]:
    """Shards of every rank of a replica with grid rank = pp_rank * tp_size + tp_rank (SP size 1)."""
    from workers.models.transformer import stage_layers

    return [
        RankShard(pp * tp_size + t, stage_layers(num_layers, pp_size, pp), kv_head_range(t, tp_size, num_kv_heads))
        for pp in range(pp_size)
        for t in range(tp_size)
    ]


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def plan_transfers(src: list[RankShard], dst: list[RankShard]) -> list[Transfer]:
    """Every (layer, head) each decode rank holds comes from exactly one prefill rank."""
    plan: list[Transfer] = []
    for d in dst:
        for layers in _layer_cuts(src, d.layers):
            for h in d.heads:
                holders = [s for s in src if h in s.heads and layers.start in s.layers]
                if not holders:
                    raise ValueError(f"no prefill rank holds layer {layers.start} head {h}")
                s = holders[d.rank % len(holders)]
                prev = plan[-1] if plan else None
                # Merge consecutive heads from the same source into one transfer.
                if prev and prev.dst == d.rank and prev.src == s.rank and prev.layers == layers and prev.heads.stop == h:
                    plan[-1] = Transfer(s.rank, d.rank, layers, range(prev.heads.start, h + 1))
                else:
                    plan.append(Transfer(s.rank, d.rank, layers, range(h, h + 1)))
    return plan


def _layer_cuts(src: list[RankShard], layers: range) -> list[range]:
    """Split a decode rank's layers where prefill stage boundaries fall."""
    cuts = sorted({layers.start, layers.stop} | {s.layers.start for s in src if layers.start < s.layers.start < layers.stop})
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
