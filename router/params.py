"""Request checks shared by the OpenAI and gRPC front ends, so both reject the same inputs the same way."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from router.errors import ApiError, bad_request, from_validation_error
from router.protocol import Backend
from workers.sampling_params import SamplingParams


def check_model(backend: Backend, model: str | None) -> None:
    """Clients name the served model; an empty name means the (only) served one."""
    if model and model != backend.model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{backend.model_name}`.",
                       param="model", code="model_not_found")


def check_prompt_ids(backend: Backend, token_ids: list[int], param: str = "prompt") -> None:
    if not token_ids:
        raise bad_request("the prompt is empty", param)
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < backend.vocab_size]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {backend.vocab_size})", param)
    if len(token_ids) >= backend.max_model_len:
        raise bad_request(f"This model's maximum context length is {backend.max_model_len} tokens; the prompt has "
                          f"{len(token_ids)}, which leaves no room for output.", param)


def resolve_max_tokens(backend: Backend, prompt_len: int, max_tokens: int | None, param: str = "max_tokens") -> int:
    """`None` means "up to the context length", as OpenAI's chat API does."""
    room = backend.max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(f"This model's maximum context length is {backend.max_model_len} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                          f"Reduce the prompt or {param}.", param)
    return max_tokens


def sampling_params(aliases: dict[str, str] | None = None, **fields: Any) -> SamplingParams:
    """`SamplingParams` from request fields (None = the default); a bad value is a 400 naming the
    client's parameter (`aliases` maps SamplingParams names back to the request's, e.g. top_logprobs)."""
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = from_validation_error(e)
        if aliases and err.param in aliases:
            err.message = err.message.replace(err.param, aliases[err.param], 1)
            err.param = aliases[err.param]
        raise err from None


def render_chat(backend: Backend, messages: list[dict[str, str]], param: str = "messages") -> list[int]:
    """A chat's token ids through the model's chat template, with the assistant's turn opened (for
    front ends without tools; /v1/chat/completions renders its own, with tools)."""
    tok = backend.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request(f"the model `{backend.model_name}` has no chat template; send a prompt instead", param)
    try:
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    except Exception as e:  # a template error is the request's fault (roles, content it rejects)
        raise bad_request(f"the chat template failed on these messages: {e}", param) from None
    return list(ids)
