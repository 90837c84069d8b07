"""The one matmul every linear layer calls (parallel/linear.py, the LM head in parallel/embedding.py).

`linear(x, w, bias)` is F.linear, except for 1..`gemv.max_rows()` rows of 16-bit activations on CUDA
(batch-1 decode; a speculative verification step's k + 1 rows; small decode batches) while a CUDA
graph is being captured, which go to the Triton GEMV in parallel/kernels/gemv.py: there a step is
pure weight streaming, each weight tile read once for all the rows, and cuBLAS leaves part of the GPU
idle (scripts/bench_gemv.py, `--rows` for more than one). Outside a graph, a Triton launch costs tens
of microseconds of Python per call, more than the GEMV saves: eager decode (multi-rank layouts,
enforce_eager) keeps cuBLAS. 2+ rows go to it only with TANDEM_GEMV_ROWS=N (opt-in: kernels/gemv.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from parallel.kernels import gemv as _gemv
except ImportError:  # no Triton (CPU machines): F.linear everywhere
    _gemv = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _gemv is not None and _gemv.supports(x, weight) and torch.cuda.is_current_stream_capturing():
        return _gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)
