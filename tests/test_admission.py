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
    # A ceiling only: the queue is sized below it by KV capacity and the target delay (scheduler tests below).
    assert served.engine_args("prefill").max_waiting_requests == 4 * 32
    assert served.engine_args("decode").max_waiting_requests == 4 * 8
    assert served.engine_args("decode").max_queue_delay_s == SERVED_MAX_QUEUE_DELAY_S
    assert served.engine_args("decode").max_waiting_kv_ratio == 1.0
    # Serve lets in more than the engine may queue, so the surplus meets the engine's 429, not Serve's queue.
    assert served.max_ongoing_requests("decode") == 8 + 2 * 4 * 8
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


# A prompt that with one short prompt waiting ahead of it needs more than the 16-block cache (served default
# max_waiting_kv_ratio 1.0): its 245 tokens + 1 take all 16 blocks, the short one 1.
BIG_PROMPT = [7] * 245


def test_served_default_bound_answers_429_and_counts_it(model):
    # Only max_num_seqs and the cache size given: the served default bound (KV-sized) applies.
    backend = make_backend(model, max_num_seqs=1, num_gpu_blocks_override=16)
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
            r = client.post("/v1/completions", json={"prompt": BIG_PROMPT, "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full" and "KV blocks" in r.json()["error"]["message"]
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
    backend = make_backend(model, max_num_seqs=1, num_gpu_blocks_override=16)
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
                stub.Generate(pb.GenerateRequest(prompt_token_ids=BIG_PROMPT, max_tokens=2))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(e.value.trailing_metadata())["retry-after"]) >= 1
            assert len(running.result(timeout=60).token_ids) == len(waiting.result(timeout=60).token_ids) == 60
    finally:
        harness.close()


# ---- the queue is sized by KV capacity and the target delay; Retry-After is an estimate


def _prompt(seq_id: str, tokens: int, priority: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(1, tokens + 1)), SamplingParams(max_tokens=4), priority=priority)


def test_queue_is_sized_by_kv_capacity():
    # 8 blocks of 4 tokens; a 7-token prompt needs 2 (its first output token included): 4 prompts fill the cache.
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_waiting_kv_ratio=1.0), BlockManager(8, 4, True))
    for i in range(4):
        sched.add(_prompt(f"r{i}", 7))
    with pytest.raises(QueueFullError, match=r"need 10 KV blocks, more than 1 x the cache's 8"):
        sched.add(_prompt("r4", 7))
    sched.add(_prompt("short", 3, priority=-1))  # nothing of its priority waits: admissible
    half = Scheduler(SchedulerConfig(max_num_seqs=1, max_waiting_kv_ratio=0.5), BlockManager(8, 4, True))
    half.add(_prompt("a", 7)), half.add(_prompt("b", 7))
    with pytest.raises(QueueFullError):
        half.add(_prompt("c", 7))


def test_drain_rate_counts_only_backlogged_time():
    rate = scheduler_module.DrainRate(window_s=10.0, min_backlog_s=1.0)
    rate.observe(0.0, 5, still_waiting=False)
    rate.observe(8.0, 3, still_waiting=False)  # idle in between: admissions follow arrivals, not capacity
    assert rate.rate(8.0) is None
    rate.observe(9.0, 0, still_waiting=True)
    rate.observe(9.5, 2, still_waiting=True)
    assert rate.rate(9.5) is None  # half a second of backlog: not enough to tell
    rate.observe(10.0, 2, still_waiting=True)
    assert rate.rate(10.0) == pytest.approx(4.0)  # 4 admitted over 1 s of backlog
    assert rate.rate(30.0) is None  # out of the window


def test_predicted_queueing_delay_refuses_with_a_retry_after_estimate(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: now[0])
    sched = _sched(max_queue_delay_s=2.0)  # max_num_seqs=1: one request starts per finished one
    for name in "abcd":
        sched.add(_seq(name))
    sched.schedule()  # "a" starts; b, c, d wait
    now[0] += 1.0
    sched.finish(sched.seqs["a"], "stop")
    sched.schedule()  # "b" starts: the backlogged queue drained 1 request in 1 s
    sched.add(_seq("e"))  # c, d ahead: about 2 s, within the target
    with pytest.raises(QueueFullError, match=r"3 requests ahead of it need about 3\.0s.*1\.0 admissions/s") as e:
        sched.add(_seq("f"))  # c, d, e ahead: about 3 s; none of them has waited 2 s yet
    assert e.value.retry_after_s == pytest.approx(3.0)  # the queue ahead's drain time at that rate
    sched.add(_seq("vip", priority=-1))  # nothing waits ahead of it
    stuck = _sched(max_queue_delay_s=2.0)  # never scheduled: no drain rate measured
    stuck.add(_seq("a"))
    now[0] += 3.0
    with pytest.raises(QueueFullError, match="waited 3.0s") as e:
        stuck.add(_seq("b"))
    assert e.value.retry_after_s == pytest.approx(3.0)  # it has moved no faster than its oldest request's wait


def test_retry_after_is_the_estimate_clamped():
    from router.errors import RETRY_AFTER_MAX_S, api_error

    def header(estimate: float | None) -> int | None:
        return api_error(QueueFullError("busy", retry_after_s=estimate)).retry_after

    assert header(7.2) == 8 and header(0.01) == 1 and header(None) == 1 and header(1e9) == RETRY_AFTER_MAX_S
    # It survives the trip through Ray: pickling, and the RayTaskError wrapper a pool's error arrives in.
    import pickle

    from ray.exceptions import RayTaskError

    from router.guards import public_error
    err = pickle.loads(pickle.dumps(QueueFullError("busy", retry_after_s=7.2)))
    wrapped = RayTaskError("generate", "traceback", err).as_instanceof_cause()
    assert public_error(wrapped, "rid-1").retry_after == 8
    assert pickle.loads(pickle.dumps(api_error(err))).retry_after == 8


def test_http_and_grpc_429_carry_the_engines_estimate(model, monkeypatch):
    backend = make_backend(model, max_num_seqs=1)

    def full(*args, **kwargs):
        raise QueueFullError("5 requests ahead", retry_after_s=6.5)

    monkeypatch.setattr(backend.llm_engine, "add_request", full)
    with TestClient(create_openai_app(backend)) as client:
        try:
            before = _count("queue_full")
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "7"
            assert _count("queue_full") == before + 1
        finally:
            client.portal.call(backend.close)
    harness = _Harness()
    backend = make_backend(model, max_num_seqs=1)
    harness.backends.append(backend)
    monkeypatch.setattr(backend.llm_engine, "add_request", full)
    try:
        stub = pb_grpc.InferenceStub(harness.serve(InferenceServicer(backend)))
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "7") in tuple(e.value.trailing_metadata())
    finally:
        harness.close()


# ---- Serve's own queues are bounded too, and their refusals are 429s


def _deployment_configs(app) -> dict[str, object]:
    """name -> deployment config of every deployment of a built app."""
    found: dict[str, object] = {}

    def walk(bound) -> None:
        d = bound._bound_deployment
        found[d.name] = d._deployment_config
        for arg in d.init_args:
            if hasattr(arg, "_bound_deployment"):
                walk(arg)

    walk(app)
    return found


@pytest.mark.parametrize("args", [{}, {"colocated": True}], ids=["disaggregated", "colocated"])
def test_every_deployment_bounds_serves_queue_with_429(args):
    from router.app import build_app

    configs = _deployment_configs(build_app({"max_num_seqs": 16, **args}))
    assert set(configs) == ({"TandemColocated"} if args else {"Router", "DecodePool", "PrefillPool"})
    for name, cfg in configs.items():
        assert cfg.max_queued_requests == (4 * 16 if name == "Router" else 16), name
        assert cfg.backpressure_config.status_code == 429 and cfg.backpressure_config.retry_after_s == 5.0, name
    unbounded = _deployment_configs(build_app({"max_queued_requests": -1, **args}))
    assert all(cfg.max_queued_requests == -1 for cfg in unbounded.values())
    assert AppConfig(max_queued_requests=3).backpressure_options("prefill")["max_queued_requests"] == 3
    with pytest.raises(ValueError, match="max_queued_requests"):
        AppConfig(max_queued_requests=0)


def test_serve_backpressure_is_a_counted_429(model, monkeypatch):
    from ray.serve.exceptions import BackPressureError

    backend = make_backend(model, max_num_seqs=1)

    def full(*args, **kwargs):
        raise BackPressureError(num_queued_requests=16, max_queued_requests=16, status_code=429, retry_after_s=5.0)

    monkeypatch.setattr(backend.llm_engine, "add_request", full)
    with TestClient(create_openai_app(backend)) as client:
        try:
            before = _count("queue_full")
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "5", r.text
            assert r.json()["error"]["code"] == "queue_full"
            assert _count("queue_full") == before + 1
        finally:
            client.portal.call(backend.close)


def test_served_kv_transfer_limit_follows_the_request_limit_unless_given():
    """A stuck KV handoff must fail while its request can still be re-prefilled (router/config.py)."""
    engine_default = EngineArgs().kv_transfer_timeout_seconds
    assert AppConfig().engine_args("decode").kv_transfer_timeout_seconds == engine_default  # no request limit
    limited = AppConfig(request_timeout_s=30)
    assert limited.engine_args("decode").kv_transfer_timeout_seconds == 10.0
    assert limited.engine_args("prefill").kv_transfer_timeout_seconds == 10.0
    assert AppConfig(request_timeout_s=6).engine_args("decode").kv_transfer_timeout_seconds == 5.0  # the floor
    assert AppConfig(request_timeout_s=900).engine_args("decode").kv_transfer_timeout_seconds == engine_default
    given = AppConfig(request_timeout_s=30, kv_transfer_timeout_seconds=20, decode={"kv_transfer_timeout_seconds": 25})
    assert given.engine_args("prefill").kv_transfer_timeout_seconds == 20  # an explicit value wins
    assert given.engine_args("decode").kv_transfer_timeout_seconds == 25
