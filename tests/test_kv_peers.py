"""router/kv_peers.py: prefill replicas announce their ranks in a KV; decode replicas warm a pair with each once."""
from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from router import kv_peers
from tests.test_replica_metrics import MemoryKV


def test_announced_replicas_are_read_back_per_application_and_withdrawn():
    kv = MemoryKV()
    kv_peers.announce(kv, "app", "prefill-a", ["handle-a0", "handle-a1"], ["shard-a0", "shard-a1"])
    kv_peers.announce(kv, "app", "prefill-b", ["handle-b0"], ["shard-b0"])
    kv_peers.announce(kv, "other", "prefill-c", ["handle-c0"], ["shard-c0"])
    kv.put("app/garbled", b"not a pickle")  # skipped, not fatal
    assert sorted(kv_peers.peers(kv, "app")) == [("prefill-a", ["handle-a0", "handle-a1"], ["shard-a0", "shard-a1"]),
                                                 ("prefill-b", ["handle-b0"], ["shard-b0"])]
    assert [p[0] for p in kv_peers.peers(kv, "app", skip={"prefill-a"})] == ["prefill-b"]
    kv_peers.withdraw(kv, "app", "prefill-a")
    assert [p[0] for p in kv_peers.peers(kv, "app")] == ["prefill-b"]


def test_each_replica_is_warmed_once_a_failure_is_retried_and_a_dead_one_is_forgotten():
    kv = MemoryKV()
    kv_peers.announce(kv, "app", "ok", ["h"], ["s"])
    kv_peers.announce(kv, "app", "flaky", ["h"], ["s"])
    kv_peers.announce(kv, "app", "dead", ["h"], ["s"])
    calls: list[str] = []
    flaky_failures = [RuntimeError("store not up yet")]

    async def warm(replica_id: str, handles: list, shards: list) -> bool:
        calls.append(replica_id)
        if replica_id == "dead":
            raise ActorDiedError()
        if replica_id == "flaky" and flaky_failures:
            raise flaky_failures.pop()
        return True

    async def main() -> None:
        task = asyncio.ensure_future(kv_peers.warm_pairs_forever(warm, kv, "app", poll_s=0.01))
        await asyncio.sleep(0.3)
        kv_peers.announce(kv, "app", "late", ["h"], ["s"])  # a replica that starts later is warmed too
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sorted(calls) == ["dead", "flaky", "flaky", "late", "ok"]
    assert sorted(p[0] for p in kv_peers.peers(kv, "app")) == ["flaky", "late", "ok"]  # the dead one's entry is gone
