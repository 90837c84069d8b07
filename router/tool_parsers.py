"""Tool calls out of model text, in the two formats vLLM's `hermes` and `llama3_json` parsers read;
`parser_for(chat_template, setting)` gives the one the served `tool_call_parser` setting names (vLLM's
`--tool-call-parser`), or with "auto" (the default) the one a model's template writes (Hermes when it
has `<tool_call>`, else Llama-3 JSON). Calls forced by tool_choice ("required", a named function) are grammar-made JSON
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

The Llama 3.1/3.2 JSON format (the whole reply is calls; `;` between them):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "time", "parameters": {}}

`parse_llama3_json` reads a whole reply; `Llama3JsonStream` streams each call as vLLM does, its name
first, then its arguments in fragments (see the class for what happens to text that is not a call).
"""
from __future__ import annotations

import json
import re
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

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

    def step(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """`feed` as tool_calls delta entries: each call whole, with its index among the choice's calls."""
        before = len(self.calls)
        content, new = self.feed(delta, final)
        return content, [_entry(before + k, c) for k, c in enumerate(new)]


# ---------------------------------------------------------------- Llama 3.x JSON

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()
# A call whose name is known and whose arguments have begun: `{"name": "f", "parameters": ` (the order
# Llama 3.x writes). Another key order is read only once the object is whole.
_NAME_THEN_ARGS = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SCALAR = re.compile(r'[^\s{}\[\],:"]+')  # a number, true, false, null (NaN/Infinity, as json.loads reads them)


def _llama3_call(obj: Any) -> dict[str, Any] | None:
    """OpenAI's tool_call object from one decoded object, or None when it is not a Llama-3 call (a
    string name and "parameters" or "arguments", as vLLM's llama3_json requires)."""
    if not isinstance(obj, dict) or not ("parameters" in obj or "arguments" in obj):
        return None
    return _call(json.dumps(obj))


def _calls_start(text: str) -> int | None:
    """Where the first call's "{" is in a reply in the Llama-3 JSON format (after blanks and an optional
    <|python_tag|>), or None when the reply is not in that format."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    return len(text) - len(body) if body.startswith("{") else None


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.1/3.2 JSON tool calls (vLLM's llama3_json): the whole reply is one or more
    {"name": ..., "parameters": {...}} objects ("arguments" too), separated by ";", optionally after
    <|python_tag|>. Anything else, or any object that is not a call, leaves the whole reply as content."""
    pos = _calls_start(text)
    if pos is None:
        return text, []
    calls = []
    while pos < len(text):
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:  # malformed, cut off, or text after the calls
            return text, []
        call = _llama3_call(obj)
        if call is None:
            return text, []
        calls.append(call)
        pos = _skip_separators(text, pos)
    return None, calls


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos


@dataclass
class _ArgsScanner:
    """The arguments object of a call being streamed, read one complete JSON token at a time and
    written back as json.dumps(..., ensure_ascii=False) writes it (", " and ": " separators, strings
    and numbers re-encoded), so that the fragments add up to exactly the arguments of the whole parse.
    A token that may still grow (a string without its closing quote, a number at the end) waits."""

    pos: int  # in the reply: the next character to read
    depth: int = 0
    done: bool = False  # the object closed

    def advance(self, text: str) -> str:
        out = []
        while not self.done and self.pos < len(text):
            ch = text[self.pos]
            if ch.isspace():
                self.pos += 1
                continue
            if ch in "{}[],:":
                token, end = {",": ", ", ":": ": "}.get(ch, ch), self.pos + 1
                self.depth += 1 if ch in "{[" else -1 if ch in "}]" else 0
            else:
                m = (_STRING if ch == '"' else _SCALAR).match(text, self.pos)
                if m is None or (ch != '"' and m.end() == len(text)):
                    break  # not complete yet
                try:
                    token, end = json.dumps(json.loads(m.group()), ensure_ascii=False), m.end()
                except ValueError:
                    break  # not JSON: the object will not decode, and nothing more is sent
            out.append(token)
            self.pos, self.done = end, self.depth <= 0
        return "".join(out)


@dataclass
class _OpenCall:
    """The call being read: where its object starts, and once its name was sent, its entry in `calls`."""

    start: int
    index: int | None = None  # set once the name went out
    args: _ArgsScanner | None = None  # streaming an arguments object
    whole: bool = False  # not `{"name": ..., "parameters": {`: sent whole once the object closes


@dataclass
class Llama3JsonStream:
    """One streamed choice in the Llama-3 JSON format, as vLLM's llama3_json streams it: a reply that
    does not start like a call ("{" or <|python_tag|>) streams as content at once; in a call, the name
    goes out (with the call's index, id and type) as soon as `{"name": "...", "parameters": {` has
    arrived, then the arguments in fragments as their JSON tokens complete (arguments given as a JSON
    string, or keys in another order: the call goes out whole when its object closes). A first object that turns
    out not to be a call, or a reply that ends before its first call was named, is all content, as the
    whole parse gives it. Once a call has gone out, what cannot be read as calls after it (text, a
    malformed or cut-off object) is dropped, as vLLM drops it; a call cut off keeps what was sent."""

    text: str = ""
    mode: str = "undecided"  # "content" or "call" once the reply's start tells
    sent: int = 0  # characters of `text` given out as content
    pos: int = 0  # where the next call (or the separators before it) starts
    open: _OpenCall | None = None
    tried: int = 0  # `text` was tried as a whole object up to here: try again once a "}" arrives after it
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call begun, arguments as sent
    broken: bool = False  # calls went out, then something that is not a call: the rest is dropped

    def step(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls delta entries) for this piece of text."""
        self.text += delta
        if self.mode == "undecided":
            self._decide(final)
        entries: list[dict[str, Any]] = []
        if self.mode == "call" and not self.broken:
            entries = self._read_calls(final)
        if self.mode == "content":
            content, self.sent = self.text[self.sent:], len(self.text)
            return content, []
        return "", _merged(entries)

    def _decide(self, final: bool) -> None:
        start = _calls_start(self.text)
        if start is not None:
            self.mode, self.pos = "call", start
        elif final or not _may_start_calls(self.text):
            self.mode = "content"

    def _read_calls(self, final: bool) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        while self.mode == "call" and not self.broken:
            if self.open is None:
                self.pos = _skip_separators(self.text, self.pos)
                if self.pos == len(self.text):
                    break
                if self.text[self.pos] != "{":  # text after the calls
                    self._give_up()
                    break
                self.open = _OpenCall(self.pos)
            if not self._stream_open(entries, final):
                break
        return entries

    def _stream_open(self, entries: list[dict[str, Any]], final: bool) -> bool:
        """Send what the open call has that is new; True when its object closed (read the next one)."""
        call = self.open
        if call.index is None and not call.whole:
            self._start(entries, call)
        if call.args is not None:
            self._send_args(entries, call.args.advance(self.text))
        if "}" not in self.text[self.tried:] and not final:
            return False
        self.tried = len(self.text)
        try:
            obj, end = _DECODER.raw_decode(self.text, call.start)
        except ValueError:  # not whole yet, or malformed / cut off at the end
            if final:
                self._give_up()
            return False
        return self._close(entries, obj, end)

    def _start(self, entries: list[dict[str, Any]], call: _OpenCall) -> None:
        """Send the call's name once `{"name": "...", "parameters": {` has arrived. Arguments given as a
        JSON string, or another key order, wait for the object to close and go out whole."""
        m = _NAME_THEN_ARGS.match(self.text, call.start)  # anchored: fails at once on another key order
        if m is None:
            return
        pos = _skip_blanks(self.text, m.end())
        name = _json_str(m.group(1))
        if pos == len(self.text):
            return
        if name is None or self.text[pos] != "{":
            call.whole = True
            return
        call.index = len(self.calls)
        self.calls.append(new_call(name, ""))
        entries.append(_entry(call.index, self.calls[-1]))
        call.args = _ArgsScanner(pos)

    def _close(self, entries: list[dict[str, Any]], obj: Any, end: int) -> bool:
        whole = _llama3_call(obj)
        if whole is None:
            self._give_up()
            return False
        index = self.open.index
        if index is None:  # another key order: the call goes out whole now
            self.calls.append(whole)
            entries.append(_entry(len(self.calls) - 1, whole))
        else:
            sent = self.calls[index]["function"]["arguments"]
            rest = whole["function"]["arguments"]
            # The same text unless the object repeats a key (json.loads keeps the last): then what was
            # sent, the model's own tokens, stands.
            if rest.startswith(sent):
                self._send_args(entries, rest[len(sent):], index)
        self.open, self.pos, self.tried = None, end, end
        return True

    def _send_args(self, entries: list[dict[str, Any]], fragment: str, index: int | None = None) -> None:
        if not fragment:
            return
        index = self.open.index if index is None else index
        self.calls[index]["function"]["arguments"] += fragment
        entries.append({"index": index, "function": {"arguments": fragment}})

    def _give_up(self) -> None:
        """Not a call after all: all content when nothing went out yet, else the rest is dropped."""
        if self.calls:
            self.broken = True
        else:
            self.mode = "content"
        self.open = None


def _may_start_calls(text: str) -> bool:
    """Whether "{" may still follow: the reply so far is blank, (a part of) <|python_tag|>, or the tag and blanks."""
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        return not head[len(PYTHON_TAG):].strip()
    return PYTHON_TAG.startswith(head)


def _skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _entry(index: int, call: dict[str, Any]) -> dict[str, Any]:
    """A tool_calls delta entry for a call's first chunk (its own copy: the call's arguments grow)."""
    return {"index": index, **call, "function": dict(call["function"])}


def _json_str(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _merged(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call in a chunk: a name and argument fragments read in the same step go out together."""
    out: list[dict[str, Any]] = []
    for e in entries:
        if out and out[-1]["index"] == e["index"]:
            last = out[-1]
            last["function"] = {**last["function"],
                                "arguments": last["function"].get("arguments", "") + e["function"]["arguments"]}
        else:
            out.append({**e, "function": dict(e["function"])})
    return out


# ---------------------------------------------------------------- parser choice


class ToolStream(Protocol):
    """One streamed choice's parser: `step` gives (content delta, tool_calls delta entries, each with its
    call's index); `calls` holds every call begun so far."""

    calls: list[dict[str, Any]]

    def step(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]: ...


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str], tuple[str | None, list[dict[str, Any]]]]
    stream: Callable[[], ToolStream]


HERMES = ToolParser("hermes", parse_tool_calls, HermesStream)
LLAMA3_JSON = ToolParser("llama3_json", parse_llama3_json, Llama3JsonStream)


PARSERS = {p.name: p for p in (HERMES, LLAMA3_JSON)}
# The served `tool_call_parser` setting (vLLM's --tool-call-parser): a parser by name, or "auto".
ToolCallParserName = Literal["auto", "hermes", "llama3_json"]
TOOL_CALL_PARSER_CHOICES: tuple[str, ...] = typing.get_args(ToolCallParserName)


def parser_for(chat_template: str | None, setting: str = "auto") -> ToolParser:
    """The parser `setting` names; "auto": the format the model's chat template writes tool calls in (its
    own past calls are rendered so): Hermes when it has `<tool_call>`, else Llama-3 JSON."""
    check_parser_setting(setting)
    if setting != "auto":
        return PARSERS[setting]
    return HERMES if OPEN in str(chat_template or "") else LLAMA3_JSON


def check_parser_setting(setting: str) -> str:
    if setting not in TOOL_CALL_PARSER_CHOICES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(map(repr, TOOL_CALL_PARSER_CHOICES))}, "
                         f"not {setting!r}")
    return setting


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
