"""The attention backend interface and the per-step metadata every backend reads."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch

if TYPE_CHECKING:
    from workers.attention.sp_backend import SPAttentionMetadata


@dataclass
class AttentionMetadata:
    """One step's batch, flattened: the new tokens of all sequences laid end to end.

    num_tokens T, num_seqs B. A sequence's new tokens are queries at positions
    [seq_len - query_len, seq_len); its keys are all seq_len cached positions (causal).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    query_lens_cpu: list[int]  # host copies, so backends need no device sync to loop or pad
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # The first num_decodes sequences have one new token each (the runner orders decodes first), so
    # a mixed step can run them with the decode kernel and only the rest with the prefill kernel.
    num_decodes: int = 0
    # Sequence parallelism only: what this rank holds of the step (the fields above cover its own tokens).
    sp: SPAttentionMetadata | None = None
    # What a backend derives from the fields above once per step and reuses in every layer.
    derived: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] (this layer's)
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, Hq, D] to write the result into (piecewise CUDA graphs' buffer)
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write k/v into kv_cache at meta.slot_mapping, then attend causally over each sequence's cache."""
        ...


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        yield
    finally:
        _CONTEXT = previous


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside a model-runner step (no forward_context)")
    return _CONTEXT
