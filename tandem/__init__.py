"""Tandem's top layer: the `tandem` command line and the user-facing Python API.

`from tandem import LLM, SamplingParams` is the offline engine; the names load on first use so that
`tandem --help` does not import torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "EngineArgs"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "LLMEngine", "RequestOutput"):
        import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from workers.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from workers.config import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
