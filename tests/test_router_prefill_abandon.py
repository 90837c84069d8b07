"""Issue 24: a router-driven prefill (router/disaggregated.py `_generate_routed`) whose request the router gives up
(the client gone, the decode call refused or never made, the decode replica dead) has its prefill's KV abandoned by
the router once answered, so the prefill replica frees the blocks at once rather than at the lease, whether or not
the decode call reached a decode replica: a prefill rank whose send of the KV has begun ignores the abandon, and a
send that begins after it makes the decode replica discard what it got (tests/test_kv_transfer_claims.py).
The router's side with fakes, without Ray; the last test with a real prefill replica (Ray, one rank)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentID, RequestMetadata
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentResponseGenerator

from router.disaggregated import DisaggregatedBackend
from router.protocol import GenerateRequest
from router.stream_wire import RESERVED_ITEM
from engine.disagg import PrefillReady
from workers.sampling_params import SamplingParams

HANDOFF = "req-1#0"  # the fake prefill's `PrefillReady.handoff_id`, which the ranks are told to abandon


class _Rank:
    """A prefill rank's actor handle: records the `kv.remote("abandon", rid)` calls."""

    def __init__(self):
        self.abandoned: list[str] = []
        self.called = threading.Event()
        self.kv = SimpleNamespace(remote=self._kv)

    def _kv(self, method: str, request_id: str):
        assert method == "abandon"
        self.abandoned.append(request_id)
        self.called.set()


class _PrefillResponse:
    """`PrefillPool.prefill_first.remote(...)`: assigned at once; its ObjectRef resolves to `ready`."""

    def __init__(self, ready: PrefillReady):
        self.ref = asyncio.get_running_loop().create_future()
        self.ref.set_result(ready)
        self.cancelled = False

    async def _to_object_ref(self):
        return self.ref

    def cancel(self) -> None:
        self.cancelled = True


def _replicas(n: int):
    """What router/routing.py `live_replicas` reads of a Serve handle."""
    router = SimpleNamespace(_asyncio_router=SimpleNamespace(
        _request_router=SimpleNamespace(curr_replicas={i: i for i in range(n)})))
    return router


class _Pool:
    """A deployment handle: `options(stream=True).<method>.remote(...)` returns what `call` makes."""

    def __init__(self, call):
        self._router = _replicas(1)
        self._call = call
        self.calls = 0

    def options(self, **_):
        return self

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def remote(*args):
            self.calls += 1
            return self._call(*args)

        return SimpleNamespace(remote=remote)


def _stream(assignment: concurrent.futures.Future) -> DeploymentResponseGenerator:
    """Serve 2.60's own streaming response over an assignment future (as its router's thread resolves it)."""
    meta = RequestMetadata(request_id="r", internal_request_id="i", call_method="generate_prefilled", is_streaming=True)
    return DeploymentResponseGenerator(assignment, meta, _is_router_running_in_separate_loop=True)


def _backend(decode_call, rank: _Rank):
    ready = PrefillReady("prefill-0", SimpleNamespace(finish_reason="handoff"), rank_handles=[rank], handoff_id=HANDOFF)
    backend = object.__new__(DisaggregatedBackend)  # no model, tokenizer or config: only what the routed path reads
    backend._ready, backend.ready_wait_s, backend._streams, backend.router_prefills = True, 1.0, {}, 0
    backend.decode = _Pool(decode_call)
    backend.prefill = None
    return backend, ready


def _request() -> GenerateRequest:
    return GenerateRequest("req-1", list(range(64)), SamplingParams(max_tokens=4))


async def _drain(backend) -> list:
    return [out async for out in backend._generate_routed(_request())]


def _settle(rank: _Rank, expect_call: bool) -> None:
    """Abandoning runs in a task, then a thread: wait for it (or long enough that it would have come)."""
    rank.called.wait(2.0 if expect_call else 0.3)


@pytest.mark.parametrize("refusal", [
    BackPressureError(num_queued_requests=4, max_queued_requests=4, status_code=429),
    DeploymentUnavailableError(DeploymentID(name="DecodePool", app_name="app")),
], ids=["backpressure", "deployment_unavailable"])
def test_a_decode_call_refused_before_any_replica_abandons_the_prefill(refusal):
    """Serve refused the decode call before sending it anywhere (the decode pool's callers queue all they may):
    no decode replica will ever let the prefill's blocks go, so the router has the prefill ranks abandon them."""
    rank = _Rank()

    def decode_call(req, answer):
        assignment = concurrent.futures.Future()
        assignment.set_exception(refusal)
        return _stream(assignment)

    async def body():
        backend, ready = _backend(decode_call, rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        with pytest.raises(type(refusal)):  # the client's 429 / 503, as before
            await _drain(backend)
        await asyncio.sleep(0.05)  # the abandoning task awaits the answer
        return backend

    backend = asyncio.run(body())
    _settle(rank, expect_call=True)
    assert backend.router_prefills == 1 and backend.decode.calls == 1
    assert rank.abandoned == [HANDOFF]


def test_a_decode_call_that_could_not_be_made_abandons_the_prefill():
    rank = _Rank()

    def decode_call(req, answer):
        raise TypeError("could not serialize the request")

    async def body():
        backend, ready = _backend(decode_call, rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        with pytest.raises(TypeError):
            await _drain(backend)
        await asyncio.sleep(0.05)

    asyncio.run(body())
    _settle(rank, expect_call=True)
    assert rank.abandoned == [HANDOFF]


def test_a_client_gone_while_the_decode_call_is_unassigned_abandons_the_prefill():
    """Cancelled while Serve still assigns the decode call: it may already have sent it and be waiting for the
    replica's accept (not known), so a decode replica may be moving the KV. The router abandons all the same: a
    rank already sending ignores it. Before the fix the router left the blocks to the lease."""
    rank = _Rank()
    assignment = concurrent.futures.Future()  # never resolved: queued in Serve

    async def body():
        backend, ready = _backend(lambda req, answer: _stream(assignment), rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        task = asyncio.ensure_future(_drain(backend))
        await asyncio.sleep(0.2)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)

    asyncio.run(body())
    _settle(rank, expect_call=False)
    assert assignment.cancelled()  # the decode call was cancelled, as before
    assert rank.abandoned == [HANDOFF]  # before the fix: [] (held until the lease)


def test_a_decode_call_whose_assignment_was_cancelled_abandons_the_prefill():
    """Serve cancelled the decode call's assignment (whether it had sent it is not known): the request fails, and
    the router abandons the prefill. Before the fix only an assignment refused with a known error did."""
    rank = _Rank()
    assignment = concurrent.futures.Future()
    assignment.cancel()

    async def body():
        backend, ready = _backend(lambda req, answer: _stream(assignment), rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        with pytest.raises((asyncio.CancelledError, concurrent.futures.CancelledError)):
            await _drain(backend)
        await asyncio.sleep(0.05)

    asyncio.run(body())
    _settle(rank, expect_call=True)
    assert rank.abandoned == [HANDOFF]


def test_a_client_gone_after_the_reservation_abandons_the_prefill_too():
    """Once the decode replica said `RESERVED_ITEM` it holds the request, and may be moving the KV when the client
    leaves. Its own give-up path abandons the prefill after any transfer in flight (engine/disagg.py
    `RouterPrefill`); the router abandons too, at once: a no-op on a rank whose send has begun (the send's end
    frees the blocks), and a send that begins after it has the decode replica discard the KV."""
    rank = _Rank()

    class _Replica:
        cancelled = False

        def __init__(self):
            self.items = [RESERVED_ITEM]

        async def __anext__(self):
            if self.items:
                return self.items.pop(0)
            await asyncio.sleep(3600)

        def cancel(self):
            _Replica.cancelled = True

    def decode_call(req, answer):
        assignment = concurrent.futures.Future()
        assignment.set_result(_Replica())
        return _stream(assignment)

    async def body():
        backend, ready = _backend(decode_call, rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        gen = backend._generate_routed(_request())
        first = await anext(gen)  # token 1, streamed from the prefill's answer
        assert first is not None
        await gen.aclose()  # the client went away

    import router.disaggregated as disaggregated
    real = disaggregated.streamable
    disaggregated.streamable = lambda out: out  # the fake answer is no RequestOutput
    try:
        asyncio.run(body())
    finally:
        disaggregated.streamable = real
    _settle(rank, expect_call=True)
    assert _Replica.cancelled  # the decode replica is told to stop
    assert rank.abandoned == [HANDOFF]


def test_a_retry_after_the_decode_replica_died_fails_at_once_with_none_left():
    """The decode replica died under a routed request before its first token and Serve knows of no other one: the
    router's retry must answer 503 now, not wait in Serve's queue for a replacement (20-30 s on a CPU box, which
    the fault-and-load run counted as lost requests). A new call still waits for a replacement, as before."""
    from ray.exceptions import RayActorError

    from router.protocol import BackendUnavailable

    rank = _Rank()

    class _Died:
        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(0.01)
            backend.decode._router = _replicas(0)  # Serve dropped the dead replica
            raise RayActorError()

        def cancel(self):
            pass

    class _Held:
        """A call Serve holds for a replacement replica: no item, ever."""

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(3600)

        def cancel(self):
            pass

    streams = iter([_Died(), _Held()])

    async def body():
        nonlocal backend
        backend, ready = _backend(lambda *args: next(streams), rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        with pytest.raises(BackendUnavailable, match="no other one"):
            await asyncio.wait_for(_drain(backend), 3)  # before the fix: TimeoutError (held for a replacement)
        await asyncio.sleep(0.05)

    backend = None
    asyncio.run(body())
    _settle(rank, expect_call=True)
    assert backend.decode.calls == 2 and rank.abandoned == [HANDOFF]  # the dead replica's prefill is let go


# ---------------------------------------------------------------- a real prefill replica (Ray)


@pytest.fixture(scope="module")
def prefill_replica(shared_ray):
    """A prefill replica of one rank (a Ray actor with its transfer agent), at the default 60 s lease."""
    from engine.disagg import PrefillReplica
    from engine.llm_engine import LLMEngine
    from tests.models import tiny_model
    from workers.config import EngineConfig

    config = EngineConfig.from_kwargs(model=tiny_model("llama"), block_size=4, num_gpu_blocks_override=64,
                                      distributed_executor_backend="ray")
    replica = PrefillReplica(LLMEngine(config, show_progress=False))
    yield replica
    replica.llm_engine.shutdown()


class _RealPrefill:
    """`PrefillPool.prefill_first.remote(...)` on a real replica: assigned at once; its ref is the call."""

    def __init__(self, replica, request_id: str, prompt: list[int]):
        # ignore_eos: a first token drawn at temperature 1 could be EOS and end the request at its prefill (seen once in CI)
        self.ref = asyncio.ensure_future(replica.prefill_first(request_id, prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                                                               0))

    async def _to_object_ref(self):
        return self.ref

    def cancel(self) -> None:
        self.ref.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("assignment_outcome", ["pending", "cancelled"])
def test_the_prefill_blocks_are_freed_at_once_when_the_decode_call_reached_no_replica(prefill_replica, assignment_outcome):
    """The race of issue 24, with the prefill replica's own lease and send watcher: the prefill has answered, the
    client leaves while Serve's assignment of the decode call is still pending (or was cancelled: whether Serve
    had sent it is not known). No decode replica will collect the KV; the prefill replica must free it at once,
    not at its 60 s lease (before the fix it waited for the lease)."""
    engine = prefill_replica.llm_engine
    request = GenerateRequest(f"race-{assignment_outcome}", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    assignment = concurrent.futures.Future()  # Serve still assigning the decode call

    async def body() -> float:
        backend, _ = _backend(lambda req, answer: _stream(assignment), _Rank())
        prefill = _RealPrefill(prefill_replica, request.request_id, request.prompt_token_ids)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        task = asyncio.ensure_future(_collect(backend, request))
        ready = await asyncio.wait_for(asyncio.shield(prefill.ref), 60)
        assert not ready.finished and request.request_id in engine.scheduler.held  # held for a decode replica
        await asyncio.sleep(0.1)  # the router awaits the decode call's first item
        if assignment_outcome == "pending":
            task.cancel()  # the client went away
        else:
            assignment.cancel()  # Serve gave the assignment up
        with pytest.raises((asyncio.CancelledError, concurrent.futures.CancelledError)):
            await task
        gone = time.monotonic()
        while request.request_id in engine.scheduler.held and time.monotonic() - gone < 20:
            await asyncio.sleep(0.02)
        assert request.request_id not in engine.scheduler.held, "the prefill blocks were left to the lease"
        return time.monotonic() - gone

    freed_after = asyncio.run(body())
    assert freed_after < prefill_replica.lease_s / 6
    assert engine.block_manager.num_used_blocks == 0


async def _collect(backend, request: GenerateRequest) -> list:
    return [out async for out in backend._generate_routed(request)]


class _FailingStream:
    """A decode call whose replica raises before its first item (as Serve delivers a remote error)."""

    def __init__(self, error: BaseException):
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self) -> None:
        pass


def test_a_decode_replica_without_its_ranks_is_retried_then_answered_503_and_the_prefill_abandoned():
    """A decode replica whose ranks died refuses every request (ExecutorError, delivered through Serve as a
    RayTaskError that is also one) until its failed health check gets it replaced. The router treats it as a dead
    replica: it abandons the prefill's KV, retries the request the usual way, and with no better replica answers
    503 with the error's first line, not 500 with the remote traceback (the fault script saw 112 such 500s)."""
    from ray.exceptions import RayTaskError

    from router.protocol import BackendUnavailable
    from workers.executor import ExecutorError

    cause = ExecutorError("decode replica decode-1 lost its ranks; it serves nothing more")
    error = RayTaskError("generate_prefilled", "Traceback (most recent call last):\n  ...secret frames...", cause)
    error = error.as_instanceof_cause()
    assert isinstance(error, ExecutorError)
    rank = _Rank()

    async def body():
        backend, ready = _backend(lambda *args: _FailingStream(error), rank)
        prefill = _PrefillResponse(ready)
        backend.prefill = SimpleNamespace(prefill_first=SimpleNamespace(remote=lambda *a: prefill))
        with pytest.raises(BackendUnavailable, match="decode replica failed") as raised:
            await _drain(backend)
        assert "secret frames" not in str(raised.value)
        await asyncio.sleep(0.05)
        return backend

    backend = asyncio.run(body())
    _settle(rank, expect_call=True)
    assert backend.decode.calls == 3  # the routed call, then the usual path's two attempts
    assert rank.abandoned == [HANDOFF]
