"""Admission control (issue 19 item 5): bounded, priority-aware queues with a queueing-delay target, their
served defaults, 429 / RESOURCE_EXHAUSTED beyond them, and every refusal counted in tandem_requests_total."""
from __future__ import annotations

import re
import threading

import grpc
import pytest
from fastapi.testclient import TestClient

from engine import scheduler as scheduler_module
from engine.block_manager import BlockManager
from engine.scheduler import QueueFullError, Scheduler
from engine.sequence import Sequence
from router.config import SERVED_MAX_QUEUE_DELAY_S, AppConfig
from router.grpc_api import InferenceServicer
from router.metrics import prometheus_text
from router.openai_api import create_openai_app
from router.proto import inference_pb2 as pb
from router.proto import inference_pb2_grpc as pb_grpc
from tests.serving import build_chat_model, make_backend, slow_engine, wait_for
from tests.test_grpc_api import _Harness
from workers.config import EngineArgs, SchedulerConfig
from workers.sampling_params import SamplingParams


def _sched(**config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=1, **config), BlockManager(64, 4, True))


def _seq(seq_id: str, priority: int = 0) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], SamplingParams(max_tokens=4), priority=priority)


# ---- the engine's bound


def test_bound_counts_only_requests_ahead_so_important_requests_still_get_in():
    sched = _sched(max_waiting_requests=2)
    sched.add(_seq("low-1", priority=5))
    sched.add(_seq("low-2", priority=5))
    with pytest.raises(QueueFullError, match="2 requests already waiting ahead"):
        sched.add(_seq("low-3", priority=5))
    sched.add(_seq("urgent", priority=0))  # nothing of its priority or better waits: admitted
    assert [s.seq_id for s in sched.waiting] == ["urgent", "low-1", "low-2"]
    sched.add(_seq("urgent-2", priority=0))
    with pytest.raises(QueueFullError):
        sched.add(_seq("urgent-3", priority=0))


def test_queue_delay_target_refuses_while_the_queue_ahead_is_stale(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: now[0])
    sched = _sched(max_queue_delay_s=2.0)
    sched.add(_seq("a", priority=1))
    now[0] += 1.0
    sched.add(_seq("b", priority=1))  # "a" has waited 1 s < 2 s
    now[0] += 1.5
    with pytest.raises(QueueFullError, match=r"waited 2\.5s.*max_queue_delay_s=2"):
        sched.add(_seq("c", priority=1))
    sched.add(_seq("vip", priority=0))  # nothing ahead of it has waited
    sched.schedule()  # admits "vip" (max_num_seqs=1): "a" and "b" still wait, "a" for 2.5 s
    with pytest.raises(QueueFullError):
        sched.add(_seq("d", priority=1))
    sched.abort("a"), sched.abort("b")  # the stale requests left: the queue ahead is fresh again
    sched.add(_seq("e", priority=1))


def test_offline_engine_stays_unbounded_and_served_engines_get_derived_bounds():
    args = EngineArgs()
    assert args.max_waiting_requests is None and args.max_queue_delay_s is None  # LLM.generate queues a dataset
    served = AppConfig(max_num_seqs=32, decode={"max_num_seqs": 8})
    assert served.engine_args("prefill").max_waiting_requests == 32
    assert served.engine_args("decode").max_waiting_requests == 8
    assert served.engine_args("decode").max_queue_delay_s == SERVED_MAX_QUEUE_DELAY_S
    # Serve lets in more than the engine may queue, so the surplus meets the engine's 429, not Serve's queue.
    assert served.max_ongoing_requests("decode") == 8 + 2 * 8
    explicit = AppConfig(max_waiting_requests=3, max_queue_delay_s=None)
    assert explicit.engine_args("decode").max_waiting_requests == 3
    assert explicit.engine_args("decode").max_queue_delay_s is None  # an explicit null wins


# ---- served: 429 by default, counted


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_chat_model(tmp_path_factory.mktemp("models") / "admission-llama")


def _count(status: str) -> float:
    text = prometheus_text()[0].decode()
    found = re.findall(r'^tandem_requests_total\{[^}]*status="%s"[^}]*\} ([0-9.e+]+)$' % status, text, re.M)
    return sum(float(v) for v in found)  # every model_name's


def test_served_default_bound_answers_429_and_counts_it(model):
    # Only max_num_seqs given: the served default bound (one batch may wait) applies; before it was unbounded.
    backend = make_backend(model, max_num_seqs=1)
    long = {"prompt": "hello there", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with TestClient(create_openai_app(backend)) as client, slow_engine(backend):
        try:
            stats = lambda: client.portal.call(backend.stats)  # noqa: E731
            results: list = []
            threads = [threading.Thread(target=lambda: results.append(client.post("/v1/completions", json=long)))
                       for _ in range(2)]
            threads[0].start()
            wait_for(lambda: stats()["running"] == 1)
            threads[1].start()
            wait_for(lambda: stats()["waiting"] == 1)
            before = _count("queue_full")
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert _count("queue_full") == before + 1
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": -1})
            assert r.status_code == 200, r.text  # more important: nothing waits ahead of it
            for t in threads:
                t.join(timeout=60)
            assert sorted(x.status_code for x in results) == [200, 200]
        finally:
            client.portal.call(backend.close)


class _NotReady:
    """A backend whose pools never answer."""
    tokenizer, max_model_len, vocab_size, model_name = None, 256, 300, "m"

    async def ready(self) -> bool:
        return False


def test_not_ready_503_and_malformed_requests_are_counted():
    client = TestClient(create_openai_app(_NotReady()))
    before, bad_before = _count("unavailable"), _count("bad_request")
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = client.post(path, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    assert _count("unavailable") == before + 2
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}).status_code == 400
    assert _count("bad_request") == bad_before + 1


def test_grpc_served_default_bound_is_resource_exhausted(model):
    harness = _Harness()
    backend = make_backend(model, max_num_seqs=1)
    harness.backends.append(backend)
    try:
        stub = pb_grpc.InferenceStub(harness.serve(InferenceServicer(backend)))
        long = pb.GenerateRequest(prompt="hello there", max_tokens=60, ignore_eos=True)
        with slow_engine(backend):
            running = stub.Generate.future(long)
            wait_for(lambda: harness.stats(backend)["running"] == 1)
            waiting = stub.Generate.future(long)
            wait_for(lambda: harness.stats(backend)["waiting"] == 1)
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
            assert len(running.result(timeout=60).token_ids) == len(waiting.result(timeout=60).token_ids) == 60
    finally:
        harness.close()
