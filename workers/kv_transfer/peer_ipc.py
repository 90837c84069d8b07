"""The same-node KV handoff: the decode rank copies the blocks straight out of the prefill rank's cache.

Over NCCL a handoff is three passes over the bytes: the sender gathers the blocks into a buffer, NCCL moves the buffer,
the receiver scatters it into its blocks. At 1K tokens of Llama-3.1-8B (128 MiB) the gather and scatter, and the host
calls around them, took ~0.35 ms beside NCCL's 0.48 on 2 x H200 (docs/benchmarks.md). Where both GPUs sit in one node
and each decode rank can map each prefill rank's cache (CUDA IPC: the process sees the prefill rank's GPU, and the two
GPUs have peer access, as over NVLink), one kernel on the decode GPU reads each listed block of the prefill cache and
writes it into its own block (`block_copy.copy_blocks`): no buffer and one pass.

Per transfer, on the first group of the pair, in the transfers' posting order:
  1. the prefill rank sends the blocks' ids in its cache (a small int64 GPU tensor). It is sent on the agent's stream,
     so it goes out only after what that stream waits for (a piece's prefill chunk): the decode side's copy, queued
     behind the receive on its own stream, never reads a block before it is written;
  2. the decode rank copies, waits for the copy, and sends a one-byte ack;
  3. the prefill rank's send ends with the ack: only then may its blocks be freed.
The pair decides at `join` (`PeerCaches.join`): each prefill rank publishes an IPC handle of its cache in the pair's
store, each decode rank maps them all and publishes whether it could; the pair copies so only if every decode rank
could. A transfer takes the copy where both ranks hold the same KV heads (`whole_heads`); a resharded one (a head
slice) keeps NCCL. TANDEM_KV_PEER_IPC=0 (or `KVTransferAgent.peer_ipc = False`, on both sides) keeps NCCL for all.

Who can map: a process that sees the other GPU. Ray rank actors of a TP group see their node's GPUs
(cluster/ray_runtime.py); a one-GPU pool replica on the in-process executor sees only its own GPU, so its pairs keep
NCCL (the join logs which).
"""
from __future__ import annotations

import logging
import os
import pickle

import torch

from workers.kv_transfer.blocks import _as_wire, _as_words
from workers.kv_transfer.plan import RankShard, Transfer

log = logging.getLogger(__name__)


def peer_ipc_enabled() -> bool:
    """TANDEM_KV_PEER_IPC: on unless it says 0. Read by each agent (both sides of a pair must agree) and by the driver
    that starts the rank actors (they see their node's GPUs for it), which forwards it to them."""
    return os.environ.get("TANDEM_KV_PEER_IPC", "1") != "0"


def whole_heads(t: Transfer, src: RankShard, dst: RankShard) -> bool:
    """Whether transfer t moves every KV head either rank holds, both holding the same: each block row is then one
    contiguous run on both sides, which `copy_blocks` takes. Both ranks of t compute the same."""
    return src.heads == dst.heads and range(t.heads.start, t.heads.stop) == src.heads


class PeerCaches:
    """A rank's side of the pairs' peer copies: on a decode rank, the prefill caches it mapped (word views); on both,
    whether each pair copies so (`join`)."""

    def __init__(self) -> None:
        self.words: dict[tuple[str, int], torch.Tensor] = {}  # (pair, prefill rank) -> its cache's words, mapped
        self.pairs: dict[str, bool] = {}  # pair id -> every decode rank mapped every prefill rank's cache

    def join(self, store, pair_id: str, role: str, rank: int, num_prefill: int, num_decode: int,
             kv_cache: torch.Tensor, on: bool) -> bool:
        """Every rank of a GPU pair calls this at `join` (store: the pair's prefixed store): the prefill ranks publish
        their handles (empty where `on` is False), the decode ranks map them and publish whether they could; all
        then read the decode ranks' answers. Returns (and keeps) whether the pair copies so."""
        if role == "prefill":
            store.set(f"peer/{rank}", self._export(pair_id, kv_cache) if on else b"")
        else:
            mapped = self._map(store, pair_id, num_prefill, kv_cache, on)
            store.set(f"peer_ok/{rank}", b"1" if mapped else b"0")
        agreed = all(store.get(f"peer_ok/{d}") == b"1" for d in range(num_decode))
        self.pairs[pair_id] = agreed
        log.info("KV pair %s: %s", pair_id, "decode ranks copy from the mapped prefill caches (peer IPC)" if agreed
                 else "NCCL messages (a decode rank could not map a prefill cache, or peer IPC is off)")
        return agreed

    @staticmethod
    def _export(pair_id: str, kv_cache: torch.Tensor) -> bytes:
        """This prefill rank's handle, or b"" (the pair keeps NCCL) where the cache cannot be shared: an allocator
        whose segments torch cannot export this way (PYTORCH_CUDA_ALLOC_CONF's expandable segments, say)."""
        try:
            return export_cache(kv_cache)
        except Exception as e:  # noqa: BLE001 - the pair keeps NCCL
            log.info("KV pair %s: this prefill rank's cache cannot be shared by CUDA IPC: %s: %s", pair_id,
                     type(e).__name__, e)
            return b""

    def _map(self, store, pair_id: str, num_prefill: int, kv_cache: torch.Tensor, on: bool) -> bool:
        """Map every prefill rank's cache into this decode rank (`words`); False at the first that cannot be."""
        for r in range(num_prefill):
            handle = store.get(f"peer/{r}")
            if not (on and handle):
                return False
            try:
                cache = import_cache(handle, kv_cache.device)
                if cache.dtype != kv_cache.dtype or cache.shape[3:] != kv_cache.shape[3:]:
                    log.info("KV pair %s: prefill rank %d's cache %s %s does not match this one's rows", pair_id, r,
                             cache.dtype, tuple(cache.shape))
                    return False
                words = _as_words(_as_wire(cache))
                _touch(words)  # and the IPC event's wait (on this stream) is over before any copy reads the cache
            except Exception as e:  # noqa: BLE001 - GPU not visible here, no peer access, ...: the pair keeps NCCL
                log.info("KV pair %s: prefill rank %d's cache cannot be mapped here: %s: %s", pair_id, r, type(e).__name__, e)
                return False
            self.words[(pair_id, r)] = words
        return True

    def on(self, pair_id: str) -> bool:
        return self.pairs.get(pair_id, False)

    def drop(self, pair_id: str) -> None:
        self.pairs.pop(pair_id, None)
        for key in [k for k in self.words if k[0] == pair_id]:
            del self.words[key]


def _touch(words: torch.Tensor) -> None:
    """Copy one row out of a freshly mapped cache, at join, and wait for it: a mapping this GPU cannot read fails here
    (the pair keeps NCCL) rather than in a handoff, and the IPC event's wait is over before any copy reads the cache.
    (It was also meant to take the first handoff's 86-105 ms away; it did not: that was the first ack's NCCL
    connection, which `KVTransferAgent.warm` now makes. docs/benchmarks.md, twenty-second session.)"""
    from parallel.kernels.block_copy import copy_blocks

    if words.shape[0] and words.shape[2]:
        scratch = torch.empty((1, 2, 1) + tuple(words.shape[3:]), dtype=words.dtype, device=words.device)
        first = torch.zeros(1, dtype=torch.long, device=words.device)
        copy_blocks(words[:1], scratch, first, first)
    torch.cuda.current_stream().synchronize()


def export_cache(kv_cache: torch.Tensor) -> bytes:
    """A CUDA IPC handle of the whole cache (torch's own tensor sharing)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(kv_cache)
    return pickle.dumps(args)


def import_cache(handle: bytes, device: torch.device) -> torch.Tensor:
    """The exporting rank's cache, mapped into this process on `device` (this rank's own GPU): CUDA maps another
    process's allocation into the current device's context, enabling peer access where the allocation lives on
    another GPU. The handle's device index is the exporter's numbering; this process may number GPUs differently
    (CUDA_VISIBLE_DEVICES), and the mapping is made from our own device anyway, so it is replaced by ours."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(handle))
    args[6] = device.index if device.index is not None else torch.cuda.current_device()  # storage_device
    return rebuild_cuda_tensor(*args)
