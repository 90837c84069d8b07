"""Reference backend: gather the paged K/V with the block table, then PyTorch SDPA.

Decode-only steps run as one padded SDPA over the batch; prefill chunks run per sequence with a
causal mask offset by the cached context. Other backends are tested against this one.

An FP8 cache (`kv_cache_dtype="fp8"`, float8_e4m3fn) stores k / KV_SCALE clamped to e4m3's range and
is read back as value * KV_SCALE in the queries' dtype (kv_quant.py); the step's own keys are the
rounded ones too, so every query sees what later steps will read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.backend import AttentionMetadata
from workers.attention.kv_quant import from_cache, is_fp8, to_cache


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' k/v [T, Hkv, D] into their cache slots (in the cache's dtype)."""
    _, num_blocks, block_size, h, d = kv_cache.shape
    k, v = to_cache(k, kv_cache.dtype), to_cache(v, kv_cache.dtype)
    if is_fp8(kv_cache.dtype):  # index_copy_ has no float8 kernels: copy the bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kv_cache[0].view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(num_blocks * block_size, h, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D], block_tables [B, nb] -> [B, H, max_len, D] (in `dtype`: an FP8
    cache is upcast)."""
    b, _ = block_tables.shape
    block_size = cache.shape[1]
    nb = -(-max_len // block_size)
    fp8 = is_fp8(cache.dtype)
    kv = cache.view(torch.uint8)[block_tables[:, :nb]].view(cache.dtype) if fp8 else cache[block_tables[:, :nb]]  # [B, nb, block_size, H, D]
    kv = kv.reshape(b, nb * block_size, *cache.shape[2:])[:, :max_len].transpose(1, 2)
    return from_cache(kv, dtype) if dtype is not None else kv


class TorchAttention:
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.decode_only:
            res = self._decode(q, kv_cache, meta, scale)
            return res if out is None else out.copy_(res)
        out = torch.empty_like(q) if out is None else out
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            ki = gather_kv(kv_cache[0], meta.block_tables[i : i + 1], seq_len, q.dtype)  # [1, Hkv, seq_len, D]
            vi = gather_kv(kv_cache[1], meta.block_tables[i : i + 1], seq_len, q.dtype)
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
    keys = gather_kv(kv_cache[0], block_tables, max_len, q.dtype)  # [B, Hkv, L, D]
    values = gather_kv(kv_cache[1], block_tables, max_len, q.dtype)
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)
