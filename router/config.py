"""`AppConfig`: the served application's arguments (Serve `args`, the CLI and the Python API share it).

It extends the engine's config tree (`workers.config`) with what only a served system has: the
prefill and decode pools, API keys and a per-request timeout. The engine knobs reuse the engine's own
field definitions, so a limit is declared once and a bad value fails here with the argument's name.

The model folder is not required to exist here: Serve validates the args on the head node, which
often has no weights; the replicas that load the model check the folder (`engine_config`).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve.config import AutoscalingConfig

from parallel.config import ParallelConfig
from workers.config import DEFAULT_MODEL
from workers.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def _engine_field(section: type[BaseModel], name: str):
    """The engine's own field (default, bounds, description), so both configs stay in step."""
    return copy.deepcopy(section.model_fields[name])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class PoolConfig(_Strict):
    """One pool of engine replicas: its size (fixed or autoscaled) and each replica's rank grid."""

    num_replicas: int | None = Field(default=None, ge=1, description="Fixed replica count (default 1); "
                                     "leave unset when autoscaling_config is given.")
    # None = ParallelConfig's default, so that its rules apply as for an engine (expert_parallel_size
    # given alone implies the same tensor_parallel_size).
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    pipeline_parallel_size: int | None = Field(default=None, ge=1)
    expert_parallel_size: int | None = Field(default=None, ge=1)
    autoscaling_config: dict[str, Any] | None = Field(default=None, description="Ray Serve autoscaling_config "
                                                      "(min_replicas, max_replicas, target_ongoing_requests, ...).")
    ray_resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each rank of this "
                                            "pool needs besides its GPU, e.g. {tandem_decode_gpu: 1} to keep the pool "
                                            "on the worker group that provides them.")

    @field_validator("autoscaling_config")
    @classmethod
    def _valid_autoscaling(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        # Serve's model ignores unknown keys; a misspelt key would silently fall back to a default.
        unknown = sorted(set(v) - set(AutoscalingConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown autoscaling_config keys {unknown}; known: {sorted(AutoscalingConfig.model_fields)}")
        AutoscalingConfig(**v)  # Serve's own checks (min <= max, positive targets, ...)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "PoolConfig":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give either num_replicas or autoscaling_config, not both (Serve rejects the pair)")
        self.parallel  # noqa: B018 -- the rank grid's own rules (EP spans a stage, ...)
        return self

    @property
    def parallel(self) -> ParallelConfig:
        """This pool's rank grid per replica."""
        sizes = {name: getattr(self, name, None) for name in ParallelConfig.model_fields}
        return ParallelConfig(**{k: v for k, v in sizes.items() if v is not None})

    @field_validator("ray_resources")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: n for k, n in v.items() if n <= 0 or k in ("CPU", "GPU", "memory")}
        if bad:
            raise ValueError(f"ray_resources must be positive custom resources (not CPU/GPU/memory): {bad}")
        return v

    def serve_options(self) -> dict[str, Any]:
        """The replica-count options for `Deployment.options(...)`."""
        if self.autoscaling_config is not None:
            return {"autoscaling_config": dict(self.autoscaling_config)}
        return {"num_replicas": self.num_replicas or 1}


class PrefillPoolConfig(PoolConfig):
    # Ring attention (sequence parallelism) splits long prompts; decode has one token per step to split.
    sequence_parallel_size: int | None = Field(default=None, ge=1)


class DecodePoolConfig(PoolConfig):
    pass


# Engine arguments an AppConfig carries through to `EngineConfig.from_kwargs` unchanged.
ENGINE_FIELDS = (
    "tokenizer", "dtype", "device", "max_model_len", "load_format", "seed", "attention_backend",
    "block_size", "enable_prefix_caching", "gpu_memory_utilization", "cpu_kv_cache_bytes", "num_blocks", "kv_lease_seconds",
    "kv_transfer_timeout_seconds",
    "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
)


class AppConfig(_Strict):
    """Everything `router.app:build_app` needs, validated before any replica starts."""

    model: str = Field(default=DEFAULT_MODEL, description="Hugging Face model folder, on every node that runs a pool.")
    served_model_name: str | None = Field(default=None, description="The name clients pass as `model`; "
                                          "defaults to the model folder's name.")
    # ---- model (workers.config.ModelConfig)
    tokenizer: str | None = _engine_field(ModelConfig, "tokenizer")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = _engine_field(ModelConfig, "dtype")
    device: Literal["auto", "cpu", "cuda"] = _engine_field(ModelConfig, "device")
    max_model_len: int | None = _engine_field(ModelConfig, "max_model_len")
    load_format: Literal["auto", "safetensors", "dummy"] = _engine_field(ModelConfig, "load_format")
    seed: int = _engine_field(ModelConfig, "seed")
    attention_backend: Literal["auto", "torch", "triton"] = _engine_field(ModelConfig, "attention_backend")
    # ---- KV cache (CacheConfig)
    block_size: int = _engine_field(CacheConfig, "block_size")
    enable_prefix_caching: bool = _engine_field(CacheConfig, "enable_prefix_caching")
    gpu_memory_utilization: float = _engine_field(CacheConfig, "gpu_memory_utilization")
    cpu_kv_cache_bytes: int = _engine_field(CacheConfig, "cpu_kv_cache_bytes")
    num_blocks: int | None = _engine_field(CacheConfig, "num_blocks")
    kv_lease_seconds: float = _engine_field(CacheConfig, "kv_lease_seconds")
    kv_transfer_timeout_seconds: float = _engine_field(CacheConfig, "kv_transfer_timeout_seconds")
    # ---- batching and queues (SchedulerConfig)
    max_num_seqs: int = _engine_field(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = _engine_field(SchedulerConfig, "max_num_batched_tokens")
    max_waiting_requests: int | None = _engine_field(SchedulerConfig, "max_waiting_requests")
    # ---- the served system
    prefill: PrefillPoolConfig = Field(default_factory=PrefillPoolConfig)
    decode: DecodePoolConfig = Field(default_factory=DecodePoolConfig)
    colocated: bool = Field(default=False, description="One engine per replica does prefill and decode (no KV "
                            "handoff); it takes the decode pool's size and layout.")
    api_keys: list[str] = Field(default_factory=list, description="Accepted `Authorization: Bearer` keys; empty = no auth.")
    api_keys_env: str | None = Field(default=None, description="Environment variable with more comma-separated keys, "
                                     "read on the replica (keeps secrets out of the config).")
    request_timeout_s: float | None = Field(default=None, gt=0, description="Whole-request limit; past it: 504 / "
                                            "DEADLINE_EXCEEDED and the request is aborted.")

    @field_validator("api_keys")
    @classmethod
    def _non_empty_keys(cls, v: list[str]) -> list[str]:
        if any(not k.strip() for k in v):
            raise ValueError("api_keys must not contain empty keys")
        return v

    @model_validator(mode="after")
    def _defaults(self) -> "AppConfig":
        if self.served_model_name is None:
            # Bypass validate_assignment (which would re-enter this validator).
            object.__setattr__(self, "served_model_name", Path(self.model.rstrip("/")).name)
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ENGINE_FIELDS}

    def engine_config(self, pool: Literal["prefill", "decode"]) -> EngineConfig:
        """The EngineConfig of one replica of `pool` (checks that the model folder exists on this node)."""
        if pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be 'prefill' or 'decode', not {pool!r}")
        parallel = (self.prefill if pool == "prefill" else self.decode).parallel
        return EngineConfig.from_kwargs(model=self.model, **self.engine_kwargs(), **parallel.model_dump())

    def resolved_api_keys(self) -> frozenset[str]:
        keys = set(self.api_keys)
        if self.api_keys_env:
            keys.update(k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip())
        return frozenset(keys)
