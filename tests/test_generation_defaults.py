"""Model defaults from generation_config.json (vLLM's `--generation-config auto`): they fill the
sampling fields a request leaves unset, on the served path and in `LLM.get_default_sampling_params()`;
`generation_config="vllm"` turns them off; explicit values always win."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.openai_api import create_openai_app
from tests.serving import ENGINE_KWARGS, build_chat_model, make_backend
from tandem import LLM, SamplingParams

DEFAULTS = {"temperature": 0.6, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 7}
AS_PARAMS = dict(temperature=0.6, top_k=5, top_p=0.9, repetition_penalty=1.3, max_tokens=7)
PROMPT = "The quick brown fox"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = build_chat_model(tmp_path_factory.mktemp("models") / "gen-defaults")
    path = Path(folder, "generation_config.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **DEFAULTS}))
    return folder


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, show_progress=False, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def plain_llm(model):
    return LLM(model, show_progress=False, generation_config="vllm", **ENGINE_KWARGS)


def _client(backend) -> TestClient:
    client = TestClient(create_openai_app(backend))
    client.__enter__()
    return client


@pytest.fixture(scope="module")
def served(model):
    backend = make_backend(model)
    client = _client(backend)
    yield client
    client.portal.call(backend.close)
    client.__exit__(None, None, None)


def test_offline_default_sampling_params(llm, plain_llm):
    assert llm.get_default_sampling_params() == SamplingParams(**AS_PARAMS)
    assert plain_llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate(PROMPT)[0]  # no params: the model's defaults, max_new_tokens included
    assert len(out.token_ids) <= 7


def test_offline_explicit_params_are_used_as_given(llm, plain_llm):
    # vLLM's LLM does not merge the model's defaults into SamplingParams the caller passed.
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert llm.generate(PROMPT, p)[0].token_ids == plain_llm.generate(PROMPT, p)[0].token_ids
    with_penalty = plain_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                             repetition_penalty=1.3))[0]
    assert with_penalty.token_ids != llm.generate(PROMPT, p)[0].token_ids  # the penalty matters on this model


def test_served_request_takes_the_model_defaults_for_unset_fields(served, llm):
    # Seeded, so sampling is reproducible: the unset fields must be exactly the model's.
    r = served.post("/v1/completions", json={"prompt": PROMPT, "seed": 7, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ref = llm.generate(PROMPT, SamplingParams(**AS_PARAMS, seed=7, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == ref.text and r.json()["usage"]["completion_tokens"] == 7
    # A field the request sets wins; the others still come from the model.
    r = served.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": 20, "ignore_eos": True})
    greedy = llm.generate(PROMPT, SamplingParams(**{**AS_PARAMS, "temperature": 0, "max_tokens": 20}, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == greedy.text and r.json()["usage"]["completion_tokens"] == 20
    unpenalised = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert greedy.text != unpenalised.text  # so the equality above shows the model's repetition_penalty applied


def test_chat_without_max_tokens_stops_at_max_new_tokens(served):
    r = served.post("/v1/chat/completions", json={"messages": HELLO, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    r = served.post("/v1/chat/completions", json={"messages": HELLO, "ignore_eos": True, "max_completion_tokens": 9})
    assert r.json()["usage"]["completion_tokens"] == 9


def test_generation_config_vllm_turns_the_defaults_off(model, plain_llm):
    backend = make_backend(model, generation_config="vllm")
    client = _client(backend)
    try:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "seed": 7, "ignore_eos": True})
        ref = plain_llm.generate(PROMPT, SamplingParams(seed=7, ignore_eos=True))[0]  # 16 tokens at temperature 1
        assert r.json()["choices"][0]["text"] == ref.text and r.json()["usage"]["completion_tokens"] == 16
    finally:
        client.portal.call(backend.close)
        client.__exit__(None, None, None)


def test_unusable_defaults_are_refused_by_name(tmp_path):
    folder = build_chat_model(tmp_path / "bad-defaults")
    path = Path(folder, "generation_config.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "top_p": 1.5}))
    with pytest.raises(ValueError, match="generation_config"):
        LLM(folder, show_progress=False, **ENGINE_KWARGS)
    LLM(folder, show_progress=False, generation_config="vllm", **ENGINE_KWARGS).shutdown()
