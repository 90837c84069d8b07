"""Streaming detokenization and stop strings.

Decoding one token at a time is wrong in two ways: a byte-level BPE spreads one character over
several tokens (each alone decodes to U+FFFD), and SentencePiece-style decoders change a token's
text with its context (the leading space of a word is dropped at the start of a decode). So each step
decodes a short window of ids twice, with and without the new tokens, and emits the difference once
it no longer ends in an incomplete character (the prefix-offset/read-offset scheme of vLLM and TGI).
"""
from __future__ import annotations

import weakref
from typing import Callable

# Prompt tokens kept as left context for the first output tokens.
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """`tokenizer` needs only `decode(ids, skip_special_tokens=...)` (HF tokenizers, `tokenizers.Tokenizer`).

    `text` equals `tokenizer.decode(output_ids)` for byte-level BPE tokenizers when the output ends
    on a complete character. For context-dependent decoders it is the text the output adds after the
    prompt (vLLM's behaviour), e.g. " Paris" where decoding the output alone would give "Paris".
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = _fast_decode(tokenizer, skip_special_tokens)
        # Only the window ids[prefix_offset:] is ever decoded, so older ids are dropped as we go.
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # ids before this are already in `text`
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def add_token(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (may be "", e.g. mid-character)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character still waits for its next bytes
        delta = new_text[len(prefix_text) :]
        # The new window starts where the old one was read up to: just enough context.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: emit what is held back (an incomplete character, as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids)


_FAST: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()


def _fast_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)`, straight to the Rust `tokenizers.Tokenizer`
    when the Python wrapper would return its text unchanged: the wrapper's argument handling costs
    several times the decode itself, twice per token per sequence on the engine's step path.

    Whether the wrapper changes the text (its optional clean-up of spaces before punctuation, which
    depends on the tokenizer's settings and the transformers version) is checked once per tokenizer
    on a probe that the clean-up would alter.
    """
    rust = getattr(tokenizer, "_tokenizer", None)
    slow = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    if rust is None or not callable(getattr(rust, "decode", None)):
        return slow
    same = _FAST.get(tokenizer)
    if same is None:
        try:
            probe = tokenizer.encode("a , b . c ? don 't", add_special_tokens=False)
            same = all(tokenizer.decode(probe, skip_special_tokens=skip) == rust.decode(probe, skip_special_tokens=skip)
                       for skip in (False, True))
            if " ." not in rust.decode(probe) and getattr(tokenizer, "clean_up_tokenization_spaces", False):
                same = False  # the probe cannot show whether the clean-up runs (no punctuation in the vocabulary)
        except Exception:  # an unusual tokenizer: keep its own decode
            same = False
        _FAST[tokenizer] = same
    if not same:
        return slow
    return lambda ids: rust.decode(ids, skip_special_tokens=skip_special_tokens)


def find_stop_string(text: str, num_new_chars: int, stop: list[str], include_stop_str: bool) -> tuple[str, int] | None:
    """The stop string that ends in the last `num_new_chars` chars of `text`, and the length to cut
    `text` to (before the stop string, or after it with `include_stop_str`).

    Matches that end before the new tail were already checked on earlier calls. Among several
    matches the one starting earliest wins; on a tie, the shorter one (it would have completed first).
    """
    if num_new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        # earliest start from which `s` still reaches into the new chars
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return s, (i + len(s) if include_stop_str else i)


def streamable_len(text: str, stop: list[str], finished: bool) -> int:
    """How much of `text` may be sent now: while running, the last (longest stop - 1) chars could
    still turn out to be the start of a stop string, so they wait."""
    if finished or not stop:
        return len(text)
    return max(0, len(text) - (max(len(s) for s in stop) - 1))
