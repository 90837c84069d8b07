"""The OpenAI front end's request surface beyond the basics (issue 17): unknown fields accepted and
logged, known-but-unsupported ones refused by name, chat_template_kwargs, continuous usage stats.

A real LocalBackend over the tiny chat model of tests/serving.py, through FastAPI's TestClient; the
openai SDK over a real socket where a client's own behaviour matters.
"""
from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from router.openai_api import create_openai_app
from tests.models import BOS_TOKEN, EOS_TOKEN
from tests.serving import LiveServer, build_chat_model, make_backend, wait_idle

NAME = "surface-llama"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]

# The test template reads one variable a client sets through chat_template_kwargs (as Qwen3's reads
# `enable_thinking`), so the prompt the model sees shows whether the kwarg reached the template.
TEMPLATE = (
    "{% if shout %}SHOUT{% endif %}"
    "{% for m in messages %}" + BOS_TOKEN + "{{ m['role'] }}\n{{ m['content'] }}" + EOS_TOKEN + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + BOS_TOKEN + "assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME, TEMPLATE)


@pytest.fixture(scope="module")
def served(model):
    backend = make_backend(model)
    client = TestClient(create_openai_app(backend))
    client.__enter__()
    yield client, backend
    client.portal.call(backend.close)
    client.__exit__(None, None, None)


@pytest.fixture
def client(served):
    client, backend = served
    yield client
    wait_idle(lambda: client.portal.call(backend.stats))


def _events(text: str) -> list[dict]:
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


# ---------------------------------------------------------------- unknown and unsupported fields


def test_unknown_fields_are_accepted_and_logged_once_per_name(client, caplog):
    body = {"messages": [{"role": "user", "content": "Hi", "x_msg_note": 1}], "max_tokens": 3, "temperature": 0,
            "x_client_tag": "abc", "stream": True, "stream_options": {"include_usage": True, "x_future_opt": 1}}
    with caplog.at_level(logging.WARNING, logger="router.openai_protocol"):
        for _ in range(2):
            r = client.post(CHAT, json=body)
            assert r.status_code == 200, r.text
            assert _events(r.text)[-1]["usage"]["completion_tokens"] == 3
    logged = [rec.getMessage() for rec in caplog.records if "ignoring unknown request field" in rec.getMessage()]
    for name in ("'x_client_tag'", "'stream_options.x_future_opt'", "'messages[].x_msg_note'"):
        assert sum(name in m for m in logged) == 1, logged  # once, though sent twice
    assert all(rec.levelno == logging.WARNING for rec in caplog.records if "unknown request field" in rec.getMessage())


def test_unknown_field_does_not_change_the_answer(client):
    req = {"prompt": "The quick brown", "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    extra = client.post("/v1/completions", json={**req, "max_tokenz": 1, "whatever": {"a": [1]}})
    assert extra.status_code == 200 and extra.json()["choices"][0]["text"] == plain


UNSUPPORTED = [
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    (CHAT, {"messages": HELLO, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    (CHAT, {"messages": HELLO, "chat_template": "{{ messages }}"}, "chat_template"),
    (CHAT, {"messages": HELLO, "functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"messages": HELLO, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    (CHAT, {"messages": HELLO, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
]


@pytest.mark.parametrize("endpoint,body,param", UNSUPPORTED, ids=[p for _, _, p in UNSUPPORTED])
def test_known_but_unsupported_fields_are_400_naming_them(client, endpoint, body, param):
    r = client.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err


def test_unsupported_fields_at_their_unused_value_are_fine(client):
    body = {"prompt": "x", "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0, "guided_json": None,
            "bad_words": [], "spaces_between_special_tokens": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": HELLO, "max_tokens": 2, "response_format": {"type": "text"}, "parallel_tool_calls": True,
            "echo": False}
    assert client.post(CHAT, json=chat).status_code == 200


# ---------------------------------------------------------------- chat_template_kwargs, continue_final_message


def test_chat_template_kwargs_reach_the_template(client, model):
    tok = AutoTokenizer.from_pretrained(model)
    plain = client.post(CHAT, json={"messages": HELLO, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    r = client.post(CHAT, json={"messages": HELLO, "max_tokens": 1, "chat_template_kwargs": {"shout": True}})
    assert r.status_code == 200, r.text
    expected = tok.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True, return_dict=False, shout=True)
    assert r.json()["usage"]["prompt_tokens"] == len(expected) > plain


def test_continue_final_message_extends_the_assistant_turn(client, model):
    tok = AutoTokenizer.from_pretrained(model)
    messages = HELLO + [{"role": "assistant", "content": "Well, the"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 1, "add_generation_prompt": False,
                                "continue_final_message": True})
    assert r.status_code == 200, r.text
    ids = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False)
    assert tok.decode(ids).endswith("Well, the")  # no end-of-turn token after the partial message
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


# ---------------------------------------------------------------- continuous usage stats


@pytest.mark.parametrize("endpoint", ["/v1/completions", CHAT])
def test_continuous_usage_stats_on_every_chunk(client, endpoint):
    prompt = {"prompt": "Once upon"} if endpoint == "/v1/completions" else {"messages": HELLO}
    req = {**prompt, "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(client.post(endpoint, json=req).text)
    *chunks, closing = events
    assert closing["choices"] == [] and closing["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is not None for c in chunks)
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert used == sorted(used) and used[-1] == 10  # grows with the output, ends at the closing count
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {closing["usage"]["prompt_tokens"]}
    # Without include_usage there is no usage at all (vLLM: continuous stats need it).
    plain = _events(client.post(endpoint, json={**req, "stream_options": {"continuous_usage_stats": True}}).text)
    assert all("usage" not in c for c in plain)


# ---------------------------------------------------------------- a real client


@pytest.fixture(scope="module")
def live(model):
    backend = make_backend(model)
    server = LiveServer(create_openai_app(backend))
    yield server
    server.call(backend.close)
    server.stop()


def test_openai_sdk_with_the_fields_clients_always_send(live):
    import openai

    oa = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    stream = oa.chat.completions.create(
        model=NAME, messages=HELLO, max_tokens=4, temperature=0, stream=True, parallel_tool_calls=False,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"chat_template_kwargs": {"shout": True}, "some_vendor_field": 1})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is not None for c in chunks)
