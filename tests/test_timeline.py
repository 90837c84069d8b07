"""Issue 24 item 1: every served request has a timeline of wall-clock stamps from each process it
crosses, recorded as `tandem_request_stage_seconds{stage,site}` and, with `trace_requests`, logged as
one JSON line (`tandem.trace`) per finished request.

- the stage arithmetic (`router.metrics.stage_seconds`, `timeline_site`) on hand-made timelines;
- colocated: a LocalBackend behind the OpenAI app, streamed and unary;
- disaggregated (slow, Ray): a prefill replica (its rank a Ray actor) and a decode replica (its rank
  in-process) behind the same OpenAI app: a handed-off request has every stage, in order; a request
  prefilled on the decode replica, and one whose first token ends it, have theirs.
"""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator

import prometheus_client
import pytest
from fastapi.testclient import TestClient

from engine.llm_engine import LLMEngine, RequestOutput
from router import metrics
from router.openai_api import create_openai_app
from router.protocol import GenerateRequest
from tests.serving import build_chat_model, make_backend
from workers.config import EngineConfig
from workers.sampling_params import SamplingParams

NAME = "timeline-llama"
PROMPT = "the quick brown fox jumps over the lazy dog " * 3
# The stamps of a handed-off request, in the order they must happen (one host: one clock).
REMOTE_CHAIN = ("arrival", "replica_received", "reserved", "queued", "scheduled", "first_token", "prefill_answered",
                "kv_queued", "kv_push_start", "kv_send_start", "kv_send_end", "kv_push_end", "decode_started", "first_decode_step")
# Inside the push, the decode ranks' receive (the prefill ranks' send is in REMOTE_CHAIN).
RECV_CHAIN = ("kv_push_start", "kv_recv_start", "kv_recv_posted", "kv_recv_end", "kv_push_end")
ONE_ENGINE_CHAIN = ("arrival", "queued", "scheduled", "first_token", "first_decode_step")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / NAME)


def _traces(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tandem.trace"]


def _assert_in_order(ms: dict[str, float], chain: tuple[str, ...]) -> None:
    missing = [k for k in chain if k not in ms]
    assert not missing, f"stages missing: {missing} in {ms}"
    times = [ms[k] for k in chain]
    assert times == sorted(times), f"stages out of order: {list(zip(chain, times))}"


def _stage_count(stage: str, site: str) -> float:
    value = metrics.REGISTRY.get_sample_value("tandem_request_stage_seconds_count", {"stage": stage, "site": site})
    return value or 0.0


def _complete(client: TestClient, stream: bool, max_tokens: int = 4) -> None:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- stage arithmetic


def test_stages_of_each_site_and_skewed_clocks_clamp_to_zero():
    remote = {k: float(i) for i, k in enumerate(REMOTE_CHAIN)} | {"first_byte": 6.5}
    assert metrics.timeline_site(remote) == "remote"
    stages = metrics.stage_seconds(remote)
    assert set(stages) == {"dispatch", "reserve", "prefill_dispatch", "queue", "prefill", "prefill_return", "kv_wait",
                           "kv_push", "kv_send_hop", "kv_send", "decode_admission", "first_decode_step", "first_byte"}
    assert stages["kv_wait"] == 2.0 and stages["first_decode_step"] == 1.0  # from decode_started, not token 1
    assert stages["first_byte"] == 1.5  # token 1 (stamp 5.0) to the client
    local = {"arrival": 0.0, "replica_received": 0.1, "queued": 0.3, "scheduled": 0.4, "first_token": 0.6,
             "first_decode_step": 0.7, "first_byte": 0.65}
    assert metrics.timeline_site(local) == "local"
    assert metrics.stage_seconds(local)["engine_dispatch"] == pytest.approx(0.2)  # from the replica, not arrival
    colocated = {k: v for k, v in local.items() if k != "replica_received"}
    assert metrics.timeline_site(colocated) == "colocated"
    assert set(metrics.stage_seconds(colocated)) == {"engine_dispatch", "queue", "prefill", "first_decode_step",
                                                     "first_byte"}
    routed = remote | {"prefill_called": 0.5, "prefill_received": 0.75, "prefill_returned": 4.25, "router_answered": 4.5}
    routed_stages = metrics.stage_seconds(routed)  # router-driven prefill: its two Serve hops on token 1's path
    assert routed_stages["prefill_hop"] == 0.25 and routed_stages["prefill_answer"] == 0.25
    assert "prefill_hop" not in stages and "prefill_answer" not in stages
    skewed = {"queued": 10.0, "scheduled": 9.9}  # a prefill host whose clock runs behind
    assert metrics.stage_seconds(skewed) == {"queue": 0.0}


def test_timer_completes_the_final_output_timeline_and_traces_only_when_asked(caplog):
    out = RequestOutput("r-1", [1, 2], token_ids=[5, 6], new_token_ids=[6], finish_reason="length",
                        timeline={"queued": 100.0, "scheduled": 100.1, "first_token": 100.2})
    before = _stage_count("prefill", "colocated")
    with caplog.at_level(logging.INFO, logger="tandem.trace"):
        quiet = metrics.RequestTimer(trace=False)
        quiet.output(out)
        quiet.finish("ok")
        assert not _traces(caplog) and _stage_count("prefill", "colocated") == before + 1
        traced = metrics.RequestTimer(trace=True)
        traced.arrival = 99.9
        traced.output(out)
        traced.finish("ok")
    [line] = _traces(caplog)
    assert line["request_id"] == "r-1" and line["site"] == "colocated"
    assert list(line["ms"])[:4] == ["arrival", "queued", "scheduled", "first_token"]
    assert line["ms"]["queued"] == pytest.approx(100.0)
    assert out.timeline["arrival"] == 99.9 and out.timeline["first_byte"] >= out.timeline["first_token"]


# ---------------------------------------------------------------- colocated


def test_colocated_stream_and_unary_have_their_stages_in_order(model, caplog):
    backend = make_backend(model)
    before = _stage_count("prefill", "colocated")
    with TestClient(create_openai_app(backend, trace_requests=True)) as client:
        try:
            with caplog.at_level(logging.INFO, logger="tandem.trace"):
                _complete(client, stream=True)
                _complete(client, stream=False)
        finally:
            client.portal.call(backend.close)
    streamed, unary = _traces(caplog)
    for line in (streamed, unary):
        assert line["site"] == "colocated"
        _assert_in_order(line["ms"], ONE_ENGINE_CHAIN)
        assert line["ms"]["first_byte"] >= line["ms"]["first_token"]
    # A unary response's first byte is its whole body: after the last token, so after the first decode step.
    assert unary["ms"]["first_byte"] >= unary["ms"]["first_decode_step"]
    assert _stage_count("prefill", "colocated") == before + 2


# ---------------------------------------------------------------- disaggregated (Ray)


class ReplicaBackend:
    """The front ends' `Backend` over one `DecodeReplica` in this process: what `DecodePool` serves
    through Serve, less the Serve hops. Closing a stream aborts its request (DecodeReplica.generate)."""

    def __init__(self, decode, model_name: str):
        engine = decode.llm_engine
        self.decode, self.model_name = decode, model_name
        self.tokenizer, self.max_model_len, self.vocab_size = engine.tokenizer, engine.max_model_len, engine.vocab_size

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        async for out in self.decode.generate(req.request_id, req.prompt_token_ids, req.sampling_params, req.priority):
            yield out

    async def abort(self, request_id: str) -> None:
        return None  # every request here finishes; an unfinished one is aborted by closing its stream

    async def ready(self) -> bool:
        return self.decode.alive


@pytest.fixture(scope="module")
def pd(model, shared_ray):
    """A TestClient over the OpenAI app on a decode replica whose prefill pool is one prefill replica."""
    from engine.disagg import DecodeReplica, PrefillReplica

    common = dict(model=model, dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=64,
                  kv_transfer_timeout_seconds=30.0)
    engines: list[LLMEngine] = []
    try:
        engines.append(LLMEngine(EngineConfig.from_kwargs(**common, distributed_executor_backend="ray"),
                                 show_progress=False))
        prefill = PrefillReplica(engines[0])
        engines.append(LLMEngine(EngineConfig.from_kwargs(**common), show_progress=False))  # in-process rank
        decode = DecodeReplica(engines[1], prefill.prefill)  # default policy: every prompt is handed off
        with TestClient(create_openai_app(ReplicaBackend(decode, NAME), trace_requests=True)) as client:
            yield client, decode
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.slow
def test_handed_off_request_has_every_stage_in_order(pd, caplog):
    client, decode = pd
    before = {s: _stage_count(s, "remote") for s in ("kv_push", "decode_admission", "first_byte")}
    transfers = len(decode.transfers)
    with caplog.at_level(logging.INFO, logger="tandem.trace"):
        _complete(client, stream=True, max_tokens=6)
    assert len(decode.transfers) == transfers + 1  # the KV did move
    [line] = _traces(caplog)
    assert line["site"] == "remote"
    ms = line["ms"]
    _assert_in_order(ms, REMOTE_CHAIN)
    _assert_in_order(ms, RECV_CHAIN)
    # Token 1 streams to the client while its KV moves: after the prefill answered, not after the push.
    assert ms["prefill_answered"] <= ms["first_byte"]
    assert all(_stage_count(s, "remote") == before[s] + 1 for s in before)


@pytest.mark.slow
def test_local_prefill_and_first_token_finish_timelines(pd):
    from engine.disagg import LocalPrefillPolicy

    client, decode = pd
    prompt = decode.llm_engine.tokenizer.encode(PROMPT)

    async def final(rid: str, max_tokens: int) -> RequestOutput:
        last = None
        async for out in decode.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                     ignore_eos=True)):
            last = out
        return last

    decode.local_prefill = LocalPrefillPolicy(max_tokens=10_000)
    try:
        local = client.portal.call(final, "tl-local", 4)
    finally:
        decode.local_prefill = LocalPrefillPolicy()
    assert metrics.timeline_site(local.timeline) == "local"
    _assert_in_order(local.timeline, ("replica_received",) + ONE_ENGINE_CHAIN[1:])
    assert not {"reserved", "kv_push_start", "decode_started"} & set(local.timeline)
    # max_tokens=1: the prefill's token ends the request, nothing moves; the timeline says where it ran.
    short = client.portal.call(final, "tl-one", 1)
    assert metrics.timeline_site(short.timeline) == "remote"
    _assert_in_order(short.timeline, REMOTE_CHAIN[1:7])
    assert "kv_push_start" not in short.timeline


def test_router_driven_prefill_dispatch_counts_from_the_routers_call():
    """Router-driven prefill: the router calls the prefill pool (stamp "prefill_called") together with the
    decode replica, so the prefill's dispatch runs from that call, not from the decode replica's reservation,
    which comes later than the prefill engine's "queued" here."""
    timeline = {"arrival": 0.0, "prefill_called": 0.001, "queued": 0.004, "replica_received": 0.005,
                "reserved": 0.006, "scheduled": 0.0045, "first_token": 0.020, "first_byte": 0.023,
                "prefill_answered": 0.024}
    stages = metrics.stage_seconds(timeline)
    assert stages["prefill_dispatch"] == pytest.approx(0.003)
    assert stages["first_byte"] == pytest.approx(0.003) and stages["dispatch"] == pytest.approx(0.005)
    assert metrics.timeline_site(timeline) == "remote"
