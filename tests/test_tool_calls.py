"""Tool calling on /v1/chat/completions: tools rendered by the model's chat template, transcripts with
assistant tool_calls and tool results, and Hermes-style `<tool_call>` output parsed into OpenAI
tool_calls, non-streamed and streamed.

The tiny model cannot write valid JSON, so the parsing tests run its requests through a backend whose
output is scripted (the real engine still runs the template and the request checks).
"""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from engine.llm_engine import RequestOutput
from router.openai_api import create_openai_app
from router.tool_parsers import HermesStream, parse_tool_calls
from tests.models import BOS_TOKEN, EOS_TOKEN
from tests.serving import LiveServer, build_chat_model, make_backend

NAME = "tools-llama"
CHAT = "/v1/chat/completions"

# A Hermes/Qwen2.5-style template in the tiny tokenizer's special tokens: tools in a system turn,
# assistant tool calls as <tool_call> JSON (arguments | tojson: an object), tool results as their own turn.
TOOLS_TEMPLATE = (
    "{% if tools %}" + BOS_TOKEN + "system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}" + EOS_TOKEN
    + "\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}" + BOS_TOKEN + "assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}" + EOS_TOKEN + "\n"
    "{% elif m['role'] == 'tool' %}" + BOS_TOKEN + "tool\n<tool_response>{{ m['content'] }}</tool_response>" + EOS_TOKEN
    + "\n{% else %}" + BOS_TOKEN + "{{ m['role'] }}\n{{ m['content'] }}" + EOS_TOKEN + "\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + BOS_TOKEN + "assistant\n{% endif %}"
)

# Small: the tiny model's context is 256 tokens of a near-byte-level vocabulary.
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"properties": {"city": {}}}}}
TIME = {"type": "function", "function": {"name": "time"}}
ASK = [{"role": "user", "content": "Paris?"}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = 'Let me check.' + CALL + '\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME, TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def backend(model):
    return make_backend(model)


class Scripted:
    """The real backend, except that every request's output is `script`, in pieces of `step` chars."""

    def __init__(self, inner, script: str = "", step: int = 3):
        self._inner, self.script, self.step = inner, script, step
        self.prompts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, req):
        self.prompts.append(req.prompt_token_ids)
        pieces = [self.script[k:k + self.step] for k in range(0, len(self.script), self.step)] or [""]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(req.request_id, req.prompt_token_ids, token_ids=[5] * (k + 1),
                                text="".join(pieces[:k + 1]), new_token_ids=[5], new_text=piece,
                                finish_reason="stop" if last else None)


@pytest.fixture(scope="module")
def scripted(backend):
    fake = Scripted(backend)
    client = TestClient(create_openai_app(fake))
    client.__enter__()
    yield client, fake
    client.__exit__(None, None, None)
    with TestClient(create_openai_app(backend)) as c:  # the real engine's loop lives on a portal
        c.portal.call(backend.close)


def _events(text: str) -> list[dict]:
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def _post(client, fake, script: str, **body) -> dict:
    fake.script = script
    r = client.post(CHAT, json={"messages": ASK, "tools": [WEATHER, TIME], **body})
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else {"events": _events(r.text)}


# ---------------------------------------------------------------- the parser alone


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_stream_parser_equals_whole_parse(step):
    for text in (CALL, TWO_CALLS, "no calls < here <tool", "x<tool_call>{not json", "a<tool_call>{\"name\": \"f\"}"):
        stream, content, calls = HermesStream(), "", []
        pieces = [text[k:k + step] for k in range(0, len(text), step)]
        for k, piece in enumerate(pieces):
            c, new = stream.feed(piece, final=k == len(pieces) - 1)
            content, calls = content + c, calls + new
        whole_content, whole_calls = parse_tool_calls(text)
        assert (content or None) == whole_content, text
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls], text


# ---------------------------------------------------------------- parsed replies (scripted output)


def test_tool_call_parsed_non_streamed(scripted):
    client, fake = scripted
    body = _post(client, fake, TWO_CALLS)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("function", "weather", {"city": "Paris"}), ("function", "time", {})]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    one = _post(client, fake, TWO_CALLS, parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in one] == ["weather"]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_tool_call_parsed_streamed(scripted, step):
    client, fake = scripted
    fake.step = step
    events = _post(client, fake, TWO_CALLS, stream=True)["events"]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Let me check." and "<tool" not in content
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "weather", {"city": "Paris"}), (1, "time", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_text_that_is_not_a_call_stays_content(scripted, stream):
    client, fake = scripted
    fake.step = 3
    for script in ("It is sunny < 30 degrees.", 'Oops <tool_call>{"name": broken json</tool_call>'):
        body = _post(client, fake, script, stream=stream)
        if stream:
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in body["events"])
            finish = body["events"][-1]["choices"][0]["finish_reason"]
            assert not any("tool_calls" in e["choices"][0]["delta"] for e in body["events"])
        else:
            msg, finish = body["choices"][0]["message"], body["choices"][0]["finish_reason"]
            content = msg["content"]
            assert "tool_calls" not in msg
        assert content == script and finish == "stop"


def test_tool_choice_none_leaves_text_alone(scripted):
    client, fake = scripted
    body = _post(client, fake, CALL, tool_choice="none")
    assert body["choices"][0]["message"]["content"] == CALL and body["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------- the template and the transcript (real engine)


def test_tools_rendered_by_the_template(scripted, model):
    client, fake = scripted
    tok = AutoTokenizer.from_pretrained(model)
    for choice, shown in (("auto", [WEATHER, TIME]), ("required", [WEATHER, TIME]),
                          ({"type": "function", "function": {"name": "time"}}, [TIME])):
        _post(client, fake, CALL, tool_choice=choice)
        want = tok.apply_chat_template(ASK, tools=shown, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert fake.prompts[-1] == list(want), choice
        assert "weather" in tok.decode(fake.prompts[-1]) or shown == [TIME]


def test_transcript_with_tool_calls_and_results(backend, model):
    tok = AutoTokenizer.from_pretrained(model)
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    with TestClient(create_openai_app(backend)) as client:
        # No tools in this request: the transcript alone must fit the tiny model's 256 tokens.
        r = client.post(CHAT, json={"messages": messages, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        as_template = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
        want = tok.apply_chat_template(as_template, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert '"arguments": {"city": "Paris"}' in tok.decode(want)  # an object, not JSON text in a string
        bad = [*messages[:1], {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}]}]
        assert client.post(CHAT, json={"messages": bad}).json()["error"]["param"] == "messages"


BAD_TOOLS = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOLS, ids=[str(i) for i in range(len(BAD_TOOLS))])
def test_bad_tool_requests_are_400(scripted, extra, param):
    client, _ = scripted
    r = client.post(CHAT, json={"messages": ASK, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_template_without_tools_is_400(tmp_path):
    folder = build_chat_model(tmp_path / "no-tools")  # tests/serving.py's template ignores tools
    backend = make_backend(folder)
    with TestClient(create_openai_app(backend)) as client:
        r = client.post(CHAT, json={"messages": ASK, "tools": [WEATHER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        client.portal.call(backend.close)


# ---------------------------------------------------------------- a round trip with the openai SDK


def test_openai_sdk_tool_round_trip(backend):
    import openai

    fake = Scripted(backend, CALL)
    server = LiveServer(create_openai_app(fake))
    try:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        first = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="auto")
        [call] = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        fake.script = "It is 18 C and sunny in Paris."
        transcript = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
        second = oa.chat.completions.create(model=NAME, messages=transcript, tools=[WEATHER])
        assert second.choices[0].message.content == fake.script and second.choices[0].finish_reason == "stop"
        assert "<tool_response>18C</tool_response>" in backend.tokenizer.decode(fake.prompts[-1])
        streamed = list(oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=True))
        assert streamed[-1].choices[0].finish_reason == "stop"  # the script is plain text now
    finally:
        server.stop()
