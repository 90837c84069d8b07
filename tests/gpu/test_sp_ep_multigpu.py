"""Sequence parallelism (ring attention) and expert parallelism (all-to-all MoE) over NCCL, one Ray
actor per GPU, against Hugging Face. The CPU suite (tests/test_sp_ep_llm.py) checks the same over gloo.
float32 keeps greedy tokens comparable across reduction orders. Skipped below 2 GPUs.
"""
from __future__ import annotations

import pytest
import ray
import torch

from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
from engine.llm import LLM
from workers.sampling_params import SamplingParams

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")]

# Prompts of up to 6 blocks; a 32-token budget chunks the long ones and mixes them with decodes.
ENGINE_ARGS = dict(device="cuda", dtype="float32", num_gpu_blocks_override=128, block_size=16, max_num_batched_tokens=32,
                   max_num_seqs=8, show_progress=False)
MAX_TOKENS = 8
PROMPTS = prompts_of_lengths([5, 40, 17, 90, 33], vocab_size=290, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CASES = {
    "llama-sp2": ("llama", dict(sequence_parallel_size=2)),
    "mixtral-ep2": ("mixtral", dict(expert_parallel_size=2)),
    "qwen3_moe-ep2": ("qwen3_moe", dict(expert_parallel_size=2)),
    "qwen3_moe_nonorm-sp2ep2": ("qwen3_moe_nonorm", dict(sequence_parallel_size=2, expert_parallel_size=2)),
}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_gpus=NUM_GPUS, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_sp_ep_layout_matches_hf(case: str):
    name, layout = CASES[case]
    path = tiny_model(name)
    llm = LLM(path, **layout, **ENGINE_ARGS)
    try:
        first = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # prefix-cache hits
        hits = llm.llm_engine.stats()["prefix_hit_tokens"]
    finally:
        llm.shutdown()
    ref = hf_greedy_argmax(path, PROMPTS, MAX_TOKENS, device="cuda")
    assert first == ref
    assert again == ref
    assert hits > 0
