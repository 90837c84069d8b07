"""Per-request sampling parameters (vLLM-compatible names)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_token_history(self) -> bool:
        """Penalties read the tokens seen so far; other requests don't pay for shipping them."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
