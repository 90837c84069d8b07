"""Collectives named for what they do to a tensor's layout (after Megatron-core's mappings).

All are no-ops on a group of size 1, so the single-process path pays nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.state import Group


def reduce_partial_sums(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Each rank holds a partial sum of the full tensor (row-parallel output): sum them, in place."""
    if group.size == 1:
        return x
    if group.fast_all_reduce is not None and group.fast_all_reduce(x):
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def all_to_all_rows(x: torch.Tensor, out_counts: list[int], in_counts: list[int], group: Group) -> torch.Tensor:
    """Rows [sum(in_counts), ...] cut by in_counts, block r to rank r -> rows [sum(out_counts), ...] with
    out_counts[r] from rank r, in rank order. Every rank must know both lists (no size handshake here)."""
    out = x.new_empty((sum(out_counts), *x.shape[1:]))
    if group.size == 1:
        return out.copy_(x)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_counts, input_split_sizes=in_counts,
                           group=group.device_group)
    return out


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Each rank holds a slice of the last dim (column-parallel output): concatenate the slices."""
    if group.size == 1:
        return x
    return torch.cat(gather_to_all(x, group), dim=-1)


def gather_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Each rank holds equal-sized rows: stack them in rank order along dim 0."""
    if group.size == 1:
        return x
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group.device_group)
    return out


def gather_to_first(x: torch.Tensor, group: Group) -> list[torch.Tensor] | None:
    """Every rank's x (same shape on all) to the group's first rank, in rank order; None on the others.

    Used where only one rank consumes the result (the sampler), so the others skip receiving it.
    """
    if group.size == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)] if group.is_first else None
    dist.gather(x, parts, dst=group.ranks[0], group=group.device_group)
    return parts


def gather_to_all(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's x (same shape on all) to every rank of the group, in rank order: the same tensors on all,
    so a choice made from them (an argmax) is bitwise the same on every rank."""
    if group.size == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.device_group)
    return parts


def gather_last_dim_to_first(x: torch.Tensor, group: Group) -> torch.Tensor | None:
    """Column-parallel slices concatenated on the group's first rank only; None on the others. One rank: x itself
    (a one-part torch.cat would copy it: a kernel of the batch-1 decode graph, after the LM head)."""
    if group.size == 1:
        return x
    parts = gather_to_first(x, group)
    return None if parts is None else torch.cat(parts, dim=-1)
