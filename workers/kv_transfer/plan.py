"""Resharding plan: which prefill rank sends which KV slice to which decode rank.

Each rank of a replica holds the KV of some layers (its pipeline stage) and some KV heads (its TP
shard; with tp > num_kv_heads a head is replicated on several ranks). The two pools may be laid out
differently, so each decode rank gathers its (layers x heads) from whichever prefill ranks hold them.
Sources for replicated heads are spread over the replicas to balance senders.

With sequence parallelism (SP) on the prefill side a rank also holds only the blocks its SP rank owns
(`workers.kv_layout.block_owner`), so every (layer, head) is split further by sequence block index:
each block comes from a rank of its owner. Decode replicas do not use SP: their ranks hold every block.
"""
from __future__ import annotations

from dataclasses import dataclass

from workers.kv_layout import block_owner


def kv_head_range(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The global KV heads a TP rank holds (same rule as parallel.linear.QKVParallelLinear)."""
    if tp_size >= num_kv_heads:
        h = tp_rank // (tp_size // num_kv_heads)
        return range(h, h + 1)
    per = num_kv_heads // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


@dataclass(frozen=True)
class RankShard:
    """What one rank of a replica holds: a slice of layers and of KV heads (global indices), and, under
    SP, the blocks its SP rank owns."""

    rank: int  # rank inside its replica
    layers: range
    heads: range
    sp_rank: int = 0
    sp_size: int = 1
    device: str = ""  # the GPU's UUID for a CUDA rank ("" on CPU): ranks of two pools may share one GPU


def share_a_gpu(src: list[RankShard], dst: list[RankShard]) -> bool:
    """Whether some prefill rank and some decode rank sit on the same GPU (pools sharing GPUs through
    `gpus_per_rank`). NCCL refuses a communicator with two ranks on one device, so such a pair moves its
    KV over gloo through host memory instead (workers/kv_transfer/transport.py)."""
    return bool({s.device for s in src if s.device} & {d.device for d in dst if d.device})


@dataclass(frozen=True)
class Transfer:
    src: int  # prefill rank
    dst: int  # decode rank
    layers: range  # global layer indices
    heads: range  # global KV head indices
    blocks: tuple[int, ...]  # indices into the sequence's block table (absolute: the first is after the decode's hits)

    def local_slices(self, src_shard: RankShard, dst_shard: RankShard) -> tuple[slice, slice, slice, slice]:
        """(src layer slice, src head slice, dst layer slice, dst head slice) into each side's cache."""
        def rel(r: range, base: range) -> slice:
            return slice(r.start - base.start, r.stop - base.start)

        return rel(self.layers, src_shard.layers), rel(self.heads, src_shard.heads), rel(self.layers, dst_shard.layers), rel(self.heads, dst_shard.heads)


def replica_shards(tp_size: int, pp_size: int, num_layers: int, num_kv_heads: int, sp_size: int = 1) -> list[RankShard]:
    """Shards of every rank of a replica, in rank order: rank = (pp_rank * sp_size + sp_rank) * tp_size + tp_rank
    (parallel.state.rank_grid)."""
    from workers.models.transformer import stage_layers

    return [
        RankShard((pp * sp_size + s) * tp_size + t, stage_layers(num_layers, pp_size, pp), kv_head_range(t, tp_size, num_kv_heads), s, sp_size)
        for pp in range(pp_size)
        for s in range(sp_size)
        for t in range(tp_size)
    ]


def _intersect(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def plan_transfers(src: list[RankShard], dst: list[RankShard], blocks: range) -> list[Transfer]:
    """Every (layer, head, block index in `blocks`) each decode rank holds comes from exactly one prefill
    rank that holds it. Both sides walk the same plan in order, so their messages pair up."""
    if any(d.sp_size != 1 for d in dst):
        raise ValueError("decode replicas do not use sequence parallelism: every decode rank must hold every block")
    sp_size = src[0].sp_size
    if any(s.sp_size != sp_size for s in src):
        raise ValueError(f"prefill shards disagree on the SP size: {sorted({s.sp_size for s in src})}")
    # The block indices each SP rank of the prefill replica owns; ranks owning none of them send nothing.
    owned = [tuple(i for i in blocks if block_owner(i, sp_size) == s) for s in range(sp_size)]
    plan: list[Transfer] = []
    for d in dst:
        for layers in _layer_cuts(src, d.layers):
            for sp_rank in (s for s in range(sp_size) if owned[s]):
                for h in d.heads:
                    holders = [s for s in src if s.sp_rank == sp_rank and h in s.heads and layers.start in s.layers]
                    if not holders:
                        raise ValueError(f"no prefill rank of SP rank {sp_rank} holds layer {layers.start} head {h}")
                    s = holders[d.rank % len(holders)]
                    prev = plan[-1] if plan else None
                    # Merge consecutive heads from the same source into one transfer.
                    if prev and prev.dst == d.rank and prev.src == s.rank and prev.layers == layers and prev.heads.stop == h:
                        plan[-1] = Transfer(s.rank, d.rank, layers, range(prev.heads.start, h + 1), owned[sp_rank])
                    else:
                        plan.append(Transfer(s.rank, d.rank, layers, range(h, h + 1), owned[sp_rank]))
    return plan


def _layer_cuts(src: list[RankShard], layers: range) -> list[range]:
    """Split a decode rank's layers where prefill stage boundaries fall."""
    cuts = sorted({layers.start, layers.stop} | {s.layers.start for s in src if layers.start < s.layers.start < layers.stop})
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
