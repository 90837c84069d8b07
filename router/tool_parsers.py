"""Tool calls out of model text, in the two formats vLLM's `hermes` and `llama3_json` parsers read;
`parser_for(chat_template)` picks the one a model's template writes (Hermes when it has `<tool_call>`,
else Llama-3 JSON). Calls forced by tool_choice ("required", a named function) are grammar-made JSON
and read by `forced_calls` / `ForcedStream` instead.

The Hermes format, which Qwen2/Qwen2.5/Qwen3 and many Llama fine-tunes emit:

    some optional text<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

`parse_tool_calls` reads a whole reply (non-streamed responses); `HermesStream` reads one choice's
text as it streams, passing plain text through at once and holding back only what may still become a
`<tool_call>` tag, and emits each call whole when its closing tag (or the end of the reply) arrives.
The content is the text before the first call; text between or after calls is dropped, as vLLM's
hermes parser does.
A block whose JSON is not a call (bad JSON, no name) is left as text, as vLLM does: the client sees
what the model wrote rather than a call that was never made.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def _call(body: str) -> dict[str, Any] | None:
    """OpenAI's tool_call object from one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole reply; content is the text before the first call (None if
    empty). Any block that is not a valid call leaves the whole reply as content."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = [_call(m.group(1).strip()) for m in _BLOCK.finditer(text, start)]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:start] or None, calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of the opening tag."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


@dataclass
class HermesStream:
    """One streamed choice: feed each text delta, get (content delta, tool calls completed now)."""

    pending: str = ""  # text not yet sent: a possible partial tag, or the inside of an open call
    in_call: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call emitted so far
    failed: bool = False  # a block was not a call: from then on everything is plain text

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.pending += delta
        content, new = "", []
        while self.pending and not self.failed:
            # After the first call, text outside calls is dropped, as parse_tool_calls drops it.
            after_call = bool(self.calls or new)
            if not self.in_call:
                start = self.pending.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_tag_len(self.pending)
                    content += "" if after_call else self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content += "" if after_call else self.pending[:start]
                self.pending, self.in_call = self.pending[start + len(OPEN):], True
            end = self.pending.find(CLOSE)
            if end < 0 and not final:
                break
            body = self.pending if end < 0 else self.pending[:end]
            call = _call(body.strip())
            if call is None:  # not a call: give the text back as the model wrote it
                content += OPEN + self.pending
                self.pending, self.failed = "", True
                break
            new.append(call)
            self.pending, self.in_call = ("" if end < 0 else self.pending[end + len(CLOSE):]), False
        if self.failed:
            content, self.pending = content + self.pending, ""
        self.calls += new
        return content, new


# ---------------------------------------------------------------- Llama 3.x JSON

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.1/3.2 JSON tool calls (vLLM's llama3_json): the whole reply is one or more
    {"name": ..., "parameters": {...}} objects ("arguments" too), separated by ";", optionally after
    <|python_tag|>. Anything else, or any object that is not a call, is plain content."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(json.dumps(obj)) if isinstance(obj, dict) and ("parameters" in obj or "arguments" in obj) else None
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return None, calls


@dataclass
class Llama3JsonStream:
    """One streamed choice in the Llama-3 JSON format: a reply that starts like a call ("{" or
    <|python_tag|>) is held and its calls emitted whole at the end (not a call after all: the text then);
    any other reply streams as content at once."""

    pending: str = ""
    mode: str = "undecided"  # "content" or "call" once the first non-blank text has arrived
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.pending += delta
        if self.mode == "undecided":
            head = self.pending.lstrip()
            if head and not (head.startswith("{") or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)])):
                self.mode = "content"
            elif head.startswith("{") or head.startswith(PYTHON_TAG):
                self.mode = "call"
        if self.mode == "content" or (final and self.mode == "undecided"):
            text, self.pending = self.pending, ""
            return text, []
        if not final:
            return "", []
        content, calls = parse_llama3_json(self.pending)
        self.pending = ""
        self.calls += calls
        return content or "", calls


# ---------------------------------------------------------------- parser choice


class ToolStream(Protocol):
    calls: list[dict[str, Any]]

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]: ...


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str], tuple[str | None, list[dict[str, Any]]]]
    stream: Callable[[], ToolStream]


HERMES = ToolParser("hermes", parse_tool_calls, HermesStream)
LLAMA3_JSON = ToolParser("llama3_json", parse_llama3_json, Llama3JsonStream)


def parser_for(chat_template: str | None) -> ToolParser:
    """The format the model's chat template writes tool calls in (its own past calls are rendered so)."""
    return HERMES if OPEN in str(chat_template or "") else LLAMA3_JSON


# ---------------------------------------------------------------- tool_choice required / named


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def forced_calls(text: str, named: str | None) -> list[dict[str, Any]]:
    """The calls in a grammar-forced reply: a named function's arguments object, or "required"'s
    [{"name", "parameters"}, ...] list. [] when the text is not that (cut off by max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return []
    if named is not None:
        return [new_call(named, text)] if isinstance(obj, dict) else []
    if not isinstance(obj, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in obj):
        return []
    return [new_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in obj]


@dataclass
class ForcedStream:
    """A streamed grammar-forced reply. Named: the arguments stream as they come (the first delta
    carries the call's id and name, as vLLM sends them). Required: the calls go out whole at the end."""

    named: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """tool_calls delta entries for this piece of text."""
        self.text += delta
        if self.named is not None:
            if not self.calls:
                self.calls.append(new_call(self.named, ""))
                return [{"index": 0, **self.calls[0], "function": {"name": self.named, "arguments": delta}}]
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        if not final:
            return []
        self.calls = forced_calls(self.text, None)
        return [{"index": k, **c} for k, c in enumerate(self.calls)]
