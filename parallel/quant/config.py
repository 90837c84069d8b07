"""`quantization_config` (config.json) -> a QuantConfig, or a ValueError naming what is unsupported.

Only what is understood is accepted: a method or an option value Tandem cannot honour is refused
rather than ignored, because ignoring it would load the weights wrongly and generate garbage silently.
"""
from __future__ import annotations

from typing import Any

from parallel.quant.base import QuantConfig

SUPPORTED_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")
# Modules Tandem never quantizes anyway; a checkpoint saying so changes nothing.
_ALWAYS_PLAIN = ("lm_head", "embed_tokens", "norm", "mlp.gate", "block_sparse_moe.gate")


def _as_dict(qc: Any) -> dict:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):  # a transformers QuantizationConfigMixin
        return qc.to_dict()
    raise ValueError(f"quantization_config must be a JSON object, got {type(qc).__name__}")


def quant_method_of(qc: Any) -> str | None:
    """The lower-cased `quant_method` of a quantization_config, None without one."""
    if qc is None:
        return None
    method = _as_dict(qc).get("quant_method")
    if not method:
        raise ValueError("config.json's quantization_config has no quant_method")
    return str(method).lower()


def check_plain_modules(qc: dict, key: str) -> None:
    """`modules_to_not_convert`-style lists: fine when they name only modules that stay unquantized here."""
    names = qc.get(key) or []
    odd = [n for n in names if not any(str(n).endswith(p) or str(n).split(".")[-1] == p for p in _ALWAYS_PLAIN)]
    if odd:
        raise ValueError(f"quantization_config {key}={odd} (linear layers left unquantized) is not supported yet")


def parse_quant_config(qc: Any) -> QuantConfig | None:
    """None for an unquantized checkpoint; else the method's config, validated."""
    method = quant_method_of(qc)
    if method is None:
        return None
    qc = _as_dict(qc)
    if method == "gptq":
        from parallel.quant.gptq import GPTQConfig

        return GPTQConfig.from_config(qc)
    if method == "awq":
        from parallel.quant.awq import AWQConfig

        return AWQConfig.from_config(qc)
    if method == "fp8":
        from parallel.quant.fp8 import FP8Config

        return FP8Config.from_config(qc)
    if method == "compressed-tensors":  # llm-compressor's checkpoints: their FP8 schemes
        from parallel.quant.compressed_tensors import compressed_tensors_config

        return compressed_tensors_config(qc)
    raise ValueError(f"unsupported quant_method {method!r} in config.json's quantization_config; "
                     f"Tandem loads {list(SUPPORTED_METHODS)}")


def effective_quant_config(checkpoint_qc: Any, quantization: str | None, load_format: str,
                           in_features: tuple[int, ...] = ()) -> dict | None:
    """The quantization_config the model is built with: the checkpoint's; or, for an unquantized
    checkpoint, `quantization="fp8"` quantizes it at load (online FP8, per-channel weight scales), and
    with load_format="dummy" `gptq` / `awq` make random weights quantized at load by round-to-nearest
    (4 bit, group size 128 -- or 64, 32 where the layers' `in_features` need it -- in the layouts
    scripts/quantize.py writes; for benchmarks)."""
    parse_quant_config(checkpoint_qc)
    found = quant_method_of(checkpoint_qc)
    if quantization in (None, "auto") or quantization == found:
        return _as_dict(checkpoint_qc) if checkpoint_qc is not None else None
    if found is not None:
        raise ValueError(f"quantization={quantization!r} but the checkpoint's quantization_config says {found!r}")
    if quantization == "fp8":
        from parallel.quant.fp8 import online_fp8_config

        return online_fp8_config()
    if quantization in ("gptq", "awq") and load_format == "dummy":
        from parallel.quant.rtn import Options

        gs = next((g for g in (128, 64, 32) if all(n % g == 0 for n in in_features)), -1)
        return Options(quantization, bits=4, group_size=gs).quantization_config("tandem RTN (dummy weights)")
    raise ValueError(f"quantization={quantization!r}: the checkpoint is not quantized, and only fp8 quantizes at load "
                     f"(write a {quantization} copy with scripts/quantize.py, or use load_format='dummy' for benchmarks)")
