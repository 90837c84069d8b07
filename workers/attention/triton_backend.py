"""Triton paged-attention backend (CUDA): KV write by slot mapping, split-K decode, varlen prefill.

Decode rows use the flash-decoding kernel (GQA-aware, one program per KV head group and context
slice); prefill chunks use the varlen causal kernel, except in steps whose sequences run at most 16
tokens each (a speculative verification step's k + 1), which go to the split-context kernel of
parallel/kernels/verify_attention.py: the prefill kernel gives them one program per query head and
leaves most of the GPU idle. In a mixed step the decodes come first
(`AttentionMetadata.num_decodes`) and each kernel takes its part: run through the prefill kernel, a
decode row would pay a whole query tile per query head. Nothing here syncs with the device or reads the device
tensors on the host, so decode steps can be captured in CUDA graphs (`workers/cuda_graphs.py`).
The torch backend (`torch_backend.py`) is the reference these kernels are tested against. An FP8 cache
is written and read by the same kernels (scale `kv_quant.KV_SCALE`).
"""
from __future__ import annotations

import torch

from workers.attention.backend import AttentionMetadata
from workers.attention.kv_quant import KV_SCALE
from parallel.kernels.paged_attention import decode_attention, prefill_attention, write_kv
from parallel.kernels import verify_attention as _verify


class TritonAttention:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        if meta.decode_only:  # the decode kernel writes the new k/v itself
            return decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len, out=out,
                                    k_new=k, v_new=v, slot_mapping=meta.slot_mapping, kv_scale=KV_SCALE)
        d = meta.num_decodes
        if d == 0:
            return _chunks(q, k, v, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.slot_mapping,
                           meta.max_query_len, meta.max_seq_len, scale, out)
        dec, pre = _split(meta)
        out = torch.empty_like(q) if out is None else out
        decode_attention(q[:d], kv_cache, dec["block_tables"], dec["seq_lens"], scale, dec["max_seq_len"],
                         out=out[:d], k_new=k[:d], v_new=v[:d], slot_mapping=dec["slot_mapping"], kv_scale=KV_SCALE)
        _chunks(q[d:], k[d:], v[d:], kv_cache, pre["block_tables"], pre["seq_lens"], pre["query_start_loc"],
                pre["slot_mapping"], meta.max_query_len, meta.max_seq_len, scale, out[d:])
        return out


def _chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, max_query_len: int,
            max_seq_len: int, scale: float, out: torch.Tensor | None) -> torch.Tensor:
    """Sequences of several new tokens each: their k/v into the cache and causal attention over it, on the
    split-context kernel (which writes the k/v too) where every sequence runs at most a few tokens
    (verification), else `write_kv` and the prefill kernel."""
    if _verify.applies(max_query_len, q.shape[1], kv_cache.shape[3]):  # it writes the step's k/v itself
        return _verify.verify_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                                        scale, out=out, kv_scale=KV_SCALE, k_new=k, v_new=v, slot_mapping=slot_mapping)
    write_kv(kv_cache, k, v, slot_mapping, KV_SCALE)
    return prefill_attention(q, k, v, kv_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, out=out,
                             kv_scale=KV_SCALE)


def _split(meta: AttentionMetadata) -> tuple[dict, dict]:
    """A mixed step's decode rows and prefill rows as each kernel takes them, sliced once per step (every
    layer reuses them: per layer, the slicing and the host max over the decodes cost more than a kernel)."""
    split = meta.derived.get("triton_split")
    if split is None:
        d = meta.num_decodes
        dec = {"block_tables": meta.block_tables[:d], "seq_lens": meta.seq_lens[:d], "slot_mapping": meta.slot_mapping[:d],
               "max_seq_len": max(meta.seq_lens_cpu[:d])}
        pre = {"block_tables": meta.block_tables[d:], "seq_lens": meta.seq_lens[d:], "slot_mapping": meta.slot_mapping[d:],
               "query_start_loc": meta.query_start_loc[d:] - d}
        split = meta.derived["triton_split"] = (dec, pre)
    return split
