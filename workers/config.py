"""One pydantic config tree for the engine, shared by the CLI, the Serve app args and `workers.LLM`.

Validation happens here, once: a bad value raises `ValueError` (pydantic's `ValidationError` is a
subclass) with the field's name, before any weights are touched.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from parallel.config import ParallelConfig

# The shipped tiny model: the default of every surface (CLI, Serve args, demo) when no model is given.
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "tandem-tiny")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Strict):
    """What to load and how to run it."""

    model: str = Field(description="Path to a Hugging Face model folder (config.json + safetensors).")
    tokenizer: str | None = Field(default=None, description="Tokenizer folder; defaults to `model`.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, gt=0, description="Prompt + output limit; defaults to the model's.")
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = Field(default=False, description="CUDA: no decode CUDA graphs (every step runs eagerly).")

    @model_validator(mode="after")
    def _model_exists(self) -> "ModelConfig":
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model: no config.json in {self.model!r}; pass a local Hugging Face model folder")
        return self

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available on this machine")
        return torch.device(self.device)

    def resolved_dtype(self, hf_config) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device().type == "cpu":
            return torch.float32  # bf16 matmuls on CPU are slow and change greedy tokens vs fp32 references
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        saved = DTYPES.get(str(saved).replace("torch.", ""), torch.bfloat16)
        return torch.bfloat16 if saved == torch.float32 else saved

    def hf_config_dict(self) -> dict:
        with open(os.path.join(self.model, "config.json")) as f:
            return json.load(f)


class CacheConfig(_Strict):
    """Paged KV cache: block size and how many blocks (from a memory budget, or given)."""

    block_size: int = Field(default=16, ge=1, le=1024)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    cpu_kv_cache_bytes: int = Field(default=1 << 30, gt=0, description="KV budget per rank on CPU.")
    num_blocks: int | None = Field(default=None, gt=0, description="Override the budget: exact block count.")
    kv_lease_seconds: float = Field(default=60.0, gt=0, description="Disaggregation: how long KV is held for / reserved "
                                    "awaiting the peer pool before it is freed.")
    kv_transfer_timeout_seconds: float = Field(default=60.0, gt=0, description="Disaggregation: the longest one KV "
                                               "handoff (pair-group set-up, or one request's send/receive) may take.")


class SchedulerConfig(_Strict):
    """Continuous batching limits. Prefill is chunked to fit `max_num_batched_tokens` per step."""

    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_waiting_requests: int | None = Field(default=None, ge=1, description="Queue bound; None = unbounded.")


class EngineConfig(_Strict):
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat, vLLM-style keyword arguments (`LLM(...)`, the CLI, the Serve args)."""
        sections = {"model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        grouped: dict[str, dict] = {name: {} for name in sections}
        for key, value in kwargs.items():
            owner = next((name for name, cfg in sections.items() if key in cfg.model_fields), None)
            if owner is None:
                raise ValueError(f"unknown engine argument {key!r}")
            if value is not None:
                grouped[owner][key] = value
        return cls(**{name: sections[name](**vals) for name, vals in grouped.items()})

    @staticmethod
    def flat_fields() -> list[str]:
        return [f for cfg in (ModelConfig, ParallelConfig, CacheConfig, SchedulerConfig) for f in cfg.model_fields]
