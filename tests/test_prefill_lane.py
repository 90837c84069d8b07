"""The prefill lane (router/prefill_lane.py): a router's direct connection to a prefill replica, which starts a
router-driven prefill before its Serve call arrives and sends token 1 back once that call has taken the run over.

Real sockets and a real `PrefillReplica`'s bookkeeping (`start_first`, `prefill_first`, `drop_first`), with its
engine's run replaced by a timed fake; the served path end to end is in tests/test_serve_disagg.py."""
from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

import pytest

from engine import disagg
from engine.disagg import PrefillReady, PrefillReplica
from engine.llm_engine import RequestOutput
from router import prefill_lane
from router.disaggregated import _check_lane_first
from router.prefill_lane import LaneClient, LaneServer
from router.protocol import BackendUnavailable
from router.routing import lane_for_prefill, pinned_first
from workers.sampling_params import SamplingParams
from workers.scheduler_output import SampledToken

PROMPT = list(range(40))


class _Replica(PrefillReplica):
    """A prefill replica whose engine is a fake: a run takes `run_s` and samples token 7, holding its blocks."""

    def __init__(self, run_s: float = 0.05, finished: bool = False):
        self._first_runs, self._holding, self._handoffs = {}, set(), iter(range(100))
        self._first_taken = collections.deque(maxlen=1024)
        self.run_s, self.finished, self.runs, self.released, self.cancelled = run_s, finished, [], [], []
        self.shards, self.executor = [], SimpleNamespace(workers=[])
        self.llm_engine = SimpleNamespace(release=lambda rid: self.released.append(rid), requests={})

        async def cleanup(fn, rid):
            fn(rid)

        self.async_engine = SimpleNamespace(cleanup=cleanup)

    async def _run(self, request_id, prompt_token_ids, params, priority) -> PrefillReady:
        self.runs.append(request_id)
        try:
            await asyncio.sleep(self.run_s)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)  # the engine aborts the request: its blocks freed there
            raise
        out = RequestOutput(request_id, prompt_token_ids, token_ids=[7], text="x",
                            finish_reason="length" if self.finished else "handoff")
        return PrefillReady("prefill-0", out, first=SampledToken(7, -0.5), handoff_id=f"{request_id}#0")

    async def _hold(self, request_id, handoff_id) -> None:
        self.released.append(request_id)  # the decode replica collected it (what a real replica waits for)


async def _lane(replica: _Replica, admit=lambda: True) -> tuple[LaneServer, LaneClient]:
    server = LaneServer(replica, admit)
    await server.start("127.0.0.1")
    return server, LaneClient()


async def _start(server: LaneServer, client: LaneClient, rid: str = "r1") -> asyncio.Future:
    args = (server.address, server.token, rid, PROMPT, SamplingParams(max_tokens=4), 0)
    first = await client.start(*args)
    if first is None:  # the first start opens the lane in the background and goes without it
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server.address in client._connections:
                break
        first = await client.start(*args)
    assert first is not None
    return first


def test_a_lane_start_is_taken_over_by_the_serve_call_and_token_1_comes_back_on_the_lane():
    async def body():
        replica = _Replica()
        server, client = await _lane(replica)
        first = await _start(server, client)
        await asyncio.sleep(0.01)  # the Serve call comes later than the lane's start
        ready = await replica.prefill_first("r1", PROMPT, SamplingParams(max_tokens=4), 0)
        out = await asyncio.wait_for(first, 2)
        client.close()
        return replica, server, ready, out

    replica, server, ready, out = asyncio.run(body())
    assert replica.runs == ["r1"] and server.started == 1  # one run: the call took the lane's over
    assert out.token_ids == [7] and out.finish_reason is None and out.prompt_token_ids == []  # streamable
    assert ready.first.token_id == 7 and not ready.finished
    assert replica.released == ["r1"] and replica._first_runs == {}


def test_token_1_waits_for_the_serve_call_to_claim_the_run():
    """Before the claim, token 1 might not be what the decode replica goes on from (the call may run elsewhere)."""
    async def body():
        replica = _Replica(run_s=0.0)
        server, client = await _lane(replica)
        first = await _start(server, client)
        await asyncio.sleep(0.1)  # the run has token 1 long since
        waited = not first.done()
        call = asyncio.ensure_future(replica.prefill_first("r1", PROMPT, SamplingParams(max_tokens=4), 0))
        out = await asyncio.wait_for(first, 2)
        await call
        client.close()
        return waited, out

    waited, out = asyncio.run(body())
    assert waited and out.token_ids == [7]


def test_a_serve_call_before_the_lane_start_runs_once_and_the_lane_still_gets_token_1():
    async def body():
        replica = _Replica()
        server, client = await _lane(replica)
        call = asyncio.ensure_future(replica.prefill_first("r1", PROMPT, SamplingParams(max_tokens=4), 0))
        await asyncio.sleep(0)
        first = await _start(server, client)
        out = await asyncio.wait_for(first, 2)
        await call
        client.close()
        return replica, out

    replica, out = asyncio.run(body())
    assert replica.runs == ["r1"] and out.token_ids == [7]


def test_a_start_after_its_serve_call_s_run_or_under_an_id_in_use_starts_nothing():
    """A second run under one id would be refused by the engine, and its clean-up could abort the first's."""
    async def body():
        replica = _Replica()
        server, client = await _lane(replica)
        await replica.prefill_first("late", PROMPT, SamplingParams(max_tokens=4), 0)
        replica.llm_engine.requests["busy"] = object()
        outs = [await asyncio.wait_for(await _start(server, client, rid), 2) for rid in ("late", "busy")]
        client.close()
        return replica, server, outs

    replica, server, outs = asyncio.run(body())
    assert outs == [None, None] and replica.runs == ["late"] and server.started == 0


@pytest.mark.parametrize("when", ["running", "answered"])
def test_an_unclaimed_run_dropped_by_the_router_frees_its_blocks(when):
    async def body():
        replica = _Replica(run_s=0.2 if when == "running" else 0.0)
        server, client = await _lane(replica)
        first = await _start(server, client)
        await asyncio.sleep(0.05)
        client.drop(server.address, "r1")
        assert await first is None
        await asyncio.sleep(0.05)
        client.close()
        return replica

    replica = asyncio.run(body())
    if when == "running":
        assert replica.cancelled == ["r1"] and replica.released == []
    else:
        assert replica.cancelled == [] and replica.released == ["r1"]
    assert replica._first_runs == {}


def test_an_unclaimed_run_expires(monkeypatch):
    monkeypatch.setattr(disagg, "FIRST_CLAIM_S", 0.1)

    async def body():
        replica = _Replica(run_s=0.0)
        server, client = await _lane(replica)
        await _start(server, client)
        await asyncio.sleep(0.3)
        late = await replica.prefill_first("r1", PROMPT, SamplingParams(max_tokens=4), 0)  # runs again
        client.close()
        return replica, late

    replica, late = asyncio.run(body())
    assert replica.runs == ["r1", "r1"] and replica.released == ["r1", "r1"] and late.first.token_id == 7


def test_a_closed_lane_drops_its_unclaimed_runs_and_a_claimed_one_goes_on():
    async def body():
        replica = _Replica(run_s=0.2)
        server, client = await _lane(replica)
        a = await _start(server, client, "a")
        b = await _start(server, client, "b")
        call = asyncio.ensure_future(replica.prefill_first("b", PROMPT, SamplingParams(max_tokens=4), 0))
        await asyncio.sleep(0.02)
        client.close()
        ready = await call
        await asyncio.sleep(0.05)
        return replica, ready, await a, await b

    replica, ready, a, b = asyncio.run(body())
    assert replica.cancelled == ["a"] and ready.first.token_id == 7
    assert a is None and b is None  # the lane closed: the router takes token 1 from the Serve answer


def test_a_replica_that_refuses_or_finishes_at_token_1_answers_none():
    async def body():
        refused_replica = _Replica()
        server, client = await _lane(refused_replica, admit=lambda: False)
        refused = await asyncio.wait_for(await _start(server, client), 2)
        finished_replica = _Replica(finished=True)
        server2, client2 = await _lane(finished_replica)
        first = await _start(server2, client2)
        ready = await finished_replica.prefill_first("r1", PROMPT, SamplingParams(max_tokens=1), 0)
        finished = await asyncio.wait_for(first, 2)
        client.close(), client2.close()
        return refused_replica, refused, ready, finished

    replica, refused, ready, finished = asyncio.run(body())
    assert refused is None and replica.runs == []
    assert ready.finished and finished is None


def test_a_connection_without_the_token_starts_nothing():
    async def body():
        replica = _Replica()
        server, client = await _lane(replica)
        args = (server.address, "not-the-token", "r1", PROMPT, SamplingParams(max_tokens=4), 0)
        outs = []
        for _ in range(5):  # opening; then either the open connection (until the replica closes it) or opening again
            first = await client.start(*args)
            outs.append(None if first is None else await asyncio.wait_for(first, 2))
            await asyncio.sleep(0.05)
        client.close()
        return replica, server, outs

    replica, server, outs = asyncio.run(body())
    assert outs == [None] * 5 and replica.runs == [] and server.started == 0


def test_an_unreachable_lane_is_skipped_then_retried_later(monkeypatch):
    monkeypatch.setattr(prefill_lane, "RETRY_AFTER_S", 0.2)

    async def body():
        client = LaneClient()
        args = ("127.0.0.1:9", "t", "r1", PROMPT, SamplingParams(max_tokens=4), 0)  # port 9: nothing listens
        first = await client.start(*args)  # opens it in the background
        await asyncio.sleep(0.1)
        failed = dict(client._failed_at)
        again = await client.start(*args)  # not tried: within RETRY_AFTER_S of the failure
        tried_again = "127.0.0.1:9" in client._connecting
        await asyncio.sleep(0.25)
        later = await client.start(*args)  # tried again
        retried = "127.0.0.1:9" in client._connecting
        await asyncio.sleep(0.1)
        return first, again, later, failed, tried_again, retried

    first, again, later, failed, tried_again, retried = asyncio.run(body())
    assert first is None and again is None and later is None and "127.0.0.1:9" in failed
    assert not tried_again and retried


def test_the_router_ends_a_request_whose_decode_stream_did_not_go_on_from_the_lane_s_token_1():
    first = RequestOutput("r1", [], token_ids=[7])
    for same in ([7, 3], [7], []):  # went on from it (also a re-prefill that sampled it again), or no token at all
        _check_lane_first("r1", first, RequestOutput("r1", PROMPT, token_ids=same))
    with pytest.raises(BackendUnavailable, match="failed after the first token"):
        _check_lane_first("r1", first, RequestOutput("r1", PROMPT, token_ids=[8, 3]))


def _stats_replica(key: str, lane: str | None, running: int = 0):
    stats = {"running": running, "waiting": 0, **({"lane": lane, "lane_token": "t-" + key} if lane else {})}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=key), routing_stats=stats)


def test_the_router_picks_the_lane_of_the_replica_the_prefill_router_ranks_first_and_pins_the_call_to_it():
    replicas = [_stats_replica("a", "10.0.0.1:1"), _stats_replica("b", "10.0.0.2:2"), _stats_replica("c", None)]
    handle = SimpleNamespace(_router=SimpleNamespace(_asyncio_router=SimpleNamespace(
        _request_router=SimpleNamespace(curr_replicas={r.replica_id.unique_id: r for r in replicas}))))
    from router.routing import rank_for_prefill
    for prompt in ([1] * 20, [2] * 20, [3] * 20, [4] * 20, [5] * 20):
        top = rank_for_prefill(prompt, replicas, 16)[0][0]
        chosen = lane_for_prefill(handle, prompt, 16)
        key = top.replica_id.unique_id
        assert chosen == (None if key == "c" else (key, top.routing_stats["lane"], "t-" + key))
        ranked = pinned_first(rank_for_prefill(prompt, replicas, 16), "b")
        assert ranked[0][0].replica_id.unique_id == "b" and len(ranked) == 3
    assert lane_for_prefill(SimpleNamespace(), [1] * 20, 16) is None  # no replicas known yet


def test_the_prefill_pool_s_router_tries_the_replica_the_lane_chose_first():
    """The Serve call names the lane's replica (`lane_replica`); without the name, the prompt's own ranking."""
    from router.routing import PrefillAffinityRouter, rank_for_prefill

    replicas = [_stats_replica(k, None) for k in ("a", "b", "c")]
    router = object.__new__(PrefillAffinityRouter)  # only what choose_replicas reads
    router.block_size, router.imbalance = 16, 8
    prompt = [1] * 20
    natural = [r.replica_id.unique_id for [r] in rank_for_prefill(prompt, replicas, 16)]
    pin = natural[-1]  # the replica the ranking puts last
    for kwargs, want_first in (({}, natural[0]), ({"lane_replica": pin}, pin)):
        pending = SimpleNamespace(args=("r1", prompt, None, 0), kwargs=kwargs)
        ranked = asyncio.run(router.choose_replicas(replicas, pending))
        assert ranked[0][0].replica_id.unique_id == want_first and len(ranked) == 3
