#!/usr/bin/env python3
"""Model folders of real shapes for benchmarks with `load_format="dummy"` (no weights are downloaded).

Writes config.json (the published architecture hyper-parameters), generation_config.json and a
synthetic word-level tokenizer covering the whole vocabulary (token i <-> "t{i}"), so the engine,
its detokenizer and HF `from_config` all work on random weights of the real sizes.

    python scripts/model_shapes.py llama-3.1-8b /tmp/llama-3.1-8b
"""
from __future__ import annotations

import argparse
import os

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        cls="LlamaConfig", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(
        cls="Qwen3Config", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-30b-a3b": dict(
        cls="Qwen3MoeConfig", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral-8x7b": dict(
        cls="MixtralConfig", architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def hf_config(name: str):
    import transformers

    kw = dict(SHAPES[name])
    cls = getattr(transformers, kw.pop("cls"))
    return cls(**kw)


def write_model_folder(name: str, path: str) -> str:
    """Config + generation config + tokenizer for `name` in `path` (created); returns path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    cfg = hf_config(name)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, do_sample=False).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=f"t{cfg.bos_token_id}",
                                   eos_token=f"t{cfg.eos_token_id}", pad_token="t0")
    fast.save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument("path")
    a = p.parse_args()
    print(write_model_folder(a.name, a.path))


if __name__ == "__main__":
    main()
