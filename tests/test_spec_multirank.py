"""Speculative decoding under tensor parallelism (Ray rank actors, gloo on CPU): drafts travel to both
ranks every step, the first rank verifies on the gathered logits, and rejected drafts' tail blocks are
freed and regrown between steps; greedy output equals one rank's plain output (issue 16)."""
import pytest

from tests.models import assert_engine_clean, tiny_model
from tests.test_spec_decode import NGRAM, PROMPTS, check_same, greedy, perturbed_copy
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_session(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py)


def test_tp2_speculation_equals_one_rank_plain(tmp_path):
    path = tiny_model("llama")
    kw = {"dtype": "float32", "device": "cpu", "show_progress": False, "block_size": 4}
    params = [greedy(20), greedy(20, logprobs=1), greedy(20), greedy(20)]
    ref = LLM(path, **kw).generate(PROMPTS, params)
    draft = perturbed_copy(path, tmp_path / "draft", 0.3)
    for spec in (NGRAM, {"model": draft, "num_speculative_tokens": 3}):
        tp = LLM(path, tensor_parallel_size=2, speculative_config=spec, **kw)
        try:
            check_same(ref, tp.generate(PROMPTS, params))
            seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
            assert tp.generate(PROMPTS[1], seeded)[0].token_ids == tp.generate(PROMPTS[1], seeded)[0].token_ids
            assert tp.get_metrics()["spec_decode_num_accepted_tokens"] > 0
            assert_engine_clean(tp)
        finally:
            tp.shutdown()
