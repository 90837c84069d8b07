"""What a decode replica streams to the router across the Serve hop: one compact `bytes` item per output.

An engine output is cumulative (every token id, logprob entry and character so far) and, on the first
token's output and after, carries the prompt's logprobs when they were asked for. Streamed as
`RequestOutput` objects, each item would be pickled by Ray's serializer (msgpack + cloudpickle, ~30 us an
item here) and would grow with the output: O(n^2) bytes over a request of n tokens, and the prompt's
logprobs again with every token. Measured on the 2-core CPU box at 8 clients (docs/benchmarks.md), Ray's
deserialization was 18% of the router process's Python time.

So the decode side (`StreamEncoder`) sends, per item, only what the router has not seen: the new tail of
`token_ids`, `logprobs` and `text` (all of them again only when the output is not an extension of what
went before: a stop string cut off the text at the end), the prompt's logprobs once, and the small fields as they are,
pickled into one `bytes`, which Ray passes through without serializing. The router (`StreamDecoder`)
rebuilds each item as the engine's cumulative `RequestOutput`, a new object with new lists each time (items
may queue in the front end while later ones arrive), with the prompt's logprobs on every item from the one
that brought them, as the engine has them. The router has the prompt, so `prompt_token_ids` stays empty,
as it did before. A `RequestOutput` that arrives as such (a replica of an older version during a rolling
update, an in-process stand-in) is taken as it is.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import EngineDeadError
from engine.llm_engine import RequestOutput
from workers.executor import ExecutorError

_PROTOCOL = pickle.HIGHEST_PROTOCOL
# A router-driven prefill's first decode item (router/pools.py `generate_prefilled`): the decode replica has
# reserved the request's blocks; not an output (no pickle starts with a NUL byte).
RESERVED_ITEM = b"\x00reserved"
# A decode replica whose engine stopped under the stream (a rank lost): the error, last, as an item (router/pools.py),
# and raised again by the router's `StreamDecoder` as the same class: an exception out of a Serve call is logged
# by Serve with its traceback ("Request failed.") once per request, and this one is no server bug.
ERROR_ITEM = b"\x00error"
_STOPPED = {"ExecutorError": ExecutorError, "EngineDeadError": EngineDeadError}


def encode_error(e: BaseException) -> bytes:
    """The item that ends a stream whose engine stopped: `StreamDecoder.decode` raises EngineDeadError for an
    EngineDeadError and ExecutorError for anything else (a rank's ExecutorError or RayActorError), with its text."""
    kind = "EngineDeadError" if isinstance(e, EngineDeadError) else "ExecutorError"
    return ERROR_ITEM + pickle.dumps((kind, str(e)), protocol=_PROTOCOL)


@dataclass
class _Sent:
    """One stream's fields as the router already has them."""
    tokens: int = 0
    logprobs: int = 0
    text: str = ""
    prompt_logprobs: bool = False


@dataclass
class StreamEncoder:
    """Decode side: `encode(index, out)` for each output of the streams of one call, in stream order."""
    _sent: dict[int, _Sent] = field(default_factory=dict)

    def encode(self, index: int, out: RequestOutput) -> bytes:
        sent = self._sent.setdefault(index, _Sent())
        # Tails when the output extends what was sent (the engine only appends); else, as when a stop string
        # is cut off the text at the end, the whole of it again.
        reset = (len(out.token_ids) < sent.tokens or not out.text.startswith(sent.text)
                 or (out.logprobs is not None and len(out.logprobs) < sent.logprobs))
        if reset:
            sent = self._sent[index] = _Sent(prompt_logprobs=sent.prompt_logprobs)
        ids = out.token_ids[sent.tokens:]
        text = out.text[len(sent.text):]
        lps = None if out.logprobs is None else out.logprobs[sent.logprobs:]
        new_ids = None if out.new_token_ids == ids else out.new_token_ids  # usually the same list: sent once
        prompt_lps = None
        if out.prompt_logprobs is not None and not sent.prompt_logprobs:
            prompt_lps, sent.prompt_logprobs = out.prompt_logprobs, True
        sent.tokens, sent.text = len(out.token_ids), out.text
        sent.logprobs = 0 if out.logprobs is None else len(out.logprobs)
        if out.finished:
            self._sent.pop(index, None)
        return pickle.dumps((index, out.request_id, reset, ids, new_ids, out.new_text, text, lps, out.finish_reason,
                             out.stop_reason, out.num_cached_tokens, prompt_lps, out.timeline), protocol=_PROTOCOL)


@dataclass
class _Have:
    """One stream's cumulative fields on the router side."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StreamDecoder:
    """Router side: `decode(item)` -> (index, the engine's cumulative output) for each item of one call."""
    _have: dict[int, _Have] = field(default_factory=dict)

    def decode(self, item: Any) -> tuple[int, RequestOutput]:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], RequestOutput):
            return item  # (index, output) as such
        if isinstance(item, RequestOutput):
            return 0, item
        if not isinstance(item, bytes):
            raise TypeError(f"a decode replica streamed a {type(item).__name__}, not an encoded output")
        if item.startswith(ERROR_ITEM):
            kind, text = pickle.loads(item[len(ERROR_ITEM):])
            raise _STOPPED[kind](text)
        (index, request_id, reset, ids, new_ids, new_text, text, lps, finish_reason, stop_reason, cached,
         prompt_lps, timeline) = pickle.loads(item)
        have = self._have.setdefault(index, _Have())
        if reset:
            have = self._have[index] = _Have(prompt_logprobs=have.prompt_logprobs)
        have.token_ids = have.token_ids + ids  # a new list: an earlier item may still be queued, unread
        if lps is not None:
            have.logprobs = (have.logprobs or []) + lps
        have.text += text
        if prompt_lps is not None:
            have.prompt_logprobs = prompt_lps
        out = RequestOutput(request_id, [], token_ids=have.token_ids, text=have.text, logprobs=have.logprobs,
                            finish_reason=finish_reason, stop_reason=stop_reason,
                            new_token_ids=ids if new_ids is None else new_ids, new_text=new_text,
                            num_cached_tokens=cached, prompt_logprobs=have.prompt_logprobs, timeline=timeline)
        if out.finished:
            self._have.pop(index, None)
        return index, out
