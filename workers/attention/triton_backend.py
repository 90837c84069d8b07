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

import os

import torch

from workers.attention.backend import AttentionMetadata
from workers.attention.kv_quant import KV_SCALE
from parallel.kernels.paged_attention import decode_attention, prefill_attention, write_kv
from parallel.kernels import verify_attention as _verify
from parallel.kernels.direct_launch import Recorded, record_launches


# "0": every layer launches its kernels through Triton's JIT path (`LayerRepeat` off), for comparison.
REPEAT_ENV = "TANDEM_ATTN_REPEAT"


def _on_gpu(q: torch.Tensor) -> bool:
    return q.is_cuda


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        self.repeat = os.environ.get(REPEAT_ENV, "1") != "0"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Where every layer of a step hands in the same q/k/v/out buffers (piecewise CUDA graphs), the first
        layer's launches are recorded and the others repeat them with their own KV cache (`LayerRepeat`)."""
        if out is None or not self.repeat or not _on_gpu(q):
            return self._forward(q, k, v, kv_cache, meta, scale, out)
        repeat = meta.derived.get("triton_repeat")
        if repeat is not None:
            if repeat and repeat.fits(q, k, v, out, kv_cache, scale):
                repeat.launch(kv_cache)
                return out
            return self._forward(q, k, v, kv_cache, meta, scale, out)
        if _capturing():  # a capture keeps its own launches
            return self._forward(q, k, v, kv_cache, meta, scale, out)
        with record_launches() as launches:
            result = self._forward(q, k, v, kv_cache, meta, scale, out)
        meta.derived["triton_repeat"] = LayerRepeat.of(launches, q, k, v, out, kv_cache, scale) or False
        return result

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor | None) -> torch.Tensor:
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


class LayerRepeat:
    """One step's attention launches as its first layer made them, repeated by every later layer with only the KV
    cache swapped. In a mixed step each layer's attention costs the host ~100-200 us of launch work (the JIT's
    argument binding, specialisation and cache lookup per kernel, TMA descriptors, split sizes), 32 times a step, and
    under TP the host, not the GPU, bounds the step (docs/benchmarks.md, issue 26). Sound where the launches differ
    only in the cache: the same q/k/v/out tensors (the piecewise graphs' shared buffers), scale, and a cache of the
    same shape, strides, dtype and 16-byte alignment (every layer's is a slice of one tensor), so each launch's
    compiled kernel is the one the JIT would pick. Scratch buffers (the decode splits' partial results) are reused:
    the layers run in stream order."""

    def __init__(self, launches: list[Recorded], q, k, v, out, kv_cache: torch.Tensor, scale: float):
        self.launches, self.q, self.k, self.v, self.out, self.scale = launches, q, k, v, out, scale
        self.shape, self.stride, self.dtype = kv_cache.shape, kv_cache.stride(), kv_cache.dtype
        self.align = kv_cache.data_ptr() % 16

    @classmethod
    def of(cls, launches: list[Recorded | None], q, k, v, out, kv_cache: torch.Tensor, scale: float) -> "LayerRepeat | None":
        """The record of one layer's launches, or None where one cannot be repeated: a launch not through its
        handle, or an argument inside the KV cache other than its K or V half."""
        if not launches or any(r is None for r in launches):
            return None
        halves = [kv_cache[0].data_ptr(), kv_cache[1].data_ptr()]
        start, end = kv_cache.data_ptr(), kv_cache.data_ptr() + kv_cache.numel() * kv_cache.element_size()
        for r in launches:
            for i, a in enumerate(r.args):
                if not isinstance(a, torch.Tensor) or not start <= a.data_ptr() < end:
                    continue
                if a.data_ptr() not in halves or a.shape != kv_cache.shape[1:]:
                    return None
                r.swaps.append((i, halves.index(a.data_ptr())))
        return cls(launches, q, k, v, out, kv_cache, scale)

    def fits(self, q, k, v, out, kv_cache: torch.Tensor, scale: float) -> bool:
        return (q is self.q and k is self.k and v is self.v and out is self.out and scale == self.scale
                and kv_cache.shape == self.shape and kv_cache.stride() == self.stride and kv_cache.dtype == self.dtype
                and kv_cache.data_ptr() % 16 == self.align)

    repeated = 0  # layers launched by repeating, in this process (tests, diagnostics)

    def launch(self, kv_cache: torch.Tensor) -> None:
        LayerRepeat.repeated += 1
        halves = kv_cache.unbind(0)
        for r in self.launches:
            r.launch(halves)
