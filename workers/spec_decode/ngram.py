"""N-gram prompt lookup (vLLM's "ngram" method): propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n in [min_n, max_n] that occurs.

No model, no state: it reads the request's own prompt and output, so it shines where the output
repeats its context (code editing, retrieval-augmented answers, summaries that quote).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens continuing the last n tokens' most recent earlier match; [] when none matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length-n-1: every earlier occurrence that has a continuation
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent earlier occurrence: the freshest context
            return tokens[start : start + k].tolist()
    return []
