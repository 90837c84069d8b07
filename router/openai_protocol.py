"""OpenAI request bodies (with vLLM's sampling extras) and the pieces of OpenAI's response objects.

Unknown request fields are rejected (400), as OpenAI does, so that a misspelt parameter is not
silently ignored; a few harmless bookkeeping fields (`user`, `metadata`, ...) are accepted.
"""
from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from router.errors import bad_request
from engine.llm_engine import RequestOutput

MAX_N = 128  # choices per prompt; each is a full sequence in the batch


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and ignored: bookkeeping only
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    priority: StrictInt = 0

    def check(self) -> None:
        """Semantic checks beyond the types (400 naming the parameter); the endpoints call it."""
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingParams fields (None = SamplingParams' default)."""
        return dict(temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, top_k=self.top_k,
                    min_p=self.min_p, repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                    stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                    include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        msg = {"role": self.role, "content": content}
        if self.name:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise bad_request("tool calling is not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def _by_text(items: list[tuple[int, float]], token_text: Callable[[int], str]) -> dict[str, float]:
    """Keyed by token text, as the completions format is: where two ids decode alike (partial UTF-8
    bytes all read as U+FFFD), the more likely one is kept."""
    out: dict[str, float] = {}
    for token_id, logprob in items:
        out.setdefault(token_text(token_id), logprob)
    return out


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], n: int, token_text: Callable[[int], str],
                        offset: int = 0) -> dict[str, Any]:
    """The legacy completions format: parallel lists per generated token; `offset` = text already sent."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
        "top_logprobs": [_by_text(_top(e, n), token_text) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], n: int, token_text: Callable[[int], str]) -> dict:
    def item(t: int, lp: float) -> dict[str, Any]:
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, e[t]), "top_logprobs": [item(k, v) for k, v in _top(e, n)]}
                        for t, e in zip(token_ids, entries)]}


def delta_logprobs(out: RequestOutput) -> list[dict[int, float]]:
    """This step's logprob entries (the snapshot's list is cumulative)."""
    k = len(out.new_token_ids)
    return (out.logprobs or [])[-k:] if k else []
