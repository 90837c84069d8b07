"""Attention over the paged KV cache, behind one small interface (`AttentionBackend`).

The model runner builds an `AttentionMetadata` once per step and publishes it with
`forward_context(...)`; each attention layer reads it from there, so model code stays free of
batching details.
"""
from workers.attention.backend import AttentionBackend, AttentionMetadata, forward_context, get_forward_context
from workers.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "forward_context", "get_forward_context", "get_backend"]
