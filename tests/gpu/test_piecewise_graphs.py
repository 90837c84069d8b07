"""Piecewise CUDA graphs (workers/piecewise_graphs.py) against the eager forward, on one GPU.

float32, so the two paths differ only where cuBLAS picks another kernel for the padded token count:
greedy tokens must be identical. Chunked prefill (a small max_num_batched_tokens) makes mixed steps of
decodes and prompt chunks; prefix caching makes chunks that start mid-sequence. Llama (GQA), Qwen3
(per-head q/k norms) and a MoE model (the fused expert kernel) each run both ways.
"""
from __future__ import annotations

import pytest
import torch

from tests.models import TOKENIZER_VOCAB_SIZE, prompts_of_lengths, tiny_model
from tandem import LLM, SamplingParams

ARCHS = [
    ("llama", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512, num_hidden_layers=3)),
    ("qwen3", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128, intermediate_size=512,
                   num_hidden_layers=2)),
    ("qwen3_moe", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_hidden_layers=2)),
]


def _run(path: str, graph_tokens: int, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    llm = LLM(path, device="cuda", dtype="float32", cuda_graph_max_tokens=graph_tokens, max_num_batched_tokens=160,
              max_num_seqs=8, show_progress=False)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        graphs = llm.llm_engine.executor.runner.piecewise_graphs
        return [o.token_ids for o in outs], (graphs.replays if graphs is not None else -1)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[a for a, _ in ARCHS])
def test_piecewise_graphs_match_eager(arch, overrides):
    path = tiny_model(arch, max_position_embeddings=1024, **overrides)
    prompts = prompts_of_lengths([5, 40, 130, 300, 17, 64, 1, 220], TOKENIZER_VOCAB_SIZE)
    prompts += [prompts[3][:250] + [7, 8, 9]]  # a prefix-cache hit: its chunk starts mid-sequence
    eager, none = _run(path, 0, prompts)
    graphed, replays = _run(path, 160, prompts)
    assert none == -1 and replays > 0
    assert graphed == eager


def test_repeated_attention_launches_match_fresh_ones(monkeypatch):
    """A step's attention launches recorded in its first layer and repeated by the others (the piecewise graphs'
    default, `TANDEM_ATTN_REPEAT`) give the tokens of launching every layer afresh, bf16 and the FP8 cache too."""
    from workers.attention.triton_backend import LayerRepeat

    path = tiny_model("llama", max_position_embeddings=1024, **ARCHS[0][1])
    prompts = prompts_of_lengths([5, 40, 130, 300, 17, 64, 1, 220, 3, 90], TOKENIZER_VOCAB_SIZE)
    prompts += [prompts[3][:250] + [7, 8, 9]]
    for extra in ({"dtype": "bfloat16"}, {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}):
        runs = []
        for repeat in ("0", "1"):
            monkeypatch.setenv("TANDEM_ATTN_REPEAT", repeat)
            before = LayerRepeat.repeated
            llm = LLM(path, device="cuda", cuda_graph_max_tokens=160, max_num_batched_tokens=160, max_num_seqs=8,
                      show_progress=False, **extra)
            try:
                outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            finally:
                llm.llm_engine.shutdown()
            runs.append([o.token_ids for o in outs])
            assert (LayerRepeat.repeated > before) == (repeat == "1"), extra
        assert runs[0] == runs[1], extra
