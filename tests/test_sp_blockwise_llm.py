"""`LLM(...)` under SP=2 (ring and Ulysses) and SP=4 (ring) (Ray actors, gloo on CPU) against one
rank and against Hugging Face: a 300-token prompt gives each rank more queries than one query tile
(128 on CPU) in a single prefill step, shorter prompts leave some ranks no block at all, and greedy
decoding continues on the KV the SP prefill left spread over the ranks.
"""
from __future__ import annotations

import pytest

from engine.llm import LLM
from parallel.ring_attention import CPU_TILES
from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 5
LENGTHS = [300, 3, 37, 129]
PROMPTS = prompts_of_lengths(LENGTHS, vocab_size=290, seed=25)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(block_size=8, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512,
                   num_gpu_blocks_override=64, show_progress=False)


@pytest.fixture(scope="module", autouse=True)
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py)


def _greedy(path: str, **kwargs) -> list[list[int]]:
    llm = LLM(path, **{**ENGINE_ARGS, **kwargs})
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def test_sp2_and_sp4_match_one_rank_and_hf():
    assert LENGTHS[0] // 2 > CPU_TILES[0]  # at SP=2 a rank's queries of the long prompt span two query tiles
    path = tiny_model("llama", max_position_embeddings=512)
    hf = hf_greedy_argmax(path, PROMPTS, MAX_TOKENS)
    one = _greedy(path)
    assert one == hf
    assert _greedy(path, sequence_parallel_size=2, sequence_parallel_attention="ring") == hf
    assert _greedy(path, sequence_parallel_size=2, sequence_parallel_attention="ulysses") == hf
    # SP=4: auto is the ring (and Ulysses could not split 2 KV heads over 4 ranks: tests/test_ulysses.py
    # runs Ulysses at SP=4 on its own ranks).
    assert _greedy(path, sequence_parallel_size=4, num_gpu_blocks_override=32) == hf


def test_ulysses_where_heads_do_not_divide_is_refused_before_any_rank_starts():
    path = tiny_model("llama", max_position_embeddings=512)  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"sequence_parallel_attention='ulysses' needs .* divisible by "
                                         r"sequence_parallel_size=4; this model has 4 query and 2 KV heads"):
        LLM(path, **{**ENGINE_ARGS, "sequence_parallel_size": 4, "sequence_parallel_attention": "ulysses"})
