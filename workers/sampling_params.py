"""Per-request sampling parameters (vLLM-compatible names), and the model's defaults for them.

Which fields the caller set is pydantic's `model_fields_set`; it travels with the params (pickled
through Ray to every pool), so each engine fills the unset ones from the model's
generation_config.json (`with_defaults`) no matter which front end built them.
"""
from __future__ import annotations

import os
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# generation_config.json key -> SamplingParams field: the keys vLLM's `--generation-config auto` reads.
GENERATION_CONFIG_KEYS: dict[str, str] = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                                          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                                          "max_new_tokens": "max_tokens"}


class StructuredOutputs(BaseModel):
    """Constrained decoding (engine/grammar.py compiles it): the output must match `spec`, read as
    `kind` says: json (a JSON schema, as JSON text), json_object (any JSON object; spec unused),
    regex, choice (a JSON list of the allowed strings) or grammar (EBNF). Plain strings, so the
    params pickle small to every pool and the spec is the grammar cache's key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str = ""


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: off")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20, description="Top-n logprobs per output token.")
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20,
                                        description="Logprob of each prompt token (after the first) plus the top-n.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    def with_defaults(self, defaults: Mapping[str, Any]) -> "SamplingParams":
        """These params with each field the caller left unset taken from `defaults` (the model's, see
        `model_default_fields`). An unset max_tokens is a ceiling (16, or a front end's context room),
        so a default may lower it, never raise it. Idempotent: filled fields count as set."""
        fill = {k: v for k, v in defaults.items() if k not in self.model_fields_set}
        if "max_tokens" in fill:
            fill["max_tokens"] = min(fill["max_tokens"], self.max_tokens)
        if not fill:
            return self
        merged = SamplingParams(**{**self.model_dump(), **fill})  # validated: min_tokens vs a lowered max_tokens
        return merged._marked_given(self.model_fields_set | set(fill))

    def leaving_unset(self, *names: str) -> "SamplingParams":
        """A copy in which `names` count as not set by the caller: a front end's own fallback value
        (max_tokens = the context room) that the model's defaults may still replace."""
        return self._marked_given(self.model_fields_set - set(names))

    def as_given(self) -> "SamplingParams":
        """A copy with every field counted as set: the model's defaults leave it alone (vLLM's offline
        `LLM.generate` uses explicit SamplingParams as they are)."""
        return self._marked_given(set(type(self).model_fields))

    def _marked_given(self, given: set[str]) -> "SamplingParams":
        return SamplingParams.model_construct(_fields_set=given, **dict(self))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_token_history(self) -> bool:
        """Penalties read the tokens seen so far, prompt logprobs the prompt's next tokens; other
        requests don't pay for shipping them."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.prompt_logprobs is not None)


def model_default_fields(model_path: str) -> dict[str, Any]:
    """The sampling defaults in a model folder's generation_config.json, as SamplingParams fields;
    only values the file sets (transformers' diff against its defaults, as vLLM reads it)."""
    if not os.path.isfile(os.path.join(model_path, "generation_config.json")):
        return {}
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(model_path, local_files_only=True).to_diff_dict()
    fields = {name: diff[key] for key, name in GENERATION_CONFIG_KEYS.items() if diff.get(key) is not None}
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"{model_path}/generation_config.json has defaults Tandem cannot use ({e}); "
                         "pass generation_config='vllm' to ignore them") from None
    return fields
