"""Prompt logprobs (vLLM's `prompt_logprobs`) and completions' `echo` with `logprobs`, exact against
the log-softmax of Hugging Face transformers' logits over the same prompt, on models/tandem-tiny:
through the engine with chunked prefill and a warm prefix cache, and through the openai SDK."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from router.openai_api import create_openai_app
from tests.models import hf_model
from tests.serving import LiveServer, make_backend
from workers.sampling_params import SamplingParams

TINY = str(Path(__file__).resolve().parents[1] / "models" / "tandem-tiny")
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
TOL = 1e-4


def hf_prompt_logprobs(ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log-softmax at positions 0..n-2 (predicting tokens 1..n-1)."""
    with torch.no_grad():
        logits = hf_model(TINY)(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


@pytest.fixture(scope="module")
def llm():
    from engine.llm import LLM

    # 32-token steps: the prompt is prefilled over several chunks
    return LLM(model=TINY, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=32)


def test_engine_prompt_logprobs_equal_hf_across_chunks_and_cache(llm):
    ids = llm.llm_engine.tokenizer.encode(TEXT)
    assert len(ids) > 40
    ref = hf_prompt_logprobs(ids)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    for attempt in range(2):  # the second run finds the prompt's blocks cached, and must not use them
        out = llm.generate([ids], params)[0]
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for pos in range(1, len(ids)):
            entry = lps[pos]
            assert math.isclose(entry[ids[pos]], ref[pos - 1, ids[pos]].item(), abs_tol=TOL), (attempt, pos)
            top = ref[pos - 1].topk(3)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert math.isclose(entry[tid], lp, abs_tol=TOL)
    plain = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # the cache still serves others


@pytest.fixture(scope="module")
def oa():
    import openai

    live = LiveServer(create_openai_app(make_backend(TINY)))
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    live.stop()


def test_echo_with_logprobs_equals_hf_through_the_sdk(oa):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    ids = tok.encode(TEXT)
    ref = hf_prompt_logprobs(ids)
    # lm-evaluation-harness's loglikelihood request: echo, logprobs, one token, greedy
    r = oa.completions.create(model="tandem-tiny", prompt=TEXT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = r.choices[0]
    assert choice.text.startswith(TEXT)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
    for pos in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[pos], ref[pos - 1, ids[pos]].item(), abs_tol=TOL), pos
    assert "".join(lp.tokens[:len(ids)]) == TEXT and lp.text_offset[len(ids)] == len(TEXT)
    # vLLM's prompt_logprobs field, streamed too; echo alone (no logprobs) only prefixes the text
    streamed = list(oa.completions.create(model="tandem-tiny", prompt=ids, max_tokens=2, temperature=0, stream=True,
                                          extra_body={"prompt_logprobs": 0}))
    field = streamed[0].choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for pos in range(1, len(ids)):
        [(key, entry)] = field[pos].items()
        assert int(key) == ids[pos] and math.isclose(entry["logprob"], ref[pos - 1, ids[pos]].item(), abs_tol=TOL)
    echoed = oa.completions.create(model="tandem-tiny", prompt=TEXT, echo=True, max_tokens=3, temperature=0)
    plain = oa.completions.create(model="tandem-tiny", prompt=TEXT, max_tokens=3, temperature=0)
    assert echoed.choices[0].text == TEXT + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_chat_prompt_logprobs_cover_the_templated_prompt(oa):
    r = oa.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                   extra_body={"prompt_logprobs": 2})
    field = r.model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == r.usage.prompt_tokens
    assert all(1 <= len(e) <= 3 and all(v["rank"] in (None, 1, 2) for v in e.values()) for e in field[1:])


@pytest.mark.slow
def test_prompt_logprobs_under_tp2_and_pp2_ranks_equal_hf(shared_ray):
    """Ray rank actors: the logits are gathered over 2 TP ranks, or come from the last of 2 pipeline
    stages, and the answer travels back through the step channel (workers/step_delta.py)."""
    from engine.llm import LLM

    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(TINY).encode(TEXT)
    ref = hf_prompt_logprobs(ids)
    for layout in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):  # on the session's Ray (conftest.py)
        llm = LLM(model=TINY, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=32,
                  distributed_executor_backend="ray", **layout)
        try:
            out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
        finally:
            llm.shutdown()
        for pos in range(1, len(ids)):
            assert math.isclose(out.prompt_logprobs[pos][ids[pos]], ref[pos - 1, ids[pos]].item(), abs_tol=TOL), (layout, pos)
