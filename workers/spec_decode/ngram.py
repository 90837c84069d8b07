"""N-gram prompt lookup (vLLM's "ngram" method): propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n in [min_n, max_n] that occurs.

No model: it reads the request's own prompt and output, so it shines where the output repeats its
context (code editing, retrieval-augmented answers, summaries that quote). The search is one vector
comparison over the context (where does the last token occur?) and then a few over those candidates
only; `TokenArrays` keeps each sequence's tokens as a growing int64 array, so a step converts only the
tokens appended since the last.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens continuing the last n tokens' most recent earlier match; [] when none matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if k < 1 or length < 2:
        return []
    last = length - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # earlier occurrences of the last token: match ends
    for n in range(min(max_n, last), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        for j in range(1, n):  # the n-gram ending at each candidate equals the last n tokens
            if not cand.size:
                break
            cand = cand[tokens[cand - j] == tokens[last - j]]
        if cand.size:
            start = int(cand[-1]) + 1  # the most recent occurrence: the freshest context
            return tokens[start : start + k].tolist()
    return []


class TokenArrays:
    """Each sequence's tokens as an int64 array, extended by what was appended since the last call."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, seq_id: str, token_ids: list[int]) -> np.ndarray:
        buf, n = self._arrays.get(seq_id, (None, 0))
        total = len(token_ids)
        if buf is None or n > total:
            buf, n = np.empty(max(64, 2 * total), dtype=np.int64), 0
        elif total > len(buf):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if total > n:
            buf[n:total] = token_ids[n:]
        self._arrays[seq_id] = (buf, total)
        return buf[:total]

    def forget(self, seq_id: str) -> None:
        self._arrays.pop(seq_id, None)
