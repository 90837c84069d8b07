"""The same-node KV handoff's decisions (workers/kv_transfer/peer_ipc.py), on CPU: which transfers a peer copy takes,
and how a pair agrees at join. The copy itself runs on GPUs only: tests/gpu/test_kv_transfer_gpu.py moves blocks both
ways (peer copy and NCCL) and checks them bit for bit, and tests/test_block_copy_interpreted.py checks the kernel."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from workers.kv_transfer.peer_ipc import PeerCaches, whole_heads
from workers.kv_transfer.plan import RankShard, Transfer, plan_transfers


def test_only_transfers_of_every_head_both_ranks_hold_take_the_copy():
    whole, left, right = RankShard(0, range(4), range(0, 8)), RankShard(0, range(4), range(0, 4)), RankShard(1, range(4), range(4, 8))
    t = Transfer(0, 0, range(4), range(0, 8), (0, 1))
    assert whole_heads(t, whole, whole)
    for src, dst in (([whole], [left, right]), ([left, right], [whole])):  # a reshard: a head slice on one side
        planned = plan_transfers(src, dst, range(2))
        assert planned and not any(whole_heads(p, src[p.src], dst[p.dst]) for p in planned)
    tp2 = plan_transfers([left, right], [left, right], range(2))  # the same TP on both sides: every transfer whole
    assert tp2 and all(whole_heads(p, [left, right][p.src], [left, right][p.dst]) for p in tp2)


def _join_all(peers_off: set[str], num_prefill: int = 2, num_decode: int = 2) -> dict[str, bool]:
    """Every rank of a pair joins at once through a real TCPStore (a client each), as `KVTransferAgent.join` calls it; CPU caches
    cannot be mapped, so a decode rank answers no when its prefill ranks publish handles, and so does one whose
    prefill ranks publish none (peer IPC off there)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    cache = torch.zeros(2, 2, 4, 16, 2, 8)
    answers: dict[str, bool] = {}
    ranks = [("prefill", r) for r in range(num_prefill)] + [("decode", r) for r in range(num_decode)]

    def join(role: str, rank: int) -> None:
        name = f"{role}{rank}"
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))  # a rank's own
        if role == "prefill" and name in peers_off:  # publishes an empty handle, as a rank with peer IPC off
            store.set(f"peer/{rank}", b"")
            answers[name] = all(store.get(f"peer_ok/{d}") == b"1" for d in range(num_decode))
            return
        peers = PeerCaches()
        if role == "prefill":  # a CPU cache has no IPC handle: publish a placeholder the decode side cannot map
            store.set(f"peer/{rank}", b"not a handle")
            answers[name] = all(store.get(f"peer_ok/{d}") == b"1" for d in range(num_decode))
            return
        answers[name] = peers.join(store, "p->d", role, rank, num_prefill, num_decode, cache, name not in peers_off)
        assert peers.on("p->d") == answers[name] and not peers.words

    threads = [threading.Thread(target=join, args=r) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


@pytest.mark.parametrize("off", [set(), {"prefill1"}, {"decode0"}])
def test_a_pair_copies_only_where_every_decode_rank_mapped_every_prefill_cache(off: set[str]):
    answers = _join_all(off)
    assert len(answers) == 4 and set(answers.values()) == {False}  # every rank agrees: NCCL


def test_a_pair_that_agrees_on_the_copy_says_so_and_forgets_it_when_dropped():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    store.set("peer_ok/0", b"1")  # the decode rank's answer
    peers = PeerCaches()
    assert peers.join(store, "p->d", "prefill", 0, 1, 1, torch.zeros(1, 2, 2, 16, 1, 8), True)
    assert peers.on("p->d") and not peers.on("other")
    peers.drop("p->d")
    assert not peers.on("p->d")


def test_a_prefill_cache_that_cannot_be_shared_publishes_no_handle(monkeypatch):
    """An export that raises (an allocator whose segments torch cannot share so): the prefill rank publishes b"", and
    its pair keeps NCCL rather than failing to join."""
    import workers.kv_transfer.peer_ipc as peer_ipc

    def refuse(kv_cache):
        raise RuntimeError("cannot share this allocation")

    monkeypatch.setattr(peer_ipc, "export_cache", refuse)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    store.set("peer_ok/0", b"0")
    assert not PeerCaches().join(store, "p->d", "prefill", 0, 1, 1, torch.zeros(1, 2, 2, 16, 1, 8), True)
    assert store.get("peer/0") == b""


def test_the_switch_reaches_the_agents_and_the_rank_actors(monkeypatch):
    """TANDEM_KV_PEER_IPC: on unless 0, read by each agent; the driver forwards it to the rank actors, and with it on
    every rank actor on GPUs sees its node's GPUs (to map a peer's cache), else only TP groups with the P2P all-reduce."""
    from cluster.ray_executor import ranks_see_node_gpus
    from cluster.ray_runtime import rank_runtime_env
    from parallel.config import ParallelConfig
    from workers.kv_transfer.transport import KVTransferAgent

    cache, shard = torch.zeros(1, 2, 4, 2, 1, 4), RankShard(0, range(1), range(1))
    tp1, tp2 = ParallelConfig(), ParallelConfig(tensor_parallel_size=2)
    tp2_nccl = ParallelConfig(tensor_parallel_size=2, disable_p2p_all_reduce=True)
    monkeypatch.delenv("TANDEM_KV_PEER_IPC", raising=False)
    assert KVTransferAgent(cache, shard, "decode").peer_ipc
    assert ranks_see_node_gpus(tp1, True) and not ranks_see_node_gpus(tp1, False)
    monkeypatch.setenv("TANDEM_KV_PEER_IPC", "0")
    assert not KVTransferAgent(cache, shard, "decode").peer_ipc
    assert rank_runtime_env()["env_vars"]["TANDEM_KV_PEER_IPC"] == "0"
    assert not ranks_see_node_gpus(tp1, True) and ranks_see_node_gpus(tp2, True) and not ranks_see_node_gpus(tp2_nccl, True)


class _Recorded:
    """A work that is already done."""

    def wait(self, timeout=None) -> bool:
        return True


class _RecordingGroup:
    """Records each point-to-point op a rank posts, in order."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int]] = []

    def send(self, tensors, peer: int, tag: int) -> _Recorded:
        self.ops.append(("send", peer))
        return _Recorded()

    def recv(self, tensors, peer: int, tag: int) -> _Recorded:
        self.ops.append(("recv", peer))
        return _Recorded()


@pytest.mark.parametrize("copies", [True, False], ids=["peer-copy", "nccl-messages"])
def test_warm_connects_the_ack_direction_of_a_peer_copy_pair(copies):
    """A peer-copy pair's decode ranks ack each copy back to the prefill rank: the warm-up sends that way too (the first
    ack otherwise paid NCCL's ~100 ms connection, docs/benchmarks.md, twenty-second session), after the forward
    messages and in the same order on both sides. A pair that moves KV by messages only sends prefill to decode."""
    from workers.kv_transfer.transport import KVTransferAgent, PairSpec

    spec = PairSpec("p->d", num_prefill_ranks=1, num_decode_ranks=2)
    cache = torch.zeros(1, 2, 4, 2, 1, 4)
    ops = {}
    for role, shard in (("prefill", RankShard(0, range(1), range(1))), ("decode", RankShard(1, range(1), range(1)))):
        agent = KVTransferAgent(cache, shard, role)
        group = _RecordingGroup()
        agent._groups[spec.pair_id], agent._spread[spec.pair_id] = group, [group]
        agent._peers.pairs[spec.pair_id] = copies
        agent.warm(spec)
        ops[role] = group.ops
    forward = {"prefill": [("send", 1), ("send", 2)], "decode": [("recv", 0)]}
    back = {"prefill": [("recv", 1), ("recv", 2)], "decode": [("send", 0)]}
    for role in ("prefill", "decode"):
        assert ops[role] == forward[role] + (back[role] if copies else []), role
