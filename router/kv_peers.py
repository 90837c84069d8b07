"""Warm KV pairs: every prefill replica announces its rank actors, and every decode replica builds its transfer
group with each prefill replica it learns of before a request needs it.

A pair's group (workers/kv_transfer/transport.py) used to be built by the pair's first handoff, and NCCL creates
its communicator on the pair's first message: on 2 x H100 the first handed-off request waited ~950 ms for its
receive to be posted (docs/benchmarks.md, "Ninth session"), after the app's start and again after every scale-up
or replacement of a replica. Now a prefill replica puts (its id, its rank actors' handles, their shards) in Ray's
internal KV under `<application>/<replica id>` (`announce`); each decode replica reads that every `POLL_S`
seconds and warms the pairs it has not built (`DecodeReplica.warm_pair`: join and one byte each way). A replica
that shuts down takes its entry away (`withdraw`); one that was killed leaves it, and the first decode replica
that finds its actors dead deletes it. The handles travel pickled: a Ray actor handle unpickled in another
process reaches the same actor (it does not keep it alive, which the prefill replica does).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import time
from typing import Awaitable, Callable

from router.replica_metrics import KeyValue, RayKV

log = logging.getLogger(__name__)

NAMESPACE = "tandem_kv_peers"
POLL_S = 2.0  # how often a decode replica looks for prefill replicas it has not warmed a pair with


def peers_kv() -> KeyValue:
    return RayKV(NAMESPACE)


def peer_key(app: str, replica_id: str) -> str:
    return f"{app}/{replica_id}"


def announce(kv: KeyValue, app: str, replica_id: str, rank_handles: list, shards: list) -> None:
    kv.put(peer_key(app, replica_id), pickle.dumps((replica_id, rank_handles, shards)))


def withdraw(kv: KeyValue, app: str, replica_id: str) -> None:
    kv.delete(peer_key(app, replica_id))


def peers(kv: KeyValue, app: str, skip: set[str] = frozenset()) -> list[tuple[str, list, list]]:
    """Every announced prefill replica of the application but those in `skip` (read no further than their keys):
    (replica id, rank handles, shards). An entry that cannot be read (another version's, half written) is skipped."""
    found = []
    for key in kv.keys(f"{app}/"):
        if key.removeprefix(f"{app}/") in skip:
            continue
        value = kv.get(key)
        if value is None:
            continue
        try:
            replica_id, handles, shards = pickle.loads(value)
        except Exception:  # noqa: BLE001 - not ours to fail on
            log.debug("unreadable KV peer entry %s", key, exc_info=True)
            continue
        found.append((replica_id, handles, shards))
    return found


def is_dead_actor(e: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), RayActorError)


async def warm_pairs_forever(warm: Callable[[str, list, list], Awaitable[bool]], kv: KeyValue, app: str,
                             poll_s: float = POLL_S) -> None:
    """A decode replica's loop: warm (`DecodeReplica.warm_pair`) a pair with every announced prefill replica, once
    each; a failed warm-up is tried again at the next poll, unless the replica's actors are dead (its entry is
    deleted then: a killed replica cannot withdraw it)."""
    warmed: set[str] = set()
    failed: set[str] = set()  # replicas whose warm-up failed once: later failures are logged at debug level
    while True:
        try:
            found = await asyncio.to_thread(peers, kv, app, warmed)
        except Exception:  # noqa: BLE001 - the GCS briefly away: the next poll
            log.debug("reading the KV peers failed", exc_info=True)
            found = []
        for replica_id, handles, shards in found:
            try:
                start = time.monotonic()
                if await warm(replica_id, handles, shards):
                    log.info("warmed the KV pair with %s in %.2fs", replica_id, time.monotonic() - start)
                warmed.add(replica_id)
            except Exception as e:  # noqa: BLE001 - the pair's first handoff builds it instead
                if is_dead_actor(e):
                    log.info("prefill replica %s is gone; forgetting its KV peer entry", replica_id)
                    await asyncio.to_thread(withdraw, kv, app, replica_id)
                    warmed.add(replica_id)
                else:
                    log.log(logging.DEBUG if replica_id in failed else logging.WARNING,
                            "warming the KV pair with %s failed (retried every %.0fs): %s", replica_id, poll_s, e)
                    failed.add(replica_id)
        await asyncio.sleep(poll_s)
