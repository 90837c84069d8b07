"""Weight quantization for the tensor-parallel linear layers (vLLM's `LinearMethodBase` design).

A layer asks its quantization method to create its parameters (each with the tensor layout the
published checkpoint format uses and the attributes its `weight_loader` needs to shard packed and
grouped dims under TP) and to compute `apply(x)`. The method is chosen from config.json's
`quantization_config` alone (`parse_quant_config`); an unsupported method or option is a ValueError
that names it. Quantized weights run dequantized here (CPU, and the correct fallback on GPU).
"""
from __future__ import annotations

from parallel.quant.base import LinearMethod, QuantConfig, UnquantizedLinearMethod
from parallel.quant.config import SUPPORTED_METHODS, parse_quant_config, quant_method_of

__all__ = ["LinearMethod", "QuantConfig", "UnquantizedLinearMethod", "SUPPORTED_METHODS", "parse_quant_config",
           "quant_method_of"]
