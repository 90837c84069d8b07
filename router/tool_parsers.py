"""Tool calls out of model text: the Hermes format (vLLM's `hermes` parser), which Qwen2/Qwen2.5/Qwen3
and many Llama fine-tunes emit:

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
from typing import Any

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
