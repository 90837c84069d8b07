"""Model registry: the architecture comes from config.json's `architectures`."""
from __future__ import annotations

from workers.models.transformer import CausalLM, build_model as _build

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM",
}


def build_model(hf_config, max_positions: int) -> CausalLM:
    archs = getattr(hf_config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"unsupported architectures {archs}; Tandem runs {sorted(SUPPORTED_ARCHITECTURES)}")
    return _build(hf_config, max_positions)


__all__ = ["CausalLM", "build_model", "SUPPORTED_ARCHITECTURES"]
