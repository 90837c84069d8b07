"""Issue 19 item 6, the pieces without Ray: a call whose pool lost every replica stops waiting at once
(router/routing.py), and pools that are never empty by design are told apart from ones that scale to zero."""
from __future__ import annotations

import asyncio
import time

import pytest

from router.config import AppConfig
from router.routing import ReplicasGone, first_unless_replicas_gone, live_replicas, never_empty


class _Handle:
    """What `live_replicas` reads of a Serve 2.60 deployment handle."""

    def __init__(self, n: int | None):
        self._router = type("R", (), {})()
        self._router._asyncio_router = type("A", (), {})()
        self._router._asyncio_router._request_router = None if n is None else type("Q", (), {"curr_replicas": {i: i for i in range(n)}})()

    def set(self, n: int) -> None:
        self._router._asyncio_router._request_router = type("Q", (), {"curr_replicas": {i: i for i in range(n)}})()


async def _never():
    await asyncio.sleep(3600)
    yield None


async def _one(item):
    await asyncio.sleep(0.01)
    yield item


class _ServeLikeStream:
    """Like Serve's DeploymentResponseGenerator: its cancellation surfaces as an exception of its own."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("request was cancelled") from None


def test_a_given_up_first_item_leaves_no_unretrieved_exception():
    """Seen in a fault run on GPUs: every call given up on a dead pool left a task whose RequestCancelledError asyncio
    logged with a traceback at garbage collection ("Task exception was never retrieved")."""
    import gc

    async def body():
        unretrieved = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        handle = _Handle(1)
        waiting = asyncio.ensure_future(first_unless_replicas_gone(_ServeLikeStream(), handle, already_empty_fails=False))
        await asyncio.sleep(0.1)
        handle.set(0)
        with pytest.raises(ReplicasGone):
            await waiting
        del waiting
        await asyncio.sleep(0.05)  # the cancelled task finishes with its RuntimeError
        gc.collect()
        await asyncio.sleep(0)
        assert not unretrieved, [c.get("message") for c in unretrieved]

    asyncio.run(body())


def test_live_replicas_reads_the_handle_and_is_none_when_unknown():
    assert live_replicas(_Handle(None)) is None
    assert live_replicas(object()) is None
    assert live_replicas(_Handle(2)) == 2


def test_a_call_stops_waiting_when_its_last_replica_dies():
    async def body():
        handle = _Handle(1)
        waiting = asyncio.ensure_future(first_unless_replicas_gone(_never(), handle, already_empty_fails=False))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # a replica lives: the call waits for its answer, however long
        t0 = time.monotonic()
        handle.set(0)  # Serve dropped the dead replica
        with pytest.raises(ReplicasGone):
            await waiting
        assert time.monotonic() - t0 < 0.5
        assert await first_unless_replicas_gone(_one("ready"), _Handle(1), already_empty_fails=True) == "ready"

    asyncio.run(body())


def test_an_emptied_pool_fails_at_once_unless_it_may_scale_from_zero():
    async def body():
        emptied = _Handle(1)
        assert live_replicas(emptied) == 1
        emptied.set(0)  # its replicas died before this call
        with pytest.raises(ReplicasGone):
            await asyncio.wait_for(first_unless_replicas_gone(_never(), emptied, already_empty_fails=True), 1)
        with pytest.raises(asyncio.TimeoutError):  # scaling from zero: Serve's wait for a replica stands
            await asyncio.wait_for(first_unless_replicas_gone(_never(), emptied, already_empty_fails=False), 0.3)
        with pytest.raises(asyncio.TimeoutError):  # a router not yet told of any replica: no verdict
            await asyncio.wait_for(first_unless_replicas_gone(_never(), _Handle(0), already_empty_fails=True), 0.3)

    asyncio.run(body())


def test_a_pool_never_seen_with_a_replica_fails_after_the_grace():
    """A decode replica whose router does the prefill calls never called the prefill pool itself: at its first
    fallback call its handle has seen no replica. If the pool died meanwhile, Serve would hold the call for a
    replacement (~20-30 s on a CPU box: the fault-and-load run lost requests so); the grace ends that."""
    from router import routing

    async def body():
        t0 = time.monotonic()
        with pytest.raises(ReplicasGone):
            await asyncio.wait_for(first_unless_replicas_gone(_never(), _Handle(None), already_empty_fails=True), 5)
        assert routing.UNSEEN_POOL_GRACE_S <= time.monotonic() - t0 < routing.UNSEEN_POOL_GRACE_S + 1
        late = _Handle(0)  # its first update comes in within the grace and names a replica: the call waits on
        waiting = asyncio.ensure_future(first_unless_replicas_gone(_never(), late, already_empty_fails=True))
        await asyncio.sleep(routing.UNSEEN_POOL_GRACE_S / 4)
        late.set(1)
        await asyncio.sleep(routing.UNSEEN_POOL_GRACE_S * 1.5)
        assert not waiting.done()
        late.set(0)  # and then it dies: armed, so at once
        with pytest.raises(ReplicasGone):
            await asyncio.wait_for(waiting, 0.5)
        with pytest.raises(asyncio.TimeoutError):  # a pool that may scale from zero: no grace, Serve's wait stands
            await asyncio.wait_for(first_unless_replicas_gone(_never(), _Handle(None), already_empty_fails=False),
                                   routing.UNSEEN_POOL_GRACE_S + 0.3)

    asyncio.run(body())


def test_never_empty_pools():
    config = AppConfig(prefill={"num_replicas": 2}, decode={"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}})
    assert never_empty(config.prefill) and not never_empty(config.decode)
    assert never_empty(AppConfig().decode)
    assert never_empty(AppConfig(decode={"autoscaling_config": {"max_replicas": 3}}).decode)
