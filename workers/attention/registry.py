"""Choosing an attention backend by name ("auto" picks the fastest that works on the device)."""
from __future__ import annotations

import torch

from workers.attention.backend import AttentionBackend
from workers.attention.torch_backend import TorchAttention


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttention()
    if name in ("triton", "auto"):
        try:
            from workers.attention.triton_backend import TritonAttention
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"attention_backend='triton' is unavailable: {e}") from e
            return TorchAttention()
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}")
