"""The pool routing policies (router/routing.py) on stand-in replicas."""
from __future__ import annotations

from dataclasses import dataclass, field

from router.routing import rank_for_decode, rank_for_prefill


@dataclass
class FakeReplica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


def _first(ranks):
    return ranks[0][0].replica_id


def test_same_leading_block_goes_to_the_same_prefill_replica():
    replicas = [FakeReplica(f"p{i}") for i in range(4)]
    system = list(range(100, 116))  # one 16-token block shared by every prompt
    picks = {_first(rank_for_prefill(system + [i, i + 1], replicas, block_size=16)) for i in range(20)}
    assert len(picks) == 1
    # ...and different leading blocks spread over the replicas.
    spread = {_first(rank_for_prefill(list(range(s, s + 16)), replicas, block_size=16)) for s in range(0, 4000, 97)}
    assert spread == {"p0", "p1", "p2", "p3"}


def test_affinity_is_stable_when_another_replica_leaves():
    replicas = [FakeReplica(f"p{i}") for i in range(4)]
    prompts = [list(range(s, s + 16)) for s in range(0, 3000, 31)]
    before = [_first(rank_for_prefill(p, replicas, 16)) for p in prompts]
    after = [_first(rank_for_prefill(p, replicas[:3], 16)) for p in prompts]
    moved = [b for b, a in zip(before, after) if b != a]
    assert moved and set(moved) == {"p3"}  # only the departed replica's prompts move


def test_overloaded_preferred_prefill_replica_yields_to_the_least_loaded():
    replicas = [FakeReplica(f"p{i}") for i in range(3)]
    prompt = list(range(16))
    preferred = _first(rank_for_prefill(prompt, replicas, 16))
    for r in replicas:
        r.routing_stats = {"waiting": 20 if r.replica_id == preferred else 1}
    ranks = rank_for_prefill(prompt, replicas, 16, imbalance=8)
    assert _first(ranks) != preferred and ranks[-1][0].replica_id == preferred
    # Within the bound, affinity still wins.
    for r in replicas:
        r.routing_stats = {"waiting": 5 if r.replica_id == preferred else 0}
    assert _first(rank_for_prefill(prompt, replicas, 16, imbalance=8)) == preferred


def test_decode_prefers_free_kv_blocks_then_smaller_batches():
    replicas = [FakeReplica("d0", {"free_blocks": 10, "running": 1}), FakeReplica("d1", {"free_blocks": 90, "running": 7}),
                FakeReplica("d2", {"free_blocks": 90, "running": 3}), FakeReplica("d3", {})]
    assert [r[0].replica_id for r in rank_for_decode(replicas)] == ["d2", "d1", "d0", "d3"]


def _handle(*stats: dict | None):
    """A Serve handle whose router knows replicas with these last routing stats (None: no stats yet)."""
    from types import SimpleNamespace

    replicas = {i: SimpleNamespace(routing_stats=s or {}) for i, s in enumerate(stats)}
    return SimpleNamespace(_router=SimpleNamespace(_asyncio_router=SimpleNamespace(
        _request_router=SimpleNamespace(curr_replicas=replicas))))


def test_a_pool_is_busy_only_when_every_replica_reported_work():
    from router.routing import pool_busy

    busy, idle = {"free_blocks": 10, "running": 3, "waiting": 0}, {"free_blocks": 90, "running": 0, "waiting": 0}
    assert pool_busy(_handle(busy, {"running": 0, "waiting": 2}))
    assert not pool_busy(_handle(busy, idle))  # that idle replica may prefill a prompt itself
    assert not pool_busy(_handle(busy, {"running": 1, "waiting": 0}))  # one client's last request: maybe done now
    assert not pool_busy(_handle(busy, None))  # no stats yet: not known
    assert not pool_busy(_handle())  # no replica
    assert not pool_busy(object())  # not a Serve 2.60 handle: not known


def test_the_router_prefills_a_prompt_an_idle_decode_replica_would_take_only_when_none_is_idle_or_over_a_lane():
    from router.disaggregated import DisaggregatedBackend

    backend = object.__new__(DisaggregatedBackend)  # only what routes_prefill reads
    backend.router_prefill, backend.local_prefill_max_tokens, backend.local_prefill_idle_tokens = True, 256, 8192
    backend.lanes = None  # Serve calls only
    busy, idle = {"running": 5, "waiting": 1}, {"running": 0, "waiting": 0}
    backend.decode = _handle(busy, busy)
    assert backend.routes_prefill(2048) and backend.routes_prefill(9000)
    assert not backend.routes_prefill(200)  # any decode replica prefills it itself
    backend.decode = _handle(busy, idle)
    assert not backend.routes_prefill(2048)  # the idle replica may take it: its decode replica decides
    assert backend.routes_prefill(9000)  # above one step: every decode replica hands it off
    backend.lanes = object()  # with a prefill lane, token 1 comes as fast from the prefill pool: routed anyway
    assert backend.routes_prefill(2048) and not backend.routes_prefill(200)
    backend.router_prefill = False
    assert not backend.routes_prefill(9000)
