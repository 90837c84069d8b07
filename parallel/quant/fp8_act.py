"""FP8 activations made by the kernel that produces them, for the W8A8 GEMM that consumes them.

A dynamic W8A8 linear (FP8 per-channel weights, `torch._scaled_mm`, packed.py) quantizes its input per token
before the GEMM: one more kernel per linear, four per decoder layer, each reading the activations again. Three of
those inputs come out of a Triton kernel that already holds each row in registers: the RMSNorm before qkv and
gate/up, and SiLU-and-mul before down. Those kernels can write the e4m3 codes and per-token scales beside their
16-bit output (parallel/kernels/fused_ops.py, `fp8_rows`); this module carries them from there to the consumer.

The codes travel on the output tensor itself (`attach`), and the consuming `PackedWeight.apply` takes them off
(`take`) if the tensor it was given is that output, with the row count it would have quantized to. Nothing is
global: the codes live and die with the tensor object, and a consumer that was handed any other tensor (a copy,
a slice, a sum) finds none and quantizes as before. The codes are what `quant_fp8_rows` makes of the output,
bit for bit (tests/test_fp8_act_interpreted.py), so the result does not depend on which kernel made them.

Who asks for them: `parallel.linear._TPLinear.fp8_input_rows(x)` says, per call, whether the layer would run the
dynamic W8A8 GEMM on x and on how many (padded) rows; the model passes that to the producer
(workers/models/transformer.py). TANDEM_FP8_FUSED_ACT=0 at load turns it off for the layers loaded then
(`PackedWeight.act_from_producer`; scripts/bench_quant.py's fp8-actq variant, to compare).
"""
from __future__ import annotations

import os

import torch

ENV = "TANDEM_FP8_FUSED_ACT"
_ATTR = "_tandem_fp8_act"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def attach(t: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hang e4m3 codes [R, K] and float32 scales [R, 1] of t's rows (R >= rows, padding rows zero) on t."""
    setattr(t, _ATTR, (codes, scales))
    return t


def take(t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes and scales attached to t, if any and made for `rows` padded rows; they are removed from t (one
    consumer per output)."""
    got = getattr(t, _ATTR, None)
    if got is None:
        return None
    delattr(t, _ATTR)
    return got if got[0].shape[0] == rows and got[0].shape[1] == t.shape[-1] else None
