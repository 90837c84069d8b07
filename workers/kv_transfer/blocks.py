"""Gather KV blocks into one contiguous buffer per transfer (not one message per block), and back."""
from __future__ import annotations

import torch


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int], layers: slice, heads: slice) -> torch.Tensor:
    """kv_cache [L, 2, num_blocks, block_size, H, D] -> contiguous [l, 2, n, block_size, h, D]."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return kv_cache[layers].index_select(2, index)[..., heads, :].contiguous()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], layers: slice, heads: slice, buf: torch.Tensor) -> None:
    """Inverse of gather_blocks: write buf [l, 2, n, block_size, h, D] into the given blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    target = kv_cache[layers]  # a view: writes land in the cache
    if heads == slice(None) or (heads.start in (0, None) and heads.stop == target.shape[4]):
        target.index_copy_(2, index, buf.to(target.dtype))
    else:
        # Partial heads: index_copy_ cannot take a head slice, so copy block by block into the view.
        for i, b in enumerate(block_ids):
            target[:, :, b, :, heads, :].copy_(buf[:, :, i])


def transfer_shape(kv_cache: torch.Tensor, num_blocks: int, layers: slice, heads: slice) -> tuple[int, ...]:
    l = len(range(*layers.indices(kv_cache.shape[0])))
    h = len(range(*heads.indices(kv_cache.shape[4])))
    return (l, 2, num_blocks, kv_cache.shape[3], h, kv_cache.shape[5])
