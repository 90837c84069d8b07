"""The engine's config, declared once and used by every surface.

`EngineConfig` is the tree the engine reads (model, parallel, cache, scheduler sections).
`EngineArgs` is the same fields flattened, with vLLM's names: `LLM(**kwargs)`, the served app's
config (router/config.py subclasses it) and every `tandem` CLI flag (tandem/flags.py) are generated
from it, so an argument has one name, one default and one validation everywhere.

Validation happens here, once: a bad value raises `ValueError` (pydantic's `ValidationError` is a
subclass) with the field's name, before any weights are touched.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, create_model, field_validator, model_validator

from parallel.config import ParallelConfig, StrictModel
from parallel.quant.config import effective_quant_config
from workers.hub import resolve_model_path
from workers.spec_decode.config import SpeculativeConfig, parse_speculative_config

# The shipped tiny model: the default of every surface (CLI, Serve args, demo) when no model is given.
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "tandem-tiny")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelConfig(StrictModel):
    """What to load and how to run it."""

    model: str = Field(description="A Hugging Face model folder (config.json + safetensors), or a Hugging Face model "
                       "ID (owner/name), resolved through the Hugging Face cache and downloaded there if missing.")
    revision: str | None = Field(default=None, description="Branch, tag or commit of a Hugging Face model ID "
                                 "(default: main).")
    tokenizer: str | None = Field(default=None, description="Tokenizer folder or model ID; defaults to `model`.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(default="auto", description="auto: float32 on "
                                                                     "CPU, the checkpoint's half type on GPU.")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available.")
    max_model_len: int | None = Field(default=None, gt=0, description="Prompt + output limit; defaults to the model's.")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(default="auto", description="dummy: random weights "
                                                                 "of the real shapes (benchmarks).")
    seed: int = Field(default=0, description="Seed of the sampler and of dummy weights.")
    attention_backend: Literal["auto", "torch", "triton"] = Field(default="auto", description="auto: triton on "
                                                                  "GPU, torch (the reference) on CPU.")
    enforce_eager: bool = Field(default=False, description="CUDA: no CUDA graphs (every step runs eagerly).")
    cuda_graph_max_tokens: int = Field(default=2048, ge=0, description="CUDA: steps of up to this many tokens that "
                                       "decode graphs do not take (prefill chunks, mixed batches) replay piecewise "
                                       "CUDA graphs, attention alone running eagerly; 0 turns them off. The graphs "
                                       "hold the activations of a step this size.")
    generation_config: Literal["auto", "vllm"] = Field(default="auto", description="auto: the model's "
                                                       "generation_config.json supplies the temperature, top_p, top_k, "
                                                       "min_p, repetition_penalty and max_tokens (max_new_tokens) of "
                                                       "requests that leave them unset (as vLLM); vllm: the built-in "
                                                       "defaults.")
    quantization: Literal["auto", "gptq", "awq", "fp8"] | None = Field(default=None, description="Weight quantization. "
                                                                       "auto/unset: config.json's quantization_config "
                                                                       "decides; a method given must match it, except "
                                                                       "fp8 on an unquantized checkpoint (quantized at "
                                                                       "load: per-channel weights, dynamic per-token "
                                                                       "activations) and gptq/awq with load_format dummy "
                                                                       "(random weights, 4-bit RTN at load).")

    @model_validator(mode="after")
    def _model_exists(self) -> "ModelConfig":
        # A model ID becomes its folder in the Hugging Face cache (workers/hub.py): everything downstream,
        # rank processes included, reads a folder. The revision is kept for what it says.
        name = self.model
        object.__setattr__(self, "model", resolve_model_path(name, self.revision))
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", resolve_model_path(self.tokenizer))
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model: no config.json in {self.model!r}; pass a Hugging Face model folder or model ID")
        self._check_quantization()
        return self

    def _check_quantization(self) -> None:
        """The checkpoint's quantization_config is validated here, before any weights are touched; a
        method named by `quantization` must be the checkpoint's, or quantize an unquantized one at load
        (fp8; gptq/awq on dummy weights)."""
        self.quantization_config()

    def quantization_config(self) -> dict | None:
        """The quantization_config the model is built with (parallel/quant/config.py)."""
        cfg = self.hf_config_dict()
        heads = cfg.get("num_attention_heads", 1) * (cfg.get("head_dim") or cfg.get("hidden_size", 0) // cfg.get("num_attention_heads", 1))
        in_features = tuple(n for n in (cfg.get("hidden_size"), cfg.get("intermediate_size"), heads) if isinstance(n, int) and n > 0)
        return effective_quant_config(cfg.get("quantization_config"), self.quantization, self.load_format, in_features)

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


class CacheConfig(StrictModel):
    """Paged KV cache: block size and how many blocks (from a memory budget, or given)."""

    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV block.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(default="auto", description="auto: the model dtype; "
                                                               "fp8/fp8_e4m3: the cache stores float8_e4m3fn (scale 1.0 "
                                                               "per tensor, values clamped to +-448), half the bytes "
                                                               "per block, so twice the blocks in the same memory; "
                                                               "attention upcasts what it reads.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse the KV of a shared prompt prefix.")
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0, description="Share of GPU memory for "
                                          "weights, activations and the KV cache.")
    cpu_kv_cache_bytes: int = Field(default=1 << 30, gt=0, description="KV budget per rank on CPU, in bytes.")
    num_gpu_blocks_override: int | None = Field(default=None, gt=0, description="Exact KV block count per rank, "
                                                "instead of the memory budget (on CPU too).")
    kv_lease_seconds: float = Field(default=60.0, gt=0, description="Disaggregation: how long KV is held for / reserved "
                                    "awaiting the peer pool before it is freed.")
    kv_transfer_timeout_seconds: float = Field(default=60.0, gt=0, description="Disaggregation: the longest one KV "
                                               "handoff (pair-group set-up, or one request's send/receive) may take.")


class SchedulerConfig(StrictModel):
    """Continuous batching limits. Prefill is chunked to fit `max_num_batched_tokens` per step."""

    max_num_seqs: int = Field(default=256, ge=1, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="Most tokens in one step; prefill is "
                                        "chunked to fit.")
    max_waiting_requests: int | None = Field(default=None, ge=1, description="Hard ceiling: most requests waiting "
                                             "ahead of a new one (same or more important priority); more: refused (429 "
                                             "when served). Unset: unbounded offline, 4 x max_num_seqs when served.")
    max_waiting_kv_ratio: float | None = Field(default=None, gt=0, description="Refuse a new request (429 when "
                                               "served) when its prompt and those waiting ahead of it need more than "
                                               "this fraction of the KV cache's blocks. Unset: no check offline, 1.0 "
                                               "when served.")
    max_queue_delay_s: float | None = Field(default=None, gt=0, description="Target queueing delay: refuse a new "
                                            "request (429 when served) while one ahead of it (same or more important "
                                            "priority) has waited this long for admission, or when the requests ahead "
                                            "would take longer than this to start at the rate the backlogged queue "
                                            "recently drained. Unset: no check offline, 5 when served.")
    async_scheduling: bool = Field(default=True, description="With rank actors (TP/PP/EP, or "
                                   "distributed_executor_backend='ray'), and in-process on a GPU: plan and send step "
                                   "n+1 while the ranks compute step n. Speculative decoding, structured output, "
                                   "penalties and SP steps still run one at a time.")
    pipeline_step_overlap: bool = Field(default=True, description="PP > 1: the running sequences form PP groups, "
                                        "one step of each in flight at once (vLLM's virtual engines); max_num_seqs "
                                        "and max_num_batched_tokens bound each group's step. False: one step at a "
                                        "time, in micro-batches. Off with speculative decoding or SP.")


class SpeculativeSection(StrictModel):
    """Speculative decoding (workers/spec_decode): off unless `speculative_config` is given."""

    speculative_config: dict[str, Any] | None = Field(default=None, description="Speculative decoding, as vLLM: "
                                                      '{"method": "ngram", "num_speculative_tokens": 4, '
                                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or '
                                                      '{"model": "<draft folder>", "num_speculative_tokens": 4}; '
                                                      "see docs/speculative_decoding.md.")

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parsed(cls, v: Any) -> Any:
        spec = parse_speculative_config(v)  # ValueError naming the problem (unknown method, k < 1, ...)
        return None if spec is None else spec.model_dump(exclude_defaults=True)

    @property
    def spec(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)


SECTIONS: dict[str, type[StrictModel]] = {
    "model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "speculative": SpeculativeSection}


class EngineConfig(StrictModel):
    """The engine's config tree; build it from flat arguments with `from_kwargs` or `EngineArgs`."""

    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeSection = SpeculativeSection()

    @model_validator(mode="after")
    def _draft_matches_target(self) -> "EngineConfig":
        spec = self.speculative.spec
        if spec is not None:
            spec.check_against_target(self.model.model)
        return self

    @property
    def step_groups(self) -> int:
        """How many groups of sequences have a step in flight at once: the pipeline's stage count where
        `pipeline_step_overlap` applies, else 1. The engine and every rank read it (the ranks run such a step
        whole, not cut into micro-batches), so both sides agree from the same config. Speculative decoding plans
        its drafts over the whole batch; PP with SP keeps the micro-batch path (no test runs SP with pipelined
        steps)."""
        par = self.parallel
        pp = par.pipeline_parallel_size
        pipelined = self.scheduler.pipeline_step_overlap and self.speculative.spec is None and par.sequence_parallel_size == 1
        return pp if pp > 1 and pipelined else 1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat, vLLM-style keyword arguments; None means "the default"."""
        grouped: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in kwargs.items():
            owner = next((name for name, cfg in SECTIONS.items() if key in cfg.model_fields), None)
            if owner is None:
                raise ValueError(unknown_argument_message(key))
            if value is not None:
                grouped[owner][key] = value
        return cls(**{name: SECTIONS[name](**vals) for name, vals in grouped.items()})


def unknown_argument_message(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(EngineArgs.model_fields), n=1)
    return f"unknown engine argument {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")


class _EngineArgsBase(StrictModel):
    """Methods of `EngineArgs`; its fields are generated below from the sections."""

    def given(self) -> dict[str, Any]:
        """The arguments set explicitly, so that the sections' own defaults and rules apply to the rest
        (e.g. expert_parallel_size given alone implies the same tensor_parallel_size)."""
        return {name: getattr(self, name) for name in self.model_fields_set if name in ENGINE_FIELDS}

    def parallel_config(self) -> ParallelConfig:
        given = self.given()
        return ParallelConfig(**{k: v for k, v in given.items() if k in ParallelConfig.model_fields})

    def engine_config(self) -> EngineConfig:
        """The engine's tree; checks the model folder exists on this node."""
        return EngineConfig.from_kwargs(**{"model": self.model, **self.given()})

    @model_validator(mode="after")
    def _valid_rank_grid(self) -> "_EngineArgsBase":
        self.parallel_config()  # the grid's own rules (EP spans a stage, ...) without loading anything
        parse_speculative_config(getattr(self, "speculative_config", None))  # its keys; the draft folder loads later
        return self


def _flat_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for section in SECTIONS.values():
        for name, info in section.model_fields.items():
            info = copy.deepcopy(info)
            if name == "model":  # every surface defaults to the shipped tiny model
                info.default = DEFAULT_MODEL
            fields[name] = (info.annotation, info)
    return fields


# The flat engine arguments. The model folder is not checked here (a Serve head node validating the
# app's args often has no weights); `engine_config()` checks it where the model loads.
EngineArgs = create_model("EngineArgs", __base__=_EngineArgsBase, __module__=__name__, **_flat_fields())
EngineArgs.__doc__ = "Every engine argument, flat, with vLLM's names: `LLM(**kwargs)`, the served config, the CLI."
ENGINE_FIELDS: tuple[str, ...] = tuple(_flat_fields())
