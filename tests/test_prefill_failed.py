"""A prefill replica whose engine has stopped answers `PrefillFailed` instead of raising (router/pools.py): Serve logs
every exception out of a deployment call with its traceback ("Request failed."), once per request, and a lost rank
is no server bug. Its callers take the answer as they take the replica's death: the decode replica's prefill client
and the router-driven prefill's answer raise `PrefillUnavailable` (the decode replica prefills the prompt itself),
the router reads no answer. Any other error still raises."""
from __future__ import annotations

import asyncio
import logging

import pytest

from engine.async_engine import EngineDeadError
from engine.disagg import PrefillReady, PrefillUnavailable
from router import disaggregated, pools
from workers.executor import ExecutorError


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
