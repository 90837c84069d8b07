"""Which pool replica takes a request: Serve request routers over the replicas' routing stats.

- Prefill: prefix affinity. The prompt's leading block is hashed onto the replicas by rendezvous
  hashing (highest hash of (block, replica) wins), so prompts that share their start (a system
  prompt, a few-shot preamble) meet the same replica's prefix cache, and a replica that joins or
  leaves moves only its share. Bounded by load: when the preferred replica's queue is longer than the
  shortest by more than `imbalance`, the shortest queues go first.
- Decode: KV capacity. The replica with the most free KV blocks first (its reservation is the
  handoff's backpressure), then the smaller running batch.

Replicas report `record_routing_stats()` (router/pools.py); Serve polls it every
`request_routing_stats_period_s`. The ranking functions are plain, so they are tested directly.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Protocol, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# How much longer than the shortest queue the preferred prefill replica's may be before load wins.
DEFAULT_IMBALANCE = 8


class _Replica(Protocol):
    @property
    def replica_id(self) -> Any: ...

    @property
    def routing_stats(self) -> dict[str, Any]: ...


def _replica_key(replica: _Replica) -> str:
    rid = replica.replica_id
    return getattr(rid, "unique_id", None) or str(rid)


def _affinity(prefix: bytes, replica: _Replica) -> bytes:
    return hashlib.blake2b(prefix + _replica_key(replica).encode(), digest_size=8).digest()


def rank_for_prefill(prompt_token_ids: Sequence[int], replicas: Sequence[_Replica], block_size: int,
                     imbalance: int = DEFAULT_IMBALANCE) -> list[list[_Replica]]:
    """Replicas in order of preference for a prompt (one replica per rank)."""
    if not replicas:
        return []
    prefix = b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt_token_ids[:block_size])
    by_affinity = sorted(replicas, key=lambda r: _affinity(prefix, r), reverse=True)
    queue = {id(r): int(r.routing_stats.get("waiting", 0)) + int(r.routing_stats.get("running", 0)) for r in replicas}
    if queue[id(by_affinity[0])] - min(queue.values()) > imbalance:
        by_affinity.sort(key=lambda r: queue[id(r)])  # stable: affinity order among equal loads
    return [[r] for r in by_affinity]


def pinned_first(ranked: list[list[_Replica]], pin: str | None) -> list[list[_Replica]]:
    """`ranked` with the replica whose key is `pin` (the one the router's prefill lane chose) first."""
    if pin is None:
        return ranked
    front = [rank for rank in ranked if any(_replica_key(r) == pin for r in rank)]
    return front + [rank for rank in ranked if rank not in front]


def lane_for_prefill(handle: Any, prompt_token_ids: Sequence[int], block_size: int
                     ) -> tuple[str, str, str] | None:
    """(replica key, lane address, lane token) of the prefill replica the prefill pool's router would choose
    first for a prompt (the same ranking over the same stats), if it has announced a lane
    (router/prefill_lane.py); None if not, or where the handle's replicas are not known yet."""
    _, replicas = _known_replicas(handle)
    if not replicas:
        return None
    ranked = rank_for_prefill(prompt_token_ids, list(replicas.values() if isinstance(replicas, dict) else replicas),
                              block_size)
    stats = getattr(ranked[0][0], "routing_stats", None) or {}
    if not stats.get("lane") or not stats.get("lane_token"):
        return None
    return _replica_key(ranked[0][0]), str(stats["lane"]), str(stats["lane_token"])


def rank_for_decode(replicas: Sequence[_Replica]) -> list[list[_Replica]]:
    """Most free KV blocks first, then the smaller running batch; replicas without stats yet last."""
    def key(r: _Replica) -> tuple[int, int]:
        stats = r.routing_stats
        return (-int(stats.get("free_blocks", -1)), int(stats.get("running", 0)))

    return [[r] for r in sorted(replicas, key=key)]


def _known_replicas(handle: Any) -> tuple[Any, Any]:
    """(the handle's asyncio router, its request router's current replicas, or None where not known: the
    router not built before its first call). Read from Serve 2.60's handle internals, defensively."""
    outer = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
    return outer, getattr(getattr(outer, "_request_router", None), "curr_replicas", None)


def live_replicas(handle: Any) -> int | None:
    """Replicas a Serve deployment handle may route to now, or None where that is not known (its router
    not built before its first call). Serve drops a replica from this set as soon as a call to it failed
    with its death (and after a failed health check), and adds a replacement once it has started: 0 means
    a call would wait for a replacement."""
    outer, replicas = _known_replicas(handle)
    if replicas is None:
        return None
    if replicas:
        try:
            outer._tandem_had_replicas = True  # see had_replicas
        except AttributeError:
            pass
    return len(replicas)


# A replica counts as busy from this many running, reserved or waiting requests. Not 1: the stats are up to a
# second old, and at one client the last request is often still counted when the next arrives, which finds the
# replica idle (on CPU at one client, a threshold of 1 routed 39 of 41 prompts an idle decode replica would have
# prefilled itself, and TTFT rose 8%). From 2 on, a replica that has emptied since is the rarer case.
BUSY_MIN_REQUESTS = 2


def pool_busy(handle: Any) -> bool:
    """Whether every replica a Serve handle may route to reported at least BUSY_MIN_REQUESTS requests (running,
    reserved or waiting) in its last routing stats (`record_routing_stats`, polled every
    `request_routing_stats_period_s`): then none is likely to take a prompt for itself for being idle
    (`LocalPrefillPolicy`). False where not known (no replica, or no stats yet)."""
    _, replicas = _known_replicas(handle)
    if not replicas:
        return False
    for replica in (replicas.values() if isinstance(replicas, dict) else replicas):
        stats = getattr(replica, "routing_stats", None) or {}
        if "running" not in stats or int(stats.get("running", 0)) + int(stats.get("waiting", 0)) < BUSY_MIN_REQUESTS:
            return False
    return True


def had_replicas(handle: Any) -> bool:
    """Whether `live_replicas` ever saw a replica for this handle: an empty set before that is a router
    not yet told of the pool's replicas (a replica's first calls), not a pool whose replicas died."""
    outer, _ = _known_replicas(handle)
    return bool(getattr(outer, "_tandem_had_replicas", False))


def never_empty(pool: Any) -> bool:
    """Whether a pool (router/config.py `PoolConfig`) always has a replica by design: a fixed size, or
    autoscaling with min_replicas >= 1 (Serve's default). Then no live replica means they died."""
    autoscaling = pool.autoscaling_config
    return autoscaling is None or autoscaling.get("min_replicas", 1) > 0


class ReplicasGone(ConnectionError):
    """Every replica a call could go to has died under it: Serve would hold the call for a replacement."""


REPLICAS_POLL_S = 0.05  # how often a call waiting for its first answer looks whether its pool still has a replica
# A handle that has never seen a replica learns the pool's replicas from Serve's controller within
# milliseconds of its first call (tens of ms on a loaded CPU box); still none after this, there are none.
UNSEEN_POOL_GRACE_S = 1.0


async def first_unless_replicas_gone(stream: Any, handle: Any, already_empty_fails: bool) -> Any:
    """A Serve stream's first item, or `ReplicasGone` as soon as the handle's pool has no live replica.
    A replica that dies under a call (or before it, unnoticed) makes Serve retry the call on another one;
    with none left, Serve holds it until a replacement has started (seconds on a GPU node, more on CPU).
    `already_empty_fails`: also when the pool had no replica at the call (else that wait is Serve's: a
    pool scaling up from zero). A handle that never saw a replica (this process never called the pool
    before, e.g. a decode replica whose router does the prefill calls) cannot tell a pool whose replicas
    died from its own first update not yet in: it waits `UNSEEN_POOL_GRACE_S` for one. StopAsyncIteration
    if the stream ends empty."""
    first = asyncio.ensure_future(anext(aiter(stream)))
    armed = bool(live_replicas(handle)) or (already_empty_fails and had_replicas(handle))
    unseen_since = time.monotonic()
    try:
        while True:
            live = live_replicas(handle)
            if armed and live == 0:
                raise ReplicasGone("no live replica is left to serve the call")
            if (already_empty_fails and not armed and not live
                    and time.monotonic() - unseen_since > UNSEEN_POOL_GRACE_S):
                raise ReplicasGone(f"the pool has had no live replica for {UNSEEN_POOL_GRACE_S:g}s")
            armed = armed or bool(live)
            done, _ = await asyncio.wait({first}, timeout=REPLICAS_POLL_S)
            if done:
                return first.result()
    finally:
        if not first.done():
            first.cancel()
            # Serve's stream turns its cancellation into RequestCancelledError, so the task ends with an exception
            # nobody awaits: asyncio would log it with a traceback ("Task exception was never retrieved", 65 times
            # in one fault run on GPUs). It is read here instead: the call's outcome is the ReplicasGone (or the
            # cancellation) raised above.
            first.add_done_callback(_drop_outcome)


def _drop_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class PrefillAffinityRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = DEFAULT_IMBALANCE, **kwargs) -> None:
        self.block_size = block_size
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        prompt = _prefill_prompt(pending_request)
        if prompt is None:  # health probes and other calls: any replica
            return [candidate_replicas]
        ranked = rank_for_prefill(prompt, candidate_replicas, self.block_size, self.imbalance)
        pin = (getattr(pending_request, "kwargs", None) or {}).get("lane_replica")
        return pinned_first(ranked, pin if isinstance(pin, str) else None)


class DecodeCapacityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return rank_for_decode(candidate_replicas)


def _prefill_prompt(pending: PendingRequest | None) -> list[int] | None:
    """PrefillPool.prefill(request_id, prompt_token_ids, params, priority, reservation): the prompt."""
    if pending is None:
        return None
    args = getattr(pending, "args", None) or ()
    if len(args) >= 2 and isinstance(args[1], list):
        return args[1]
    prompt = (getattr(pending, "kwargs", None) or {}).get("prompt_token_ids")
    return prompt if isinstance(prompt, list) else None
