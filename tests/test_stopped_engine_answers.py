"""A pool replica whose engine has stopped answers instead of raising (router/pools.py): Serve logs every exception out
of a deployment call with its traceback ("Request failed."), once per request, and a lost rank is no server bug.
A prefill replica answers `PrefillFailed`, which its callers take as they take the replica's death: the decode
replica's prefill client and the router-driven prefill's answer raise `PrefillUnavailable` (the decode replica
prefills the prompt itself), the router reads no answer. A decode replica ends its stream with an error item
(router/stream_wire.py) that the router's decoder raises again as the same class, after the outputs before it.
Any other error still raises."""
from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import RayActorError

from engine.async_engine import EngineDeadError
from engine.disagg import PrefillReady, PrefillUnavailable
from engine.llm_engine import RequestOutput
from router import disaggregated, pools
from router.protocol import GenerateRequest
from router.stream_wire import ERROR_ITEM, StreamDecoder, encode_error
from workers.executor import ExecutorError
from workers.sampling_params import SamplingParams


class _Replica:
    """PrefillReplica's two calls: `prefill` streams `items` then raises `error`; `prefill_first` raises it."""

    replica_id = "prefill-7"

    def __init__(self, items: list, error: BaseException | None):
        self.items, self.error = items, error

    async def prefill(self, request_id, prompt, params, priority, reservation):
        for item in self.items:
            yield item
        if self.error is not None:
            raise self.error

    async def prefill_first(self, request_id, prompt, params, priority):
        if self.error is not None:
            raise self.error
        return self.items[0]


def _pool(items: list, error: BaseException | None) -> pools.PrefillPool:
    pool = pools.PrefillPool.__new__(pools.PrefillPool)  # the Serve-free part: its calls on a replica
    pool.replica = _Replica(items, error)
    return pool


def _ready() -> PrefillReady:
    return PrefillReady.__new__(PrefillReady)


async def _collect(gen) -> list:
    return [item async for item in gen]


@pytest.mark.parametrize("error", [EngineDeadError("rank 0 (pp=0, sp=0, tp=0) died"), ExecutorError("rank 1 died")])
def test_a_stopped_engine_is_answered_not_raised(error, caplog):
    ready = _ready()
    with caplog.at_level(logging.WARNING, logger=pools.log.name):
        items = asyncio.run(_collect(_pool([ready], error).prefill("r-1", [1, 2], None, 0, None)))
        first = asyncio.run(_pool([], error).prefill_first("r-2", [1, 2], None, 0))
    assert items[0] is ready and isinstance(items[1], pools.PrefillFailed) and len(items) == 2
    assert isinstance(first, pools.PrefillFailed)
    assert "prefill-7" in first.reason and "r-2" in first.reason and type(error).__name__ in first.reason
    assert any("its engine has stopped under request r-1" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records)  # one line, no traceback


def test_other_errors_still_raise():
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(_collect(_pool([], ValueError("bad prompt")).prefill("r-1", [1], None, 0, None)))
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(_pool([], ValueError("bad prompt")).prefill_first("r-1", [1], None, 0))


def test_callers_take_it_as_the_replica_gone():
    failed = pools.PrefillFailed("prefill replica prefill-7: its engine has stopped under request r-1 (...)")
    ready = _ready()
    assert pools.ready_or_raise(ready) is ready
    with pytest.raises(PrefillUnavailable, match="engine has stopped under request r-1"):
        pools.ready_or_raise(failed)

    async def answered(value):
        return value

    # the decode replica's read of a router-driven prefill's answer
    with pytest.raises(PrefillUnavailable):
        asyncio.run(pools._answer("r-1", answered(failed)))
    assert asyncio.run(pools._answer("r-1", answered(ready))) is ready
    # the router's: no token 1 of its own, nothing to abandon
    assert asyncio.run(disaggregated._answer_or_none(answered(failed))) is None
    assert asyncio.run(disaggregated._answer_or_none(answered(ready))) is ready


class _DecodeReplica:
    replica_id = "decode-3"

    def __init__(self, outputs: list[RequestOutput], error: BaseException):
        self.outputs, self.error = outputs, error

    async def generate(self, request_id, prompt, params, priority, prefilled=None):
        for out in self.outputs:
            yield out
        raise self.error

    async def generate_many(self, items):
        for out in self.outputs:
            yield 0, out
        raise self.error


class _RankDied(ExecutorError):
    """A subclass, as the executor may raise: the router gets the class it handles (ExecutorError)."""


@pytest.mark.parametrize("error,raised", [(EngineDeadError("the engine is not running"), EngineDeadError),
                                          (ExecutorError("step: rank 0 died"), ExecutorError),
                                          (_RankDied("rank 1 died"), ExecutorError),
                                          (RayActorError(), ExecutorError)])
def test_a_decode_stream_ends_with_the_error_the_router_raises_again(error, raised, caplog):
    outs = [RequestOutput("r", [1, 2], token_ids=[7], new_token_ids=[7]),
            RequestOutput("r", [1, 2], token_ids=[7, 8], new_token_ids=[8])]
    pool = pools.DecodePool.__new__(pools.DecodePool)
    pool.replica = _DecodeReplica(outs, error)
    req = GenerateRequest("r", [1, 2], SamplingParams(max_tokens=4))
    for call in (lambda: pool.generate(req), lambda: pool.generate_batch([req])):
        with caplog.at_level(logging.WARNING, logger=pools.log.name):
            items = asyncio.run(_collect(call()))
        assert len(items) == 3 and items[-1].startswith(ERROR_ITEM)
        assert any("decode replica decode-3: its engine has stopped under request r" in r.getMessage()
                   for r in caplog.records)
        decoder = StreamDecoder()
        assert [decoder.decode(item)[1].token_ids for item in items[:2]] == [[7], [7, 8]]
        with pytest.raises(raised) as got:
            decoder.decode(items[-1])
        assert str(got.value) == str(error)
        assert type(got.value) is raised


def test_other_decode_errors_still_raise():
    pool = pools.DecodePool.__new__(pools.DecodePool)
    pool.replica = _DecodeReplica([], ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(_collect(pool.generate(GenerateRequest("r", [1], SamplingParams(max_tokens=1)))))
    assert encode_error(EngineDeadError("x")).startswith(ERROR_ITEM)
