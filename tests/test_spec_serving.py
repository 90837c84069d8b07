"""Speculative decoding in the served app (issue 16): `speculative_config` in the app config, streamed and
unary completions equal to plain decoding (several tokens per engine step reach the client whole, with a
logprob each), and the counters on /metrics. In-process (LocalBackend), no Ray."""
from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from router.openai_api import create_openai_app
from tests.serving import ENGINE_KWARGS, build_chat_model, make_backend, wait_idle
from tandem import LLM, SamplingParams

NAME = "spec-llama"
PROMPT = "numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 numbers: 0 1 2 3"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


@pytest.fixture(scope="module")
def served(model):
    backend = make_backend(model, speculative_config=SPEC)
    client = TestClient(create_openai_app(backend))
    client.__enter__()
    yield client, backend
    client.portal.call(backend.close)
    client.__exit__(None, None, None)


def test_served_speculation_matches_plain_and_reports_metrics(served, model):
    client, backend = served
    ref = LLM(model, show_progress=False, **ENGINE_KWARGS).generate(
        PROMPT, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == ref.text
    assert len(choice["logprobs"]["tokens"]) == len(ref.token_ids) == 32

    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        frames = [f[len("data: "):] for f in s.read().decode().split("\n\n") if f and f != "data: [DONE]"]
    chunks = [json.loads(f)["choices"][0] for f in frames if json.loads(f)["choices"]]
    assert "".join(c["text"] for c in chunks) == ref.text
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == 32  # every token of a multi-token step

    stats = wait_idle(lambda: client.portal.call(backend.stats))
    assert stats["spec_decode_num_accepted_tokens"] > 0
    text = client.get("/metrics").text
    drafted = re.search(r'^tandem_spec_decode_num_draft_tokens_total\{model_name="[^"]+",pool="colocated",replica="[^"]+"\} (\S+)$', text, re.M)
    accepted = re.search(r'^tandem_spec_decode_num_accepted_tokens_total\{model_name="[^"]+",pool="colocated",replica="[^"]+"\} (\S+)$', text, re.M)
    assert drafted and accepted, text
    assert float(drafted.group(1)) == stats["spec_decode_num_draft_tokens"]
    assert float(accepted.group(1)) == stats["spec_decode_num_accepted_tokens"]
    assert re.search(r'^tandem_spec_decode_num_accepted_tokens_per_pos_total\{model_name="[^"]+",pool="colocated",position="0",replica="[^"]+"\} ', text, re.M)


def test_app_config_refuses_a_bad_speculative_config():
    from router.config import AppConfig

    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        AppConfig(colocated=True, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
