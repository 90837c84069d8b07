"""Reference backend: gather the paged K/V with the block table, then PyTorch SDPA.

Decode-only steps run as one padded SDPA over the batch; prefill chunks run per sequence with a
causal mask offset by the cached context. Other backends are tested against this one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.backend import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' k/v [T, Hkv, D] into their cache slots."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    kv_cache[0].view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_tables [B, nb] -> [B, H, max_len, D]."""
    b, _ = block_tables.shape
    block_size = cache.shape[1]
    nb = -(-max_len // block_size)
    kv = cache[block_tables[:, :nb]]  # [B, nb, block_size, H, D]
    return kv.reshape(b, nb * block_size, *cache.shape[2:])[:, :max_len].transpose(1, 2)


class TorchAttention:
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            ki = gather_kv(kv_cache[0], meta.block_tables[i : i + 1], seq_len)  # [1, Hkv, seq_len, D]
            vi = gather_kv(kv_cache[1], meta.block_tables[i : i + 1], seq_len)
            if q_len == seq_len:
                mask, causal = None, q_len > 1
            else:
                # Query j sits at position seq_len - q_len + j and sees keys up to there.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask, causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None], False
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
            out[start : start + q_len] = oi[0].transpose(0, 1)
            start += q_len
        return out

    def _decode(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One padded SDPA per group of up to DECODE_GROUP sequences of similar length: each group pads
        to its own longest sequence, not the batch's (on CPU the padded gather dominates the step)."""
        lens = meta.seq_lens_cpu
        if len(lens) <= DECODE_GROUP:
            return _decode_padded(q, kv_cache, meta.block_tables, meta.seq_lens, max(lens), scale)
        order = sorted(range(len(lens)), key=lens.__getitem__)
        out = torch.empty_like(q)
        for start in range(0, len(order), DECODE_GROUP):
            rows = order[start : start + DECODE_GROUP]
            index = torch.tensor(rows, device=q.device)
            out[index] = _decode_padded(q[index], kv_cache, meta.block_tables[index], meta.seq_lens[index],
                                        max(lens[r] for r in rows), scale)
        return out


DECODE_GROUP = 32


def _decode_padded(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   max_len: int, scale: float) -> torch.Tensor:
    """q [B, Hq, D] (one new token per sequence) -> [B, Hq, D], keys padded to max_len and masked."""
    keys = gather_kv(kv_cache[0], block_tables, max_len)  # [B, Hkv, L, D]
    values = gather_kv(kv_cache[1], block_tables, max_len)
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)
