"""`speculative_config`: what to propose with and how much. Parsed and checked here, before anything loads.

The accepted keys follow vLLM's: `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
"prompt_lookup_min": m}` or `{"model": "<path>", "num_speculative_tokens": k}` (method "draft_model").
"""
from __future__ import annotations

import json
import os
from typing import Any

from pydantic import Field, model_validator

from parallel.config import StrictModel

METHODS = ("ngram", "draft_model")

# Speculation verifies (k+1) tokens per sequence. Past this many tokens in a step the extra tokens cost
# real time (the step stops being bound by reading the weights) and speculation stops paying:
# `disable_by_batch_size` defaults to budget // (k+1). CPU: measured with tandem-tiny and n-gram
# (docs/benchmarks.md: 1.16x at 4 x 5 tokens, 0.75x at 8 x 5). GPU: measured with graphed verification
# on an H100, Llama-3.1-8B shapes, n-gram k = 4: 1.25x at 32 x 5 = 160 tokens, 0.77x at 128 x 5 = 640
# (docs/benchmarks.md, run 3); 192 keeps the measured win with a margin, the crossover is not located.
VERIFY_TOKEN_BUDGET = {"cuda": 192, "cpu": 24}


class SpeculativeConfig(StrictModel):
    method: str | None = Field(default=None, description="ngram, or draft_model (implied by `model`).")
    model: str | None = Field(default=None, description="Draft model folder (same tokenizer as the target).")
    num_speculative_tokens: int = Field(description="Tokens proposed per sequence and step (k).")
    prompt_lookup_max: int = Field(default=4, description="ngram: longest n-gram matched.")
    prompt_lookup_min: int = Field(default=2, description="ngram: shortest n-gram matched.")
    draft_tensor_parallel_size: int = Field(default=1, description="Ranks of the draft model: 1 (in the engine process).")
    disable_by_batch_size: int | None = Field(default=None, description="No speculation in a step with at least "
                                              "this many running sequences; default: 192 // (k + 1) on a GPU, "
                                              "24 // (k + 1) on CPU.")
    max_model_len: int | None = Field(default=None, description="Longest sequence speculated for (the draft's "
                                      "position limit by default); longer ones decode normally.")

    @model_validator(mode="before")
    @classmethod
    def _method_first(cls, data: Any) -> Any:
        """An unknown method is the first thing to report: its other keys may not mean anything here."""
        if isinstance(data, dict):
            method = data.get("method")
            if method is not None and method not in METHODS:
                raise ValueError(f"speculative_config: unknown method {method!r}; supported: {', '.join(METHODS)} "
                                 "(a draft model is given as {\"model\": path})")
            if "num_speculative_tokens" not in data:
                raise ValueError("speculative_config: num_speculative_tokens is required")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        k = self.num_speculative_tokens
        if k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be >= 1, got {k}")
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config: give a method (\"ngram\") or a draft \"model\" path")
            object.__setattr__(self, "method", "draft_model")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model")
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
        else:
            if self.model is None:
                raise ValueError("speculative_config: method 'draft_model' needs a draft \"model\" path")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(f"speculative_config: draft_tensor_parallel_size={self.draft_tensor_parallel_size} is not "
                             "supported: the draft runs on one rank, in the engine process")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config: disable_by_batch_size must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("speculative_config: max_model_len must be >= 1")
        return self

    def batch_size_limit(self, device_type: str) -> int:
        """Steps with at least this many running sequences do not speculate (batch 1 always may)."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        budget = VERIFY_TOKEN_BUDGET.get(device_type, VERIFY_TOKEN_BUDGET["cuda"])
        return max(2, budget // (self.num_speculative_tokens + 1))

    def check_against_target(self, target_model: str) -> None:
        """A draft must share the target's vocabulary: its token ids are the target's."""
        if self.method != "draft_model":
            return
        if not os.path.isfile(os.path.join(self.model, "config.json")):  # checked where the models load
            raise ValueError(f"speculative_config: no config.json in the draft model folder {self.model!r}")
        target_vocab = _vocab_size(target_model)
        draft_vocab = _vocab_size(self.model)
        if target_vocab != draft_vocab:
            raise ValueError(f"speculative_config: the draft model {self.model!r} has a vocabulary of {draft_vocab} "
                             f"tokens, the target {target_vocab}; a draft must use the target's tokenizer")


def _vocab_size(path: str) -> int | None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))


def parse_speculative_config(value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """A dict (or its JSON text, as the CLI passes it) -> SpeculativeConfig; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg})") from None
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    return SpeculativeConfig(**value)
