"""The Llama-3 JSON tool-call format (vLLM's `llama3_json` parser) and the served `tool_call_parser`
setting (vLLM's `--tool-call-parser`): whole replies, streamed replies in any chunking (the same calls
as the whole parse, sent as OpenAI deltas: index, id and name first, then argument fragments), text
that is not a call, the setting on every surface, and the openai SDK through the app.

As in tests/test_tool_calls.py, the tiny model cannot write JSON, so the app tests script its output.
"""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from router.config import AppConfig
from router.openai_api import create_openai_app
from router.tool_parsers import (HERMES, LLAMA3_JSON, TOOL_CALL_PARSER_CHOICES, HermesStream, Llama3JsonStream,
                                 parse_llama3_json, parser_for)
from tandem import cli
from tests.models import BOS_TOKEN, EOS_TOKEN
from tests.serving import LiveServer, build_chat_model, make_backend
from tests.test_tool_calls import ASK, TIME, TOOLS_TEMPLATE, WEATHER, Scripted  # the Hermes tests' tools and question

NAME = "tools-llama3"
CHAT = "/v1/chat/completions"

# A Llama 3.1-style JSON template in the tiny tokenizer's tokens: tools in a system turn, the assistant's
# past calls as {"name", "parameters"} objects joined by "; ", tool results in an `ipython` turn.
LLAMA3_TEMPLATE = (
    "{% if tools %}" + BOS_TOKEN + "system\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}" + EOS_TOKEN
    + "\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}" + BOS_TOKEN + "assistant\n<|python_tag|>"
    "{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": "
    "{{ c['function']['arguments'] | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}" + EOS_TOKEN + "\n"
    "{% elif m['role'] == 'tool' %}" + BOS_TOKEN + "ipython\n{{ m['content'] }}" + EOS_TOKEN
    + "\n{% else %}" + BOS_TOKEN + "{{ m['role'] }}\n{{ m['content'] }}" + EOS_TOKEN + "\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + BOS_TOKEN + "assistant\n{% endif %}"
)


ONE = '{"name": "weather", "parameters": {"city": "Paris"}}'
TWO = '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "time", "parameters": {}}'

# Replies that are calls: (text, [(name, arguments object)]).
CALLS = [
    (ONE, [("weather", {"city": "Paris"})]),
    ('{"name": "weather", "arguments": {"city": "Paris"}}', [("weather", {"city": "Paris"})]),
    ("<|python_tag|>" + ONE, [("weather", {"city": "Paris"})]),
    ("\n  <|python_tag|> \n" + ONE + "\n", [("weather", {"city": "Paris"})]),
    (TWO, [("weather", {"city": "Paris"}), ("time", {})]),
    (ONE + ";" + ONE + "\n;\n" + ONE, [("weather", {"city": "Paris"})] * 3),
    # Every JSON token kind, nesting, escapes, non-ASCII, numbers json.dumps writes differently.
    ('{"name": "book", "parameters": {"who": "Zo\\u00eb \\"Z\\"", "at": [1, -2.50, 1E2, true, false, null],'
     ' "where": {"city":"Köln","geo":{"lat":50.9,"lon":[6.9]}}, "empty": {}, "none": []}}',
     [("book", {"who": 'Zoë "Z"', "at": [1, -2.5, 100.0, True, False, None],
                "where": {"city": "Köln", "geo": {"lat": 50.9, "lon": [6.9]}}, "empty": {}, "none": []})]),
    ('{"name": "f", "arguments": "{\\"a\\": 1}"}', [("f", {"a": 1})]),  # arguments already a JSON string
    ('{"parameters": {"a": 1}, "name": "f"}', [("f", {"a": 1})]),  # the other key order
]

# Replies that are not calls: the whole text is the content. Streamed, the same, since each shows
# that it is not a call before a call's name could go out.
NOT_CALLS = [
    "It is sunny in Paris.",
    "The call would be " + ONE,  # a call after text is not the format
    '{"answer": 42}',  # JSON, but not a call
    '{"name": "weather"}',  # no parameters or arguments
    '{"name": 5, "parameters": {}}',  # the name is not a string
    '{"name": "weather" "parameters": {}}',  # malformed: a comma missing before the name was read
    '{"name": "weather", "parameters" {"city": "Paris"}}',  # malformed: a colon missing
    '{"name": "weat',  # cut off inside the name
    "<|python_tag|>print('hello')",  # Llama 3.1's code-interpreter output
    "<|python_",
    "",
    "   ",
]
# Not calls either, but only after a call's name went out (streamed: what vLLM streams too, see
# test_after_a_call_went_out): (text, [(name, arguments) as streamed]).
LATE_NOT_CALLS = [
    ('{"name": "weather", "parameters": {"city": "Paris"}', [("weather", '{"city": "Paris"}')]),  # cut off
    ('{"name": "weather", "parameters": {"city": "Pa', [("weather", '{"city": ')]),  # cut off in a string
    ('{"name": "weather", "parameters": {"city": "Paris"} junk', [("weather", '{"city": "Paris"}')]),  # malformed
    (ONE + " and that is all.", [("weather", '{"city": "Paris"}')]),  # text after the calls
    (ONE + '; {"name": "time", "parameters": }', [("weather", '{"city": "Paris"}')]),  # malformed
    (ONE + "; [1, 2]", [("weather", '{"city": "Paris"}')]),  # the second object is not a call
]


def _chunks(text: str, step: int | None, rng: random.Random) -> list[str]:
    """`text` in pieces of `step` characters, or of random token-like sizes (1-6) when step is None."""
    pieces, k = [], 0
    while k < len(text):
        n = step or rng.randint(1, 6)
        pieces.append(text[k:k + n])
        k += n
    return pieces or [""]


def _stream(text: str, step: int | None, seed: int = 0) -> tuple[str, list[dict], list[int]]:
    """(content, tool_calls entries, the piece number each entry came with) of `text` fed in pieces."""
    stream, content, entries, at = Llama3JsonStream(), "", [], []
    pieces = _chunks(text, step, random.Random(seed))
    for k, piece in enumerate(pieces):
        c, new = stream.step(piece, final=k == len(pieces) - 1)
        content, entries, at = content + c, entries + new, at + [k] * len(new)
    return content, entries, at


def _assembled(entries: list[dict]) -> list[dict]:
    """The calls a client builds from tool_calls deltas, as the openai SDK does."""
    calls: dict[int, dict] = {}
    for e in entries:
        call = calls.setdefault(e["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = e.get("id", call["id"])
        call["name"] = e["function"].get("name", call["name"])
        call["arguments"] += e["function"].get("arguments", "")
    return [calls[k] for k in sorted(calls)]


# ---------------------------------------------------------------- the whole parse


@pytest.mark.parametrize("text,want", CALLS, ids=[str(i) for i in range(len(CALLS))])
def test_whole_reply_of_calls(text, want):
    content, calls = parse_llama3_json(text)
    assert content is None
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("function", n, a) for n, a in want]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls) and len({c["id"] for c in calls}) == len(calls)
    # Arguments as vLLM writes them: json.dumps of the object, non-ASCII kept.
    assert [c["function"]["arguments"] for c in calls] == [json.dumps(a, ensure_ascii=False) for _, a in want]


@pytest.mark.parametrize("text", NOT_CALLS + [t for t, _ in LATE_NOT_CALLS],
                         ids=[str(i) for i in range(len(NOT_CALLS) + len(LATE_NOT_CALLS))])
def test_whole_reply_that_is_not_calls_is_content(text):
    assert parse_llama3_json(text) == (text, [])


# ---------------------------------------------------------------- streamed


@pytest.mark.parametrize("step", [1, 2, 3, 7, None, 10_000])
@pytest.mark.parametrize("text", [t for t, _ in CALLS], ids=[str(i) for i in range(len(CALLS))])
def test_streamed_calls_equal_the_whole_parse(text, step):
    _, whole = parse_llama3_json(text)
    for seed in range(3 if step is None else 1):
        content, entries, _ = _stream(text, step, seed)
        assert content == ""
        calls = _assembled(entries)
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls) and len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("step", [1, 3, None])
def test_streamed_deltas_are_openai_shaped_name_first_then_argument_fragments(step):
    text = CALLS[6][0] + "; " + ONE  # a long call, then another
    _, entries, at = _stream(text, step, seed=1)
    seen: set[int] = set()
    for e in entries:
        if e["index"] not in seen:  # a call's first entry: index, id, type and name (arguments so far)
            seen.add(e["index"])
            assert set(e) == {"index", "id", "type", "function"} and e["type"] == "function"
            assert set(e["function"]) == {"name", "arguments"} and e["function"]["name"] in ("book", "weather")
        else:  # after it: argument fragments only
            assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            assert e["function"]["arguments"]
    assert [e["index"] for e in entries] == sorted(e["index"] for e in entries) and seen == {0, 1}
    first_call = [k for e, k in zip(entries, at) if e["index"] == 0]
    # Incremental: the name goes out long before the call's object closes, its arguments in many pieces.
    assert len(first_call) > 5 and first_call[0] < first_call[-1]


def test_call_name_goes_out_before_the_reply_ends():
    stream = Llama3JsonStream()
    assert stream.step("<|python_tag|>") == ("", [])
    assert stream.step('{"name": "weather", ') == ("", [])
    _, [entry] = stream.step('"parameters": {"ci')
    assert entry["function"] == {"name": "weather", "arguments": "{"} and entry["index"] == 0
    assert stream.step('ty": "Par') == ("", [{"index": 0, "function": {"arguments": '"city": '}}])
    assert stream.step('is"}}') == ("", [{"index": 0, "function": {"arguments": '"Paris"}'}}])
    assert stream.step("", final=True) == ("", [])


@pytest.mark.parametrize("step", [1, 2, 5, None, 10_000])
@pytest.mark.parametrize("text", NOT_CALLS, ids=[str(i) for i in range(len(NOT_CALLS))])
def test_streamed_text_that_is_not_calls_is_the_whole_parse_content(text, step):
    for seed in range(3 if step is None else 1):
        content, entries, _ = _stream(text, step, seed)
        assert (content, entries) == (text, [])


def test_plain_text_is_not_held_back():
    stream = Llama3JsonStream()
    assert stream.step("  ") == ("", [])  # blanks: "{" may still follow
    assert stream.step("<|py") == ("", [])  # may still be <|python_tag|>
    assert stream.step("thon") == ("", [])
    assert stream.step("!") == ("  <|python!", [])
    assert stream.step(" and more") == (" and more", [])
    json_answer = Llama3JsonStream()
    assert json_answer.step('{"answer": 4') == ("", [])  # might still be a call
    assert json_answer.step('2} so') == ('{"answer": 42} so', [])  # its object closed and is not a call
    assert json_answer.step(" there", final=True) == (" there", [])


@pytest.mark.parametrize("step", [1, 3, 10_000])
@pytest.mark.parametrize("text,sent", LATE_NOT_CALLS, ids=[str(i) for i in range(len(LATE_NOT_CALLS))])
def test_after_a_call_went_out(text, sent, step):
    """What vLLM's streaming does too: a call once sent stays sent; what follows that is not a call is
    dropped, never a half call in the content; a call cut off (max_tokens) keeps the argument fragments
    already sent."""
    content, entries, _ = _stream(text, step)
    assert content == "" and [(c["name"], c["arguments"]) for c in _assembled(entries)] == sent


def test_hermes_stream_step_gives_indexed_entries():
    stream = HermesStream()
    _, entries = stream.step('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>')
    _, more = stream.step('{"name": "b", "arguments": {"x": 1}}</tool_call>', final=True)
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in entries + more] == \
        [(0, "a", "{}"), (1, "b", '{"x": 1}')]


# ---------------------------------------------------------------- the tool_call_parser setting


def test_parser_setting_chooses_the_parser():
    assert TOOL_CALL_PARSER_CHOICES == ("auto", "hermes", "llama3_json")
    assert parser_for(TOOLS_TEMPLATE) is HERMES and parser_for(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert parser_for(None) is LLAMA3_JSON
    assert parser_for(TOOLS_TEMPLATE, "llama3_json") is LLAMA3_JSON
    assert parser_for(LLAMA3_TEMPLATE, "hermes") is HERMES
    assert parser_for(LLAMA3_TEMPLATE, "auto") is LLAMA3_JSON
    with pytest.raises(ValueError, match="'auto', 'hermes', 'llama3_json'.*not 'mistral'"):
        parser_for(LLAMA3_TEMPLATE, "mistral")


def test_parser_setting_on_every_surface(backend):
    # The Serve YAML / Python args.
    assert AppConfig(model="m").tool_call_parser == "auto"
    config = AppConfig(model="m", tool_call_parser="llama3_json")
    assert AppConfig.model_validate(config.to_args()).tool_call_parser == "llama3_json"  # what the replicas read
    with pytest.raises(ValidationError, match="'auto', 'hermes' or 'llama3_json'"):
        AppConfig(model="m", tool_call_parser="mistral")
    # The command line.
    _, config = cli.serve_spec(cli.build_parser().parse_args(["serve", "--tool-call-parser", "hermes"]))
    assert config.tool_call_parser == "hermes"
    # The app, and both served deployments' apps.
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        create_openai_app(backend, tool_call_parser="llama3")
    from router.colocated import ColocatedServer
    from router.disaggregated import Router

    for cls in (ColocatedServer, Router):
        replica = SimpleNamespace(backend=backend, config=AppConfig(model="m", tool_call_parser="llama3_json"))
        assert cls.__serve_build_asgi_app__(replica).state.server.tool_call_parser == "llama3_json"


def test_unknown_parser_flag_names_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--tool-call-parser", "mistral"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'mistral'" in err and "'llama3_json'" in err


# ---------------------------------------------------------------- through the app (scripted output)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    backend = make_backend(build_chat_model(tmp_path_factory.mktemp("models") / NAME, LLAMA3_TEMPLATE))
    yield backend
    with TestClient(create_openai_app(backend)) as c:  # the real engine's loop lives on a portal
        c.portal.call(backend.close)


def _events(text: str) -> list[dict]:
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


@pytest.mark.parametrize("setting", ["auto", "llama3_json", "hermes"])
def test_app_uses_the_chosen_parser(backend, setting):
    fake = Scripted(backend, TWO, step=2)
    with TestClient(create_openai_app(fake, tool_call_parser=setting)) as client:
        body = {"messages": ASK, "tools": [WEATHER, TIME]}
        msg = client.post(CHAT, json=body).json()["choices"][0]["message"]
        events = _events(client.post(CHAT, json={**body, "stream": True}).text)
        one = _events(client.post(CHAT, json={**body, "stream": True, "parallel_tool_calls": False}).text)
    deltas = [e["choices"][0]["delta"] for e in events]
    streamed = _assembled([c for d in deltas for c in d.get("tool_calls", [])])
    if setting == "hermes":  # this model's template writes Llama-3 JSON: hermes reads it as text
        assert msg["content"] == TWO and "tool_calls" not in msg
        assert "".join(d.get("content") or "" for d in deltas) == TWO and not streamed
        return
    assert msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [(c["name"], c["arguments"]) for c in streamed] == [("weather", '{"city": "Paris"}'), ("time", "{}")]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)
    assert sum(1 for d in deltas for c in d.get("tool_calls", []) if c["index"] == 0) > 1  # fragments
    only = _assembled([c for e in one for c in e["choices"][0]["delta"].get("tool_calls", [])])
    assert [c["name"] for c in only] == ["weather"]


def test_openai_sdk_round_trip_with_llama3_json(backend):
    import openai

    fake = Scripted(backend, TWO, step=3)
    server = LiveServer(create_openai_app(fake, tool_call_parser="llama3_json"))
    try:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        first = oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME])
        calls = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("weather", {"city": "Paris"}), ("time", {})]
        # Streamed: the SDK's own accumulator builds the same calls from the deltas.
        with oa.chat.completions.stream(model=NAME, messages=ASK, tools=[WEATHER, TIME]) as s:
            chunks = list(s)
            final = s.get_final_completion()
        assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in calls]
        assert final.choices[0].finish_reason == "tool_calls"
        assert sum(1 for c in chunks if c.type == "tool_calls.function.arguments.delta") > 2
        # The transcript goes back through the template, the calls as objects and the result as `ipython`.
        fake.script = "It is 18 C and sunny in Paris."
        transcript = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": calls[0].id, "content": "18C"},
                            {"role": "tool", "tool_call_id": calls[1].id, "content": "noon"}]
        second = oa.chat.completions.create(model=NAME, messages=transcript, tools=[WEATHER])
        assert second.choices[0].message.content == fake.script and second.choices[0].finish_reason == "stop"
        prompt = backend.tokenizer.decode(fake.prompts[-1])
        assert '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "time"' in prompt
        assert "ipython\n18C" in prompt
        streamed = list(oa.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == fake.script
        assert streamed[-1].choices[0].finish_reason == "stop"
    finally:
        server.stop()
