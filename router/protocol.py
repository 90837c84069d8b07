"""The contract between the front ends (OpenAI HTTP, gRPC) and whatever generates tokens.

A `Backend` is either `router.local_backend.LocalBackend` (one in-process engine, colocated) or the
disaggregated router (prefill pool -> KV handoff -> decode pool). The front ends tokenize, validate
and format; a backend only schedules token ids.

Streams: `generate` yields `RequestOutput` snapshots that the consumer owns. Each carries this
step's delta (`new_token_ids`, `new_text`) and the cumulative fields as in `RequestOutput`
(`token_ids`, `text`, `logprobs`: one entry per generated token so far, so this step's entries are
`logprobs[-len(new_token_ids):]`). The last one has `finish_reason` set. Closing the stream early
(the consumer was cancelled) must abort the request; `abort` does the same explicitly and is a
no-op for unknown or finished requests.

Errors a backend raises, and what the front ends make of them:
    ValueError                  -> 400 / INVALID_ARGUMENT     (the request itself is bad)
    engine.scheduler.QueueFullError -> 429 + Retry-After / RESOURCE_EXHAUSTED
    BackendUnavailable          -> 503 / UNAVAILABLE
    asyncio.TimeoutError        -> 504 / DEADLINE_EXCEEDED
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from engine.llm_engine import RequestOutput
from workers.sampling_params import SamplingParams


class BackendUnavailable(RuntimeError):
    """No replica can take the request now (starting, draining, crashed): retry later or elsewhere."""


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower runs first


@runtime_checkable
class Backend(Protocol):
    tokenizer: Any  # a transformers tokenizer (encode, decode, apply_chat_template)
    max_model_len: int
    vocab_size: int
    model_name: str  # the name clients pass as `model`

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def ready(self) -> bool: ...
