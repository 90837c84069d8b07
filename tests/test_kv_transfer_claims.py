"""Issue 24: on a prefill rank, a handoff's send and its abandon exclude each other (`KVTransferAgent.send`,
`abandon`), decided under the agent's lock. An abandon before the send acks at once (the replica frees the
blocks) and the later send still pairs its messages with the receiver's, but reports the handoff abandoned; an
abandon once the send has begun is a no-op, and the send's own end acks it, once. Two agents of one process,
joined by a gloo pair group (one prefill rank, one decode rank), each side on its own thread.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from workers.kv_transfer import transport
from workers.kv_transfer.plan import RankShard, plan_transfers, replica_shards
from workers.kv_transfer.transport import KVTransferAgent, PairSpec, SendResult

LAYERS, HEADS, HEAD_DIM, BS, BLOCKS = 2, 2, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = [1, 2, 3], [5, 6, 7]  # the request's blocks in each cache, by index in the sequence
SENTINEL = -7.0


class Pair:
    """A prefill agent and a decode agent over one gloo pair group (pair-ranks 0 and 1)."""

    def __init__(self):
        self.src, self.dst = replica_shards(1, 1, LAYERS, HEADS)[0], replica_shards(1, 1, LAYERS, HEADS)[0]
        cache = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
        self.prefill = KVTransferAgent(cache, self.src, "prefill", timeout_s=20.0)
        self.decode = KVTransferAgent(torch.full_like(cache, SENTINEL), self.dst, "decode", timeout_s=20.0)
        self.spec = PairSpec("p->d", 1, 1)
        self.plan = plan_transfers([self.src], [self.dst], range(len(SRC_BLOCKS)))
        host, port = self.prefill.open_store(self.spec.pair_id)
        _both(lambda: self.prefill.join(self.spec, host, port), lambda: self.decode.join(self.spec, host, port))

    def send(self, handoff_id: str) -> SendResult:
        return self.prefill.send(self.spec, self.plan, {0: self.dst}, SRC_BLOCKS, handoff_id)

    def recv(self) -> int:
        got = self.decode.recv(self.spec, self.plan, {0: self.src}, DST_BLOCKS)
        assert got.began <= got.posted <= got.ended
        return got.bytes

    def handoff(self, handoff_id: str) -> tuple[SendResult, int]:
        """One handoff: the prefill agent's send and the decode agent's receive, together."""
        return _both(lambda: self.send(handoff_id), self.recv)

    def arrived(self) -> bool:
        """The decode blocks hold the prefill blocks' KV."""
        return torch.equal(self.decode.kv_cache[:, :, DST_BLOCKS], self.prefill.kv_cache[:, :, SRC_BLOCKS])

    def acked(self, handoff_id: str, timeout_s: float = 0.0) -> bool:
        """Whether the prefill replica's send watcher would see the handoff's ack now (it collects it)."""
        return self.prefill.sent_among([handoff_id], timeout_s) == [handoff_id]


def _both(first: Callable, second: Callable) -> tuple:
    """first() on a thread of its own and second() here, together; both results (or the first error)."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = first()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    try:
        other = second()
    finally:
        thread.join(30)
    if "error" in result:
        raise result["error"]
    assert not thread.is_alive(), "the other side never returned"
    return result["value"], other


@pytest.fixture
def pair() -> Pair:
    return Pair()


def test_a_send_after_the_abandon_still_pairs_its_messages_and_reports_it(pair):
    assert pair.prefill.abandon("h-1") is True
    assert pair.acked("h-1")  # at once: the prefill replica frees the blocks now, not at the lease
    sent, received = pair.handoff("h-1")
    # The decode side had posted its receives: the send posted the matching messages all the same.
    assert received == sent.bytes > 0 and pair.arrived()
    assert sent.abandoned  # so the decode side discards them: the blocks may have been reused meanwhile
    assert not pair.acked("h-1", 0.1)  # acked once, by the abandon
    # The pair is still in step: the next handoff goes through, whole and unflagged.
    pair.decode.kv_cache.fill_(SENTINEL)
    sent, received = pair.handoff("h-2")
    assert sent.bytes == received and sent.began <= sent.ended and not sent.abandoned and pair.arrived() and pair.acked("h-2")


def test_an_abandon_once_the_send_has_begun_is_a_no_op(pair):
    """The send may be reading the blocks into a decode replica: only its end may let the replica free them."""
    pair.prefill.set_send_delay(0.5)  # the send has claimed the handoff and gathered its blocks, then stalls
    result: dict[str, tuple] = {}
    thread = threading.Thread(target=lambda: result.setdefault("handoff", pair.handoff("h-1")))
    thread.start()
    deadline = time.monotonic() + 10
    while "h-1" not in pair.prefill._sending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pair.prefill.abandon("h-1") is False
    assert not pair.acked("h-1")  # still sending: the blocks stay held
    thread.join(30)
    sent, received = result["handoff"]
    assert not sent.abandoned and sent.bytes == received and pair.arrived()
    assert pair.acked("h-1", 5.0)  # the send's end acked it
    # Abandoned again after the send ended (a late router): still a no-op, and the ack is not reported twice.
    assert pair.prefill.abandon("h-1") is False
    assert not pair.acked("h-1", 0.1)


def test_abandon_is_idempotent(pair):
    assert [pair.prefill.abandon("h-1") for _ in range(3)] == [True, False, False]
    assert pair.acked("h-1")
    assert not pair.acked("h-1", 0.1)  # reported once


def test_handoffs_are_told_apart(pair):
    """An abandon is about one handoff (one prefill): a retry of the request is a new handoff, which it leaves be."""
    pair.prefill.abandon("req#0")
    sent, _ = pair.handoff("req#1")
    assert not sent.abandoned and pair.arrived()


def _unpaired_agent() -> KVTransferAgent:
    """A prefill agent with no pair group: its sends only claim and ack (what these tests look at)."""
    agent = KVTransferAgent(torch.zeros(LAYERS, 2, BLOCKS, BS, HEADS, HEAD_DIM), RankShard(0, range(LAYERS), range(HEADS)),
                            "prefill")
    agent._send = lambda *args: 0
    return agent


def _send(agent: KVTransferAgent, handoff_id: str) -> SendResult:
    return agent.send(PairSpec("p->d", 1, 1), [], {}, [], handoff_id)


def test_decided_handoffs_are_bounded_and_a_running_send_is_never_forgotten(monkeypatch):
    monkeypatch.setattr(transport, "MAX_DECIDED_HANDOFFS", 4)
    agent = _unpaired_agent()
    release, started = threading.Event(), threading.Event()

    def stalled(*args) -> int:
        started.set()
        release.wait(10)
        return 0

    agent._send = stalled
    running = threading.Thread(target=_send, args=(agent, "running"))
    running.start()
    assert started.wait(10)
    agent._send = lambda *args: 0
    for i in range(10):
        assert not _send(agent, f"sent-{i}").abandoned
        assert agent.abandon(f"abandoned-{i}")
    assert len(agent._claimed) == len(agent._abandoned) == 4
    assert agent.abandon("sent-9") is False and _send(agent, "abandoned-9").abandoned  # the newest are remembered
    assert agent.abandon("running") is False  # 20 handoffs later: still the running send's
    release.set()
    running.join(10)
    assert agent.sent_among(["running"], 0.0) == ["running"]
    assert agent._sending == set() and "running" in agent._claimed


def test_with_phases_on_each_side_logs_where_its_time_went(pair, monkeypatch, caplog):
    """TANDEM_KV_PHASES=1 (transport.LOG_PHASES): a send and a receive each log one line of phase times."""
    import json
    import logging

    monkeypatch.setattr(transport, "LOG_PHASES", True)
    with caplog.at_level(logging.WARNING, logger=transport.__name__):
        pair.handoff("h-phases")
    lines = {}
    for record in caplog.records:
        if record.getMessage().startswith("kv phases "):
            line = json.loads(record.getMessage()[len("kv phases "):])
            lines[line["what"]] = line
    assert set(lines) == {"send", "recv"}
    assert {"index", "gather", "post", "sent"} <= set(lines["send"]["wall_ms"])
    assert {"index", "alloc", "post", "wait", "scatter", "landed"} <= set(lines["recv"]["wall_ms"])
    assert lines["recv"]["bytes"] == lines["send"]["bytes"] > 0 and lines["recv"]["messages"] == 1
    assert all(v >= 0 for side in lines.values() for v in side["wall_ms"].values()) and lines["recv"]["gil_ms"] >= 0


def test_phases_are_quiet_by_default(pair, caplog):
    import logging

    assert not transport.LOG_PHASES
    with caplog.at_level(logging.WARNING, logger=transport.__name__):
        pair.handoff("h-quiet")
    assert not [r for r in caplog.records if r.getMessage().startswith("kv phases")]
