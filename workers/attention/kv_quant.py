"""The FP8 KV cache's number format (`kv_cache_dtype="fp8"` / "fp8_e4m3").

The cache stores float8_e4m3fn values x / KV_SCALE, clamped to e4m3's largest finite value (a plain
cast would turn anything beyond +-448 into NaN); reads return value * KV_SCALE in the compute dtype.
One scale per tensor, 1.0 as vLLM uses for checkpoints without calibrated k/v scales: the attention
kernels take the scale as an argument, so calibrated per-layer scales need no kernel change.
"""
from __future__ import annotations

import torch

KV_SCALE = 1.0
FP8_MAX = 448.0
FP8_DTYPES = (torch.float8_e4m3fn,)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x (compute dtype) -> the cache's dtype."""
    if not is_fp8(cache_dtype):
        return x
    return (x.float() / KV_SCALE).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache values -> dtype (upcast and rescaled for an FP8 cache)."""
    if not is_fp8(x.dtype):
        return x
    return (x.float() * KV_SCALE).to(dtype) if KV_SCALE != 1.0 else x.to(dtype)
