"""`LLM(...)` with sequence parallelism (ring attention) and expert parallelism (all-to-all MoE)
against one rank and against Hugging Face (Ray actors, gloo on CPU).

SP runs with 4-token blocks, so every prompt spans several blocks per rank; a small step budget mixes
chunked prefills with decodes, a small cache forces preemptions, and a second round over the same
prompts is served partly from the prefix cache.
"""
from __future__ import annotations

import pytest

from parallel.config import ParallelConfig
from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
from engine.llm import LLM
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
PROMPTS = prompts_of_lengths([5, 17, 9, 41, 3, 26], vocab_size=290, seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(block_size=4, max_num_batched_tokens=20, max_num_seqs=8, show_progress=False)


@pytest.fixture(scope="module", autouse=True)
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py), which LLM(...) joins


def generate(path: str, rounds: int = 1, **kwargs) -> tuple[list[list[list[int]]], dict]:
    """Greedy tokens of every round, and the engine's stats after the last."""
    llm = LLM(path, **{**ENGINE_ARGS, **kwargs})
    try:
        outs = [[o.token_ids for o in llm.generate(PROMPTS, GREEDY)] for _ in range(rounds)]
        return outs, llm.llm_engine.stats()
    finally:
        llm.shutdown()


def test_expert_parallel_size_must_span_a_stage():
    assert ParallelConfig(expert_parallel_size=2).tensor_parallel_size == 2  # alone: EP over 2 TP ranks
    assert ParallelConfig(expert_parallel_size=4, tensor_parallel_size=2, sequence_parallel_size=2).world_size == 4
    with pytest.raises(ValueError, match="expert_parallel_size .2. must be 1 or tensor_parallel_size"):
        ParallelConfig(expert_parallel_size=2, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="expert_parallel_size"):
        ParallelConfig(expert_parallel_size=3, sequence_parallel_size=2)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_expert_parallel_matches_one_rank_and_hf(name: str):
    path = tiny_model(name)
    hf = hf_greedy_argmax(path, PROMPTS, MAX_TOKENS)
    (one,), _ = generate(path)
    (ep,), _ = generate(path, expert_parallel_size=2)
    assert one == hf
    assert ep == hf


@pytest.mark.parametrize("sp_attention", ["ring", "ulysses"])
def test_sequence_parallel_matches_one_rank_and_hf(sp_attention: str):
    path = tiny_model("llama")
    hf = hf_greedy_argmax(path, PROMPTS, MAX_TOKENS)
    # 14 blocks of 4 tokens per rank: the 41-token prompt alone takes 6 blocks of each rank's 14.
    (one, one_again), _ = generate(path, rounds=2, num_gpu_blocks_override=28)
    (sp, sp_again), stats = generate(path, rounds=2, num_gpu_blocks_override=14, sequence_parallel_size=2,
                                     sequence_parallel_attention=sp_attention)
    assert one == one_again == hf
    assert sp == hf and sp_again == hf
    assert stats["num_blocks"] == 28  # two pools of 14
    assert stats["prefix_hit_tokens"] > 0
    assert stats["preemptions"] > 0


def test_sequence_and_expert_parallel_together_match_hf():
    path = tiny_model("qwen3_moe_nonorm")
    (sp_ep,), _ = generate(path, sequence_parallel_size=2, expert_parallel_size=2)
    assert sp_ep == hf_greedy_argmax(path, PROMPTS, MAX_TOKENS)
