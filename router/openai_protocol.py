"""OpenAI request bodies (with vLLM's sampling extras) and the pieces of OpenAI's response objects.

Unknown request fields are accepted, ignored and logged at WARNING (once per field name per
process), as vLLM does: clients written for OpenAI or vLLM send fields this server has never heard
of, and refusing the whole request for them breaks those clients. Fields this server *knows* but
cannot honour (`UNSUPPORTED`: beam search, ...) are different: ignoring them would silently change
the answer, so a request that sets one gets a 400 naming it. Structured output (response_format,
structured_outputs, guided_*, and chat's tool_choice required/named) becomes one constraint for the
grammar engine (router/structured.py).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, model_validator

from router import structured
from router.errors import bad_request
from engine.llm_engine import RequestOutput
from workers.sampling_params import StructuredOutputs

log = logging.getLogger(__name__)

MAX_N = 128  # choices per prompt; each is a full sequence in the batch

_IGNORED_LOGGED: set[str] = set()  # unknown field names already warned about (the log is not per request)

# Known fields that change the result and that this server cannot honour: name -> (the value that
# means "not used", why it is refused). Shared by both endpoints; each request class adds its own.
UNSUPPORTED_COMMON: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty needs beam search, which is not supported"),
    "allowed_token_ids": (None, "allowed_token_ids is not supported"),
    "bad_words": (None, "bad_words is not supported"),
    "truncate_prompt_tokens": (None, "truncate_prompt_tokens is not supported"),
    "logits_processors": (None, "logits_processors is not supported"),
    "return_tokens_as_token_ids": (False, "return_tokens_as_token_ids is not supported"),
    "spaces_between_special_tokens": (True, "spaces_between_special_tokens: false is not supported"),
    "cache_salt": (None, "cache_salt (per-tenant prefix-cache isolation) is not supported"),
    "guided_whitespace_pattern": (None, "guided_whitespace_pattern is not supported (JSON is written compactly)"),
}


def _log_ignored(name: str) -> None:
    if name not in _IGNORED_LOGGED:
        _IGNORED_LOGGED.add(name)
        log.warning("ignoring unknown request field %r (accepted as vLLM does; logged once per field name)", name)


class _Lenient(BaseModel):
    """A request object that accepts unknown fields: each is logged once and dropped, except those in
    `UNSUPPORTED`, which are kept in `model_extra` for `unsupported()` to refuse."""

    model_config = ConfigDict(extra="allow")
    WHERE: ClassVar[str] = ""  # how the field's name is written in the log ("messages[].", ...)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {}

    @model_validator(mode="after")
    def _drop_unknown(self):
        extra = self.__pydantic_extra__ or {}
        for name in [k for k in extra if k not in self.UNSUPPORTED]:
            _log_ignored(self.WHERE + name)
            del extra[name]
        return self

    def unsupported(self) -> None:
        """400 for a known-but-unsupported field set to anything but its "not used" value."""
        for name, value in (self.__pydantic_extra__ or {}).items():
            unused, why = self.UNSUPPORTED[name]
            if value != unused and not (unused is None and value in ([], {}, "")):
                raise bad_request(f"{why} (field `{self.WHERE}{name}`)", self.WHERE + name)


class StreamOptions(_Lenient):
    WHERE = "stream_options."
    include_usage: StrictBool = False
    # vLLM's: usage (so far) on every chunk, not only in the closing one
    continuous_usage_stats: StrictBool = False


class _Common(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    UNSUPPORTED = UNSUPPORTED_COMMON

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
    prompt_logprobs: StrictInt | None = None  # vLLM's: logprob (and top-n) of every prompt token
    # structured output (router/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    _constraint: StructuredOutputs | None = PrivateAttr(default=None)

    def constraint_candidates(self) -> list[tuple[str, StructuredOutputs | None]]:
        """Every structured-output field the request sets, as (field, spec)."""
        return [("response_format", structured.from_response_format(self.response_format)),
                ("structured_outputs", structured.from_structured_outputs(self.structured_outputs)),
                *structured.from_guided(self.model_dump(include={"guided_json", "guided_regex", "guided_choice",
                                                                 "guided_grammar", "guided_decoding_backend"}))]

    def check(self) -> None:
        """Semantic checks beyond the types (400 naming the parameter); the endpoints call it."""
        self.unsupported()
        self._constraint = structured.resolve(self.constraint_candidates())
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.stream_options is not None:
            self.stream_options.unsupported()

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingParams fields (None = SamplingParams' default)."""
        return dict(temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, top_k=self.top_k,
                    min_p=self.min_p, repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                    stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                    include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
                    structured_outputs=self._constraint, prompt_logprobs=self.prompt_logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk; as in vLLM it needs include_usage too."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    UNSUPPORTED = {**UNSUPPORTED_COMMON, "add_special_tokens": (True, "add_special_tokens: false is not supported")}

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.echo and self.prompt_logprobs is None and self.logprobs is not None:
            self.prompt_logprobs = self.logprobs  # echo with logprobs scores the prompt too, top-n alike
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


class TextPart(_Lenient):
    WHERE = "messages[].content[]."
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    WHERE = "messages[].tool_calls[].function."
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    WHERE = "messages[].tool_calls[]."
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_input(self) -> dict[str, Any]:
        """Chat templates (Qwen's, Llama 3.1's, Hermes') write `arguments | tojson`: they want an
        object, not the JSON text OpenAI transcripts carry (vLLM converts the same way)."""
        try:
            args = json.loads(self.function.arguments)
        except ValueError:
            raise bad_request(f"tool call {self.function.name!r}: arguments are not valid JSON", "messages") from None
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class ChatMessage(_Lenient):
    WHERE = "messages[]."
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDef(_Lenient):
    WHERE = "tools[].function."
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Lenient):
    WHERE = "tools[]."
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Lenient):
    WHERE = "tool_choice."

    class Name(_Lenient):
        WHERE = "tool_choice.function."
        name: str

    type: Literal["function"]
    function: Name


UNSUPPORTED_CHAT: dict[str, tuple[Any, str]] = {
    **UNSUPPORTED_COMMON,
    "chat_template": (None, "a per-request chat_template is not accepted; the model's own template is used"),
    "documents": (None, "documents (retrieval chat templates) are not supported"),
    "functions": (None, "the deprecated `functions` is not supported; use `tools`"),
    "function_call": (None, "the deprecated `function_call` is not supported; use `tool_choice`"),
    "audio": (None, "audio output is not supported"),
    "prediction": (None, "predicted outputs are not supported"),
    "web_search_options": (None, "web search is not supported"),
    "echo": (False, "echo on chat completions is not supported"),
    "add_special_tokens": (False, "add_special_tokens: true is not supported on chat completions"),
}

# apply_chat_template arguments the server sets itself: a client may not override them through
# chat_template_kwargs (tokenize/return_dict would break the server's own use of the result).
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                      "return_dict", "return_tensors", "padding", "truncation", "max_length",
                                      "tokenizer_kwargs", "add_generation_prompt", "continue_final_message"})


class ChatCompletionRequest(_Common):
    UNSUPPORTED = UNSUPPORTED_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's: extend the last (assistant) message instead
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call is returned

    def check(self) -> None:
        self._check_tools()  # first: the tool_choice constraint below reads the named tool
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        self._check_template_args()

    def _check_tools(self) -> None:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")

    def constraint_candidates(self) -> list[tuple[str, StructuredOutputs | None]]:
        schema = self.forced_tool_schema()
        forced = StructuredOutputs(kind="json", spec=json.dumps(schema, sort_keys=True)) if schema is not None else None
        return [*super().constraint_candidates(), ("tool_choice", forced)]

    @property
    def named_tool(self) -> FunctionDef | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema that enforces tool_choice, as vLLM builds it: a named function's output is
        its arguments object; "required" is a list of at least one {"name", "parameters"} call of the
        given tools (at most one without parallel_tool_calls)."""
        if self.named_tool is not None:
            return self.named_tool.parameters or {"type": "object", "properties": {}}
        if self.tool_choice != "required":
            return None
        calls = [{"type": "object", "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": t.function.parameters or {"type": "object", "properties": {}}}}
                 for t in self.tools]
        limit = {"maxItems": 1} if self.parallel_tool_calls is False else {}
        return {"type": "array", "minItems": 1, **limit, "items": {"anyOf": calls}}

    @property
    def parse_tools(self) -> bool:
        """Whether the reply is read for tool calls by the model's tool-call format ("auto"; with
        tool_choice "none" the tools are still shown to the template, as vLLM does, but the reply is
        plain text; "required" and a named function are grammar-forced JSON, read as such)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template renders: a named tool_choice shows the model only that one."""
        if not self.tools:
            return None
        tools = self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        return [t.model_dump(exclude_none=True) for t in tools]

    def _check_template_args(self) -> None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}: the server sets them (use the request "
                              "fields of the same name where there is one)", "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt: false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for apply_chat_template: the client's extras, then the server's own."""
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

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


# ---------------------------------------------------------------- /tokenize, /detokenize (vLLM's)


class TokenizeRequest(_Lenient):
    """vLLM's /tokenize: a completion `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: StrictBool = False

    def check(self) -> None:
        self.unsupported()
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give either prompt or messages", "prompt")
        if self.messages is not None and self.add_special_tokens:
            raise bad_request("add_special_tokens: true is not supported with messages", "add_special_tokens")

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt this is (checked as /v1/chat/completions checks it)."""
        chat = ChatCompletionRequest(messages=self.messages, tools=self.tools, add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template_kwargs=self.chat_template_kwargs)
        chat.check()
        return chat


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[StrictInt]


# ---------------------------------------------------------------- echo and prompt logprobs


def echo_logprobs(prompt_ids: list[int], prompt_lps: list[dict[int, float] | None], n: int,
                  token_text: Callable[[int], str]) -> dict[str, Any]:
    """The prompt's part of completions' logprobs with echo: the first token has no logprob (null)."""
    tokens = [token_text(t) for t in prompt_ids]
    offsets, offset = [], 0
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e[t] for t, e in zip(prompt_ids, prompt_lps)],
            "top_logprobs": [None if e is None else _by_text(_top(e, n), token_text) for e in prompt_lps],
            "text_offset": offsets}


def joined_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """Two parallel-list logprobs objects one after the other (second's text offsets shifted)."""
    if second is None:
        return first
    shift = first["text_offset"][-1] + len(first["tokens"][-1]) if first["tokens"] else 0
    return {"tokens": first["tokens"] + second["tokens"], "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}


def vllm_prompt_logprobs(prompt_ids: list[int], prompt_lps: list[dict[int, float] | None] | None, n: int,
                         token_text: Callable[[int], str]) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, null for the first, else {token id: {logprob,
    rank, decoded_token}} for the token and the top-n (the token's rank is null when it is outside the
    top-n: only the top-n are ranked)."""
    if prompt_lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for t, entry in zip(prompt_ids, prompt_lps):
        if entry is None:
            out.append(None)
            continue
        top = _top(entry, len(entry))
        outside = len(entry) > n  # the token itself is not among the top-n: it is the extra, last entry
        ranks = {tid: r + 1 for r, (tid, _) in enumerate(top) if not (outside and tid == t)}
        out.append({str(tid): {"logprob": lp, "rank": ranks.get(tid), "decoded_token": token_text(tid)}
                    for tid, lp in top})
    return out
