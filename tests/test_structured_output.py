"""Structured output (xgrammar): the bitmask on the rank, the grammar in the engine, the request
fields of both endpoints through the openai SDK on the shipped models/tandem-tiny (a random-ish model
forced into shape), tool_choice required/named, and (slow) the disaggregated app with a TP=2 prefill
pool, where the grammar follows the request to the decode pool.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.grammar import GrammarError, GrammarManager, check_structured_outputs
from router.openai_api import create_openai_app
from tests.models import build_model
from tests.serving import ENGINE_KWARGS, LiveServer, make_backend, shutdown_serve
from workers.sampling_params import SamplingParams, StructuredOutputs
from workers.scheduler_output import ScheduledSeq, SchedulerOutput, TokenBitmask
from workers.step_delta import StepDecoder, StepEncoder
from workers.structured_output import apply_bitmask_torch, apply_token_bitmask, unpack_bitmask

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "models" / "tandem-tiny")
CHAT = [{"role": "user", "content": "Describe a person."}]
# Bounded everywhere (string lengths, integer range, array size), so that a model that writes noise
# still closes the object well inside max_tokens.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "member": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                                                                  "items": {"enum": ["red", "blue"]}}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


# ---------------------------------------------------------------- the rank side: bitmask application


def _mask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = -(-vocab // 32)
    out = torch.zeros(len(allowed), words, dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            word = int(out[r, t // 32]) | (1 << (t % 32))
            out[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def _seq(seq_id: str) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [1], 0, [0], True, SamplingParams(), 0)


def test_bitmask_masks_only_the_constrained_rows_by_seq_id():
    vocab = 70  # not a multiple of 32; token 31 sits on the sign bit
    logits = torch.randn(3, vocab)
    before = logits.clone()
    mask = TokenBitmask(["c", "a"], _mask([[0, 31, 69], [5, 64]], vocab))
    apply_token_bitmask(logits, [_seq("a"), _seq("b"), _seq("c")], mask)
    assert torch.equal(logits[1], before[1])  # "b" is not constrained
    for row, allowed in ((0, {5, 64}), (2, {0, 31, 69})):
        kept = {i for i in range(vocab) if logits[row, i] != float("-inf")}
        assert kept == allowed
        assert all(logits[row, i] == before[row, i] for i in allowed)


def test_bitmask_narrower_than_the_logits_disallows_the_padding():
    logits = torch.zeros(1, 80)  # a padded lm_head: 80 columns, a 64-token grammar vocabulary
    apply_bitmask_torch(logits, torch.full((1, 2), -1, dtype=torch.int32), [0])
    assert (logits[0, :64] == 0).all() and (logits[0, 64:] == float("-inf")).all()
    assert unpack_bitmask(torch.tensor([[-1]], dtype=torch.int32), 32).all()


def test_step_delta_carries_the_bitmask_to_the_ranks():
    mask = TokenBitmask(["a"], _mask([[3]], 40))
    payload = StepEncoder().encode(SchedulerOutput([_seq("a")], token_bitmask=mask))
    got = StepDecoder().decode(payload).token_bitmask
    assert got.seq_ids == ["a"] and torch.equal(got.bitmask, mask.bitmask)


def test_bench_structured_output_dry_run():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_structured_output.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["batch"] == 4 and result["exact"] is True and result["torch_ms"] > 0


# ---------------------------------------------------------------- the engine side


@pytest.fixture(scope="module")
def llm():
    from engine.llm import LLM

    return LLM(model=TINY, dtype="float32", device="cpu", num_gpu_blocks_override=96)


def test_unhonourable_specs_raise_saying_why():
    with pytest.raises(GrammarError, match="Unsupported type"):
        check_structured_outputs(StructuredOutputs(kind="json", spec='{"type": "frobnicate"}'))
    with pytest.raises(GrammarError, match="parenthesis"):
        check_structured_outputs(StructuredOutputs(kind="regex", spec="(ab"))
    with pytest.raises(GrammarError, match="not defined"):
        check_structured_outputs(StructuredOutputs(kind="grammar", spec='root ::= "a" | b'))


def test_engine_output_follows_each_kind_of_constraint(llm):
    import re

    prompts = ["import os\n", "def f(x):", "Hello"]
    cases = [("json", json.dumps(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
             ("regex", r"[a-c]{3}-\d{2}", lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t) is not None),
             ("choice", json.dumps(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
             ("grammar", 'root ::= "x" [0-9] [0-9]? "y"', lambda t: re.fullmatch(r"x\d\d?y", t) is not None)]
    for kind, spec, valid in cases:
        for temperature in (0.0, 1.0):
            so = StructuredOutputs(kind=kind, spec=spec)
            outs = llm.generate(prompts, SamplingParams(max_tokens=120, temperature=temperature, seed=7, structured_outputs=so))
            for out in outs:
                # ends by the grammar's EOS, never by length, and matches
                assert out.finish_reason == "stop" and valid(out.text), (kind, temperature, out.text)
    free = llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0.0))[0].text
    assert not free.startswith("{")  # the constraint, not the model, made the JSON above
    # json_object: any object (its strings are unbounded, so the tiny model may not close it in time)
    anything = StructuredOutputs(kind="json_object")
    for out in llm.generate(prompts, SamplingParams(max_tokens=60, temperature=1.0, seed=1, structured_outputs=anything)):
        assert out.text.startswith("{") and (out.finish_reason == "length" or isinstance(json.loads(out.text), dict))


def test_grammar_manager_compiles_off_the_step_and_caches(llm):
    engine = llm.llm_engine
    manager = GrammarManager(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    so = StructuredOutputs(kind="choice", spec=json.dumps(["ab", "cd"]))
    manager.add("r1", so)
    manager.add("r2", so)
    assert manager.compile(so) is manager._compiled[so]  # one compile for both (a Future on the compile thread)
    mask = manager.bitmask([_seq("r1"), _seq("other")])
    assert mask.seq_ids == ["r1"] and mask.bitmask.shape == (1, -(-engine.vocab_size // 32))
    allowed = unpack_bitmask(mask.bitmask, engine.vocab_size)[0].nonzero().flatten().tolist()
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert texts and all(x and ("ab".startswith(x) or "cd".startswith(x)) for x in texts), texts
    assert engine.eos_token_ids[0] not in allowed  # EOS only in an accept state
    for t in engine.tokenizer.encode("ab"):
        assert not manager.accept("r1", t)
    eos_row = unpack_bitmask(manager.bitmask([_seq("r1")]).bitmask, engine.vocab_size)[0]
    assert eos_row.nonzero().flatten().tolist() == engine.eos_token_ids
    assert manager.accept("r1", engine.eos_token_ids[0])  # terminated
    manager.shutdown()


# ---------------------------------------------------------------- the OpenAI API, colocated, openai SDK


@pytest.fixture(scope="module")
def server():
    backend = make_backend(TINY)
    live = LiveServer(create_openai_app(backend))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def oa(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_json_schema_chat_always_validates(oa):
    replies = oa.chat.completions.create(model="tandem-tiny", messages=CHAT, response_format=RESPONSE_FORMAT,
                                         n=4, temperature=1.0, max_tokens=120)
    for choice in replies.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = oa.chat.completions.create(model="tandem-tiny", messages=CHAT, response_format=RESPONSE_FORMAT,
                                        n=2, temperature=1.0, max_tokens=120, stream=True, seed=3)
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_structured_outputs_and_guided_names(oa):
    for extra, check in (({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
                         ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
                         ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right") or pytest.fail(t)),
                         ({"guided_regex": r"\d{3}-[xy]"}, lambda t: len(t) == 5 and t[3] == "-" or pytest.fail(t))):
        for stream in (False, True):
            r = oa.completions.create(model="tandem-tiny", prompt="import os\n", max_tokens=120, temperature=1.0,
                                      stream=stream, extra_body=extra)
            text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
            check(text)


def test_unhonourable_or_conflicting_constraints_are_400(oa):
    import openai

    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
            "response_format", "Unsupported type"),
           ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "parenthesis"),
           ({"guided_choice": []}, "guided_choice", "non-empty"),
           ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
           ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured-output")]
    for body, param, why in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="tandem-tiny", messages=CHAT, max_tokens=4, extra_body=body)
        err = e.value.body
        assert err["param"] == param and why in err["message"], err


# ---------------------------------------------------------------- tool_choice required / named (real engine)

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "required": ["h"], "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}}}}


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    import openai

    from tests.test_tool_calls import TOOLS_TEMPLATE

    # 512 positions: two tools rendered by the template take 349 tokens of the near-byte-level vocabulary
    model = build_model("llama", tmp_path_factory.mktemp("models") / "tools-llama", max_position_embeddings=512)
    Path(model, "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    live = LiveServer(create_openai_app(make_backend(model)))
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    live.stop()


def test_forced_tool_calls_round_trip_with_the_sdk(tools_server):
    oa = tools_server
    ask = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "weather"}}
    first = oa.chat.completions.create(model="tools-llama", messages=ask, tools=[WEATHER, CLOCK], tool_choice=named,
                                       temperature=1.0)
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "weather" and first.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    transcript = ask + [first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    second = oa.chat.completions.create(model="tools-llama", messages=transcript, tools=[WEATHER], tool_choice="none",
                                        max_tokens=5, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content is not None

    required = oa.chat.completions.create(model="tools-llama", messages=ask, tools=[WEATHER, CLOCK],
                                          tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                          seed=5)  # no max_tokens: the context's room, the grammar ends it
    assert required.choices[0].finish_reason == "tool_calls"
    [call] = required.choices[0].message.tool_calls
    schema = {"weather": WEATHER, "clock": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    args, names = "", set()
    for chunk in oa.chat.completions.create(model="tools-llama", messages=ask, tools=[WEATHER, CLOCK], tool_choice=named,
                                            temperature=1.0, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            names.add(d.function.name) if d.function.name else None
            args += d.function.arguments or ""
    assert names == {"weather"}
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


# ---------------------------------------------------------------- disaggregated (slow): TP=2 prefill -> decode


@pytest.mark.slow
def test_json_schema_on_the_disaggregated_app(tmp_path, shared_ray):
    """Prefill on 2 TP ranks (the mask where the gathered logits are), decode on another replica that
    recompiles the grammar from the params and advances it over the handed-over first token."""
    import openai
    from ray import serve

    from parallel.net import free_port
    from router.app import build_app

    http_port = free_port()
    try:  # Serve on the session's Ray (tests/conftest.py)
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = {"model": TINY, **ENGINE_KWARGS, "max_num_seqs": 4, "local_prefill_max_tokens": 0,
                "local_prefill_when_idle": False,  # every request hands its KV (and its grammar) over
                "prefill": {"num_replicas": 1, "tensor_parallel_size": 2}, "decode": {"num_replicas": 1}}
        serve.run(build_app(args), name="tandem", route_prefix="/")
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = oa.chat.completions.create(model="tandem-tiny", messages=CHAT, response_format=RESPONSE_FORMAT,
                                           n=2, temperature=1.0, max_tokens=120)
        texts = [c.message.content for c in reply.choices]
        stream = oa.chat.completions.create(model="tandem-tiny", messages=CHAT, response_format=RESPONSE_FORMAT,
                                            temperature=1.0, max_tokens=120, stream=True, seed=11)
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        for text in texts:
            jsonschema.validate(json.loads(text), PERSON)
        guided = oa.completions.create(model="tandem-tiny", prompt="x", max_tokens=20, temperature=1.0,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
        assert guided.choices[0].text in ("alpha", "beta")
    finally:
        shutdown_serve()
