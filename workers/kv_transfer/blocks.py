"""Gather KV blocks into one contiguous buffer per transfer (not one message per block), and back.

Buffers travel in the cache's *wire dtype*: the cache's own dtype, except that a one-byte float cache
(an FP8 KV cache, `kv_cache_dtype="fp8"`) moves as uint8 bytes. The bytes are the same, so an FP8
handoff moves half the bytes of a 16-bit one, bit for bit; but CPU `index_copy_` has no Float8 kernel,
and a plain byte buffer is something every backend sends (gloo, NCCL) whatever its float8 support.

On a GPU a transfer of whole heads (a block's row is then one contiguous run of the cache) is copied by the Triton
row copy (parallel/kernels/block_copy.py); a head slice (a resharded handoff) and CPUs use PyTorch's index ops.
"""
from __future__ import annotations

from typing import Callable

import torch


def wire_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of cache_dtype is gathered, sent and scattered in."""
    return torch.uint8 if cache_dtype.is_floating_point and cache_dtype.itemsize == 1 else cache_dtype


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    """t viewed in its wire dtype (no copy; a view, so writes land in t)."""
    wire = wire_dtype(t.dtype)
    return t if wire == t.dtype else t.view(wire)


# The gather and scatter move whole 8-byte words where a row allows it: PyTorch's index kernels copy one
# element per thread, so a bf16 cache copied as bf16 moves 2 bytes per thread and runs at a fraction of the
# memory bandwidth (1.2 TB/s of traffic on an H100 for a 32K-token handoff). The bytes are the same either way.
_WIDE = torch.int64


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """t (wire dtype) viewed as 8-byte words along its last dim where that dim's bytes allow (no copy), else t."""
    if t.dtype.itemsize < _WIDE.itemsize and t.stride(-1) == 1 and (t.shape[-1] * t.dtype.itemsize) % _WIDE.itemsize == 0 \
            and (t.storage_offset() * t.dtype.itemsize) % _WIDE.itemsize == 0:
        return t.view(_WIDE)
    return t


def block_index(block_ids: list[int], device: torch.device | str) -> torch.Tensor:
    """block_ids as the index tensor gather_blocks / scatter_blocks take (made once per transfer, not per message).
    A plain copy from pageable memory: beside an engine thread, it was the faster of the two kinds of small
    host-to-device copy (scripts/bench_cuda_stall.py); a pinned one waited for a `.tolist()` there."""
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int], layers: slice, heads: slice,
                  index: torch.Tensor | None = None, programs: int | None = None) -> torch.Tensor:
    """kv_cache [L, 2, num_blocks, block_size, H, D] -> contiguous [l, 2, n, block_size, h, D], in the wire dtype.
    index: block_index(block_ids) if the caller has it already; programs: the GPU row copy's grid cap (None: the
    module default, `block_copy.MAX_PROGRAMS`; 0: none)."""
    if index is None:
        index = block_index(block_ids, kv_cache.device)
    wire = _as_wire(kv_cache)
    words = _as_words(wire[layers])
    if _by_rows(words, heads):
        from parallel.kernels.block_copy import copy_rows  # Triton: imported on GPUs only

        out = torch.empty(words.shape[:2] + (index.numel(),) + words.shape[3:], dtype=words.dtype, device=words.device)
        copy_rows(words, out, index, gather=True, programs=programs)
        return out.view(wire.dtype)
    return words.index_select(2, index)[..., heads, :].contiguous().view(wire.dtype)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], layers: slice, heads: slice, buf: torch.Tensor,
                   index: torch.Tensor | None = None, programs: int | None = None) -> None:
    """Inverse of gather_blocks: write buf [l, 2, n, block_size, h, D] (wire dtype) into the given blocks."""
    wire = wire_dtype(kv_cache.dtype)
    if buf.dtype != wire:
        # Converting would write different numbers than the prefill side computed (or reinterpret bytes):
        # both pools must share kv_cache_dtype (router/config.py SHARED_ONLY).
        raise ValueError(f"KV buffer is {buf.dtype}, but a {kv_cache.dtype} cache takes {wire} buffers")
    if index is None:
        index = block_index(block_ids, kv_cache.device)
    target = _as_wire(kv_cache)[layers]  # a view: writes land in the cache
    if _all_heads(heads, target.shape[4]):
        words = _as_words(target)
        src = buf.view(words.dtype) if words.dtype != buf.dtype else buf
        if _by_rows(words, heads) and _by_rows(src, heads):
            from parallel.kernels.block_copy import copy_rows  # Triton: imported on GPUs only

            copy_rows(src, words, index, gather=False, programs=programs)
        else:
            words.index_copy_(2, index, src)
    else:
        # Partial heads: index_copy_ cannot take a head slice, so copy block by block into the view.
        for i, b in enumerate(block_ids):
            target[:, :, b, :, heads, :].copy_(buf[:, :, i])


class CacheBlocks:
    """gather_blocks / scatter_blocks on one cache, for an agent that moves its blocks many times: the cache's wire and
    word views and whether the GPU row copy takes its whole-head transfers are worked out once, and a transfer of
    every layer copies from the whole view (no slice): a few view ops fewer a copy. A 1K-token handoff waits for the
    host's work before the sender's one message can start (docs/benchmarks.md, issue 27). With this and the receiver
    posting before it builds its index, one 2 x H100 call measured 0.77 ms against the code before's 1.00 (raw 0.41,
    same call); the next call did not repeat it (0.93-0.97 against 0.84, raw 0.47 / 0.42): the 1K figure swings more
    from call to call than such changes move it."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.wire = _as_wire(kv_cache)
        self.words = _as_words(self.wire)
        self.num_layers, self.num_heads = kv_cache.shape[0], kv_cache.shape[4]
        # Whether whole-head transfers go by the Triton row copy (else both directions call the functions above).
        self.rows = _by_rows(self.words, slice(None)) if self.words.dim() == 6 and self.num_layers else False

    def _layer_words(self, layers: slice) -> torch.Tensor:
        whole = layers.start in (0, None) and layers.stop in (None, self.num_layers) and layers.step in (None, 1)
        return self.words if whole else self.words[layers]

    def gather(self, block_ids: list[int], layers: slice, heads: slice, index: torch.Tensor,
               programs: int | None = None) -> torch.Tensor:
        """gather_blocks(self.kv_cache, block_ids, layers, heads, index, programs)."""
        if not (self.rows and _all_heads(heads, self.num_heads)):
            return gather_blocks(self.kv_cache, block_ids, layers, heads, index, programs)
        from parallel.kernels.block_copy import copy_rows

        words = self._layer_words(layers)
        out = torch.empty(words.shape[:2] + (index.numel(),) + words.shape[3:], dtype=words.dtype, device=words.device)
        copy_rows(words, out, index, gather=True, programs=programs)
        return out if out.dtype == self.wire.dtype else out.view(self.wire.dtype)

    def scatter(self, block_ids: list[int], layers: slice, heads: slice, buf: torch.Tensor, index: torch.Tensor,
                programs: int | None = None) -> None:
        """scatter_blocks(self.kv_cache, block_ids, layers, heads, buf, index, programs)."""
        if not (self.rows and _all_heads(heads, self.num_heads) and buf.dtype == self.wire.dtype and buf.is_contiguous()):
            scatter_blocks(self.kv_cache, block_ids, layers, heads, buf, index, programs)
            return
        from parallel.kernels.block_copy import copy_rows

        words = self._layer_words(layers)
        copy_rows(buf if buf.dtype == words.dtype else buf.view(words.dtype), words, index, gather=False, programs=programs)


    def all_heads(self, heads: slice) -> bool:
        """Whether heads is every head of the cache (the row copy's case)."""
        return _all_heads(heads, self.num_heads)

    def prepare(self, layers: slice, buf: torch.Tensor, index: torch.Tensor, gather: bool,
                programs: int | None = None) -> Callable[[], None]:
        """The row copy between these layers (every head) and buf, kept by the caller with index, planned once
        (`block_copy.prepare_copy`): gather (cache -> buf) or scatter (buf -> cache). Only where `rows` holds."""
        from parallel.kernels.block_copy import prepare_copy

        words = self._layer_words(layers)
        other = buf if buf.dtype == words.dtype else buf.view(words.dtype)
        return prepare_copy(words, other, index, True, programs) if gather else prepare_copy(other, words, index, False, programs)


def _all_heads(heads: slice, num_heads: int) -> bool:
    return heads.start in (0, None) and heads.stop in (None, num_heads) and heads.step in (None, 1)


def _by_rows(words: torch.Tensor, heads: slice) -> bool:
    """Whether the Triton row copy takes this transfer: on a GPU, every head (a block's row is then one contiguous
    run of the cache). Elsewhere, and for a head slice (a resharded handoff), PyTorch's index ops."""
    if not (words.is_cuda and _all_heads(heads, words.shape[4])):
        return False
    from parallel.kernels.block_copy import rows_contiguous

    return rows_contiguous(words)


def warm_kernels(kv_cache: torch.Tensor) -> None:
    """On a GPU, compile the row copy's kernels for this cache's words before a handoff needs them: at set-up
    (`KVTransferAgent.__init__`), so not by the compile watch's count; on 2 x H100 a pair's first join compiled
    them while its replicas served (0.07-0.17 s)."""
    if kv_cache.is_cuda:
        from parallel.kernels import compile_watch
        from parallel.kernels.block_copy import warm_up

        with compile_watch.paused():
            warm_up(kv_cache.device, _as_words(_as_wire(kv_cache)).dtype)


def transfer_shape(kv_cache: torch.Tensor, num_blocks: int, layers: slice, heads: slice) -> tuple[int, ...]:
    l = len(range(*layers.indices(kv_cache.shape[0])))
    h = len(range(*heads.indices(kv_cache.shape[4])))
    return (l, 2, num_blocks, kv_cache.shape[3], h, kv_cache.shape[5])
