"""`KVTransferAgent` over NCCL between two GPUs, one process each (the harness of
scripts/bench_kv_transfer.py): the received blocks equal the sent blocks, bit for bit.

TP 1 -> 1 moves every head. A TP 2 -> 1 reshard needs 3 GPUs (two prefill ranks, one decode rank), so
its two halves are checked with one sender and one receiver: the sender gathering a slice of its heads
(a decode rank of a wider TP taking its share) and the receiver scattering into a slice of its heads
(one prefill rank of a wider TP delivering its share) while the other heads stay untouched. Last, the
benchmark runs end to end on a small prompt and verifies its own transfers.
"""
from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from workers.kv_transfer.plan import RankShard, Transfer, plan_transfers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_kv_transfer as bench  # noqa: E402

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")]

# Llama-3.1-8B's per-block shape, over a small cache.
LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 32, 8, 128, 16, 24
SRC_BLOCKS = [5, 17, 3, 20, 11, 23, 0]  # a prompt's block table on the prefill side...
DST_BLOCKS = [9, 1, 22, 12, 4, 0, 15]  # ...and the blocks the decode side reserved for it
SENTINEL = -7.0

CASES = {  # (heads the prefill rank holds, heads the decode rank holds, heads sent)
    "tp1->tp1": (range(0, 8), range(0, 8), range(0, 8)),
    "gather-head-slice": (range(0, 8), range(4, 8), range(4, 8)),  # decode rank 1 of TP 2, from a TP 1 prefill
    "scatter-head-slice": (range(4, 8), range(0, 8), range(4, 8)),  # prefill rank 1 of TP 2, into a TP 1 decode
}


def _source_kv() -> torch.Tensor:
    """Every head of the prompt's KV as the prefill side computed it: distinct values, the same in both processes."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def _heads(r: range, base: range) -> slice:
    return slice(r.start - base.start, r.stop - base.start)


def _transfer_case(rank: int, args: tuple) -> dict:
    """Runs in each GPU process: rank 0 sends the case's heads of SRC_BLOCKS, rank 1 receives them into DST_BLOCKS;
    `peer`: the pair may copy out of the mapped prefill cache (KVTransferAgent.peer_ipc), else NCCL messages."""
    name, device_type, *rest = args
    peer = rest[0] if rest else True
    src_heads, dst_heads, sent = CASES[name]
    device = bench.rank_device(rank, device_type)
    src, dst = RankShard(0, range(LAYERS), src_heads), RankShard(0, range(LAYERS), dst_heads)
    plan = [Transfer(0, 0, range(LAYERS), sent, tuple(range(len(SRC_BLOCKS))))]
    full = _source_kv()
    if rank == 0:
        cache = full[:, :, :, :, _heads(src_heads, range(HEADS))].contiguous().to(device)
    else:
        cache = torch.full((LAYERS, 2, NUM_BLOCKS, BLOCK, len(dst_heads), HEAD_DIM), SENTINEL, dtype=torch.bfloat16, device=device)
    agent, spec = bench.connect_agents(rank, cache, src if rank == 0 else dst, timeout_s=60.0)
    agent.peer_ipc = peer
    copied = agent._peer_copy(spec, plan[0], src, dst)  # the path this transfer takes
    if rank == 0:
        return {"bytes": agent.send(spec, plan, {0: dst}, SRC_BLOCKS, "req-0").bytes, "peer_copy": copied}
    received = agent.recv(spec, plan, {0: src}, DST_BLOCKS, SRC_BLOCKS).bytes
    bench.synchronize()
    expected = torch.full_like(cache, SENTINEL, device="cpu")
    for s, d in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
        expected[:, :, d, :, _heads(sent, dst_heads)] = full[:, :, s, :, _heads(sent, range(HEADS))]
    got = cache.cpu()
    return {"bytes": received, "equal": torch.equal(got, expected), "peer_copy": copied,
            "mismatched_blocks": sorted({int(b) for b in (got != expected).nonzero()[:, 2].tolist()})}


@pytest.mark.parametrize("peer", [True, False], ids=["peer-ipc", "nccl"])
@pytest.mark.parametrize("name", list(CASES))
def test_received_blocks_equal_sent_blocks(name: str, peer: bool):
    """peer-ipc: one process a GPU, each seeing both (as the benchmark's and a TP group's rank actors do), so a
    transfer of whole heads is copied out of the mapped prefill cache; a head slice keeps NCCL messages."""
    src_heads, dst_heads, sent = CASES[name]
    if name != "scatter-head-slice":  # there, the other heads would come from the TP group's other prefill rank
        assert plan_transfers([RankShard(0, range(LAYERS), src_heads)], [RankShard(0, range(LAYERS), dst_heads)], range(len(SRC_BLOCKS))) == \
            [Transfer(0, 0, range(LAYERS), sent, tuple(range(len(SRC_BLOCKS))))]
    sender, receiver = bench.run_pair(_transfer_case, (name, "cuda", peer), timeout_s=300.0)
    assert sender["peer_copy"] == receiver["peer_copy"] == (peer and name == "tp1->tp1")
    nbytes = len(SRC_BLOCKS) * LAYERS * 2 * BLOCK * len(sent) * HEAD_DIM * 2
    assert sender["bytes"] == receiver["bytes"] == nbytes
    assert receiver["equal"], f"blocks that differ from what was sent (or were written outside the slice): {receiver['mismatched_blocks']}"


# (prompt blocks, min_messages, lean, split): the lane path (workers/kv_transfer/lanes.py) over prompts of several
# lengths (its buffers' storage grows, then is viewed smaller), cut into two messages by min_messages or by split_bytes
# (split: every transfer of at least one byte goes as two), repeated (kept buffers and planned copies reused), and the
# ordinary path between them on the same caches.
LANE_RUNS = [(7, 1, True, False), (3, 1, True, False), (12, 1, True, False), (7, 1, True, False), (12, 2, True, False),
             (5, 2, True, False), (12, 1, False, False), (7, 1, True, True), (12, 1, True, True), (12, 1, False, True),
             (7, 1, True, False)]


def _lane_runs(rank: int, args: tuple[str, int]) -> dict:
    """Each LANE_RUNS transfer of fresh random blocks over a pair of `groups` process groups, checked on the receiver
    against the sender's blocks."""
    device_type, groups = args
    device = bench.rank_device(rank, device_type)
    shard = RankShard(0, range(LAYERS), range(HEADS))
    full = _source_kv().to(device)
    cache = full.clone() if rank == 0 else torch.full_like(full, SENTINEL)
    agent, spec = bench.connect_agents(rank, cache, shard, timeout_s=60.0, groups=groups)
    agent.long_bytes = 0 if groups > 1 else agent.long_bytes  # two groups: every transfer's messages take them in turn
    agent.peer_ipc = False  # lanes carry NCCL messages; a peer-copied pair takes none
    rng, results = random.Random(1), []
    for k, (n, min_messages, lean, split) in enumerate(LANE_RUNS):
        src, dst = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
        agent.min_messages, agent.lean, agent.split_bytes = min_messages, lean, 1 if split else 0
        plan = plan_transfers([shard], [shard], range(n))
        if rank == 0:
            agent.send(spec, plan, {0: shard}, src, f"req-{k}")
            continue
        cache.fill_(SENTINEL)
        agent.recv(spec, plan, {0: shard}, dst, src)
        bench.synchronize()
        expected = torch.full_like(cache, SENTINEL)
        expected[:, :, dst] = full[:, :, src]
        results.append(bool(torch.equal(cache, expected)))
    lanes = agent._lanes
    return {"equal": results, "lanes": lanes._count, "free": len(lanes._free)}


@pytest.mark.parametrize("groups", [1, 2])
def test_lane_transfers_land_bit_for_bit(groups: int):
    """groups 2: each transfer's messages over the pair's two communicators in turn (KVTransferAgent.pair_groups, with
    every transfer counted long)."""
    sender, receiver = bench.run_pair(_lane_runs, ("cuda", groups), timeout_s=300.0)
    assert receiver["equal"] == [True] * len(LANE_RUNS)
    for side in (sender, receiver):  # one lane made and given back after every transfer (none dropped)
        assert side["lanes"] == 1 and side["free"] == 1


def test_bench_script_runs_and_verifies(tmp_path: Path):
    out = tmp_path / "kv_transfer.json"
    report = bench.main(["--tokens", "256", "1024", "--layers", "4", "--warmup", "1", "--iters", "2", "--out", str(out)])
    rows = report["results"]
    assert [r["tokens"] for r in rows] == [256, 1024]
    assert [r["bytes"] for r in rows] == [n // 16 * report["bytes_per_block"] for n in (256, 1024)]
    assert all(r["verified"] and r["agent_gbps"] > 0 and r["raw_gbps"] > 0 for r in rows)
    assert json.loads(out.read_text())["results"] == rows


# Four numbered transfers of one pair in flight at once (issue 24, item 2), each of its own blocks; their calls reach
# each rank in another order than their numbers, and each rank posts them in number order (`_PostOrder`).
IN_FLIGHT = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6]}  # seq -> indices into SRC_BLOCKS / DST_BLOCKS
PIECE_SEQ = 3  # sent as a piece of a prompt still being prefilled: its blocks are written on the engine's stream late


def _in_flight_case(rank: int, device_type: str) -> dict:
    """Rank 0 sends, rank 1 receives, four transfers on threads of their own. Transfer PIECE_SEQ's source blocks hold
    zeros until a write queued on the default stream behind a ~50 ms sleep (a prefill chunk still running): its send,
    with piece=True, must gather only after that write: it waits for the event recorded after it (`ChunkEnds`, as a
    prefill rank's model runner records one per chunk), while another sleep (the next chunk) follows on the stream."""
    import threading

    from workers.kv_transfer.chunk_ends import ChunkEnds

    device = bench.rank_device(rank, device_type)
    shard = RankShard(0, range(LAYERS), range(HEADS))
    full = _source_kv()
    if rank == 0:
        cache = full.to(device)
    else:
        cache = torch.full((LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM), SENTINEL, dtype=torch.bfloat16, device=device)
    agent, spec = bench.connect_agents(rank, cache, shard, timeout_s=60.0)
    bench.sync_start(rank)
    piece_src = [SRC_BLOCKS[i] for i in IN_FLIGHT[PIECE_SEQ]]
    if rank == 0 and device.type == "cuda":
        cache[:, :, piece_src] = 0
        torch.cuda._sleep(100_000_000)  # the chunk still computing, on the engine's (default) stream
        cache[:, :, piece_src] = full[:, :, piece_src].to(device, non_blocking=False)
        agent.chunk_ends = ChunkEnds()
        agent.chunk_ends.record(_chunk_step("piece-req", 64))  # the event after the write
        torch.cuda._sleep(100_000_000)  # the next chunk: the piece need not wait for it
    results, errors = {}, []

    def one(seq: int) -> None:
        try:
            torch.cuda.set_device(device) if device.type == "cuda" else None
            idx = IN_FLIGHT[seq]
            plan = [Transfer(0, 0, range(LAYERS), range(HEADS), tuple(range(len(idx))))]
            if rank == 0:
                results[seq] = agent.send(spec, plan, {0: shard}, [SRC_BLOCKS[i] for i in idx], f"h{seq}", seq,
                                          seq == PIECE_SEQ, ("piece-req", 64) if seq == PIECE_SEQ else None).bytes
            else:
                results[seq] = agent.recv(spec, plan, {0: shard}, [DST_BLOCKS[i] for i in idx], [SRC_BLOCKS[i] for i in idx],
                                          seq, seq == PIECE_SEQ).bytes
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    order = [3, 2, 1, 0] if rank == 0 else [2, 3, 0, 1]
    threads = [threading.Thread(target=one, args=(seq,)) for seq in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bench.synchronize()
    out = {"bytes": sum(results.values()), "errors": errors}
    if rank == 1:
        expected = torch.full_like(cache, SENTINEL, device="cpu")
        for s, d in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
            expected[:, :, d] = full[:, :, s]
        got = cache.cpu()
        out.update(equal=torch.equal(got, expected),
                   mismatched_blocks=sorted({int(b) for b in (got != expected).nonzero()[:, 2].tolist()}))
    return out


def _chunk_step(seq_id: str, tokens: int):
    """A step that runs `tokens` prompt tokens of `seq_id` and samples nothing (a prefill chunk), as ChunkEnds sees it."""
    from workers.sampling_params import SamplingParams
    from workers.scheduler_output import ScheduledSeq, SchedulerOutput

    return SchedulerOutput(seqs=[ScheduledSeq(seq_id, [0] * tokens, 0, [], False, SamplingParams(), 0)])


def test_numbered_transfers_in_flight_together_land_bit_for_bit_and_a_piece_waits_for_its_chunk():
    sender, receiver = bench.run_pair(_in_flight_case, "cuda", timeout_s=300.0)
    assert not sender["errors"] and not receiver["errors"], (sender["errors"], receiver["errors"])
    assert sender["bytes"] == receiver["bytes"] == len(SRC_BLOCKS) * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2
    assert receiver["equal"], f"blocks that differ from what was sent: {receiver['mismatched_blocks']} " \
                              f"(the piece's are {[DST_BLOCKS[i] for i in IN_FLIGHT[PIECE_SEQ]]})"


# ---- Many transfers in flight on one pair, as served rank actors run them (issue 24, item 2) ----
# Several in flight (`kv_transfers_in_flight` > 1) failed end to end once on 2 x H200; this passed on 2 x H100
# (engine/disagg.py, at TRANSFERS_IN_FLIGHT_DEFAULT, says what is known). This drives the real agent
# over NCCL the way a served pair does, without an engine: transfers of mixed sizes numbered on the pair, started on a
# pool of 16 threads (a rank actor's) in another order than their numbers, at most WINDOW at once; the prefill side
# frees each transfer's blocks the moment its send returns and overwrites them (a freed block reused by the next
# prefill), the decode side checks each transfer's blocks on another stream the moment its receive returns. Every
# transfer carries its own contents, and every row of a block starts with (transfer, block): a wrong block names
# where its bytes came from. A transfer stuck past the agent's timeout fails; a process stuck past that is killed,
# and the failure shows both ranks' progress logs and Python stacks.
@dataclass(frozen=True)
class StressShape:
    layers: int = 32  # Llama-3.1-8B's: 2 MiB a block in bf16
    heads: int = 8
    dim: int = 128
    block: int = 16
    cache_blocks: int = 1024  # 2 GiB a cache
    sizes: tuple[int, ...] = (1, 2, 3, 5, 8, 16, 33, 64, 100, 160)  # blocks a transfer (160: two messages of 16 layers)
    device: str = "cuda"  # "cpu": the same run over gloo, a check of the harness itself
    peer: bool = True  # KVTransferAgent.peer_ipc: the decode rank copies out of the mapped prefill cache; False: NCCL


S_PHASES = (("serial", 1, False), ("in-flight-4", 4, False), ("in-flight-8-busy", 8, True))  # (name, window, busy GPU)
S_TRANSFERS = 96  # a phase
# A transfer stuck this long fails (and drops the pair); a run stuck this long has its stacks dumped, then is killed.
S_AGENT_TIMEOUT_S, S_DUMP_STACKS_S, S_KILL_S = 15.0, 50.0, 60.0
# The two-GPU handoff test's model (models/tandem-tiny: 16 KiB blocks, prompts of 1-12 blocks), and Llama-3.1-8B's.
_TINY = dict(layers=4, heads=2, dim=32, cache_blocks=256, sizes=(1, 2, 3, 4, 5, 8, 12))
STRESS_SHAPES = {"tiny": StressShape(**_TINY), "tiny-nccl": StressShape(**_TINY, peer=False), "llama8b": StressShape()}
POISON_WORD, FRESH_WORD = -21846, 21845  # 0xAAAA: a prefill block freed after its send; 0x5555: a decode block unwritten


def _stress_content(shape: StressShape, seq: int, n: int, device: torch.device) -> torch.Tensor:
    """Transfer seq's KV [L, 2, n, block, H, D] as int16 words: a hash of (seq, position), each row's first two words
    (seq, block in the transfer). Integer arithmetic, so both GPUs make the same words."""
    dims = (shape.layers, 2, n, shape.block, shape.heads, shape.dim)
    x = torch.arange(math.prod(dims), dtype=torch.int32, device=device) * 1103515245 + (seq * 2654435 + 12345)
    words = (x ^ (x >> 15)).to(torch.int16).view(dims)
    words[..., 0] = seq
    words[..., 1] = torch.arange(n, dtype=torch.int16, device=device).view(1, 1, n, 1, 1)
    return words


def _stress_bad_blocks(shape: StressShape, cache: torch.Tensor, ids: list[int], seq: int) -> list[str]:
    """The decode side's check of transfer seq, on this thread's default stream (not the agent's), at once: what each
    wrong block holds instead."""
    want = _stress_content(shape, seq, len(ids), cache.device)
    got = cache.view(torch.int16)[:, :, ids]
    bad = (got != want).transpose(0, 2).reshape(len(ids), -1).any(1).nonzero().flatten().tolist()
    found = []
    for j in bad[:6]:
        words, wrong = got[:, :, j], (got[:, :, j] != want[:, :, j]).float().mean().item()
        if bool((words == POISON_WORD).all()):
            what = "the prefill side's poison: read after its send had returned (freed before its gather ran?)"
        elif bool((words == FRESH_WORD).all()):
            what = "nothing: never written"
        else:
            what = f"a row headed (transfer {int(words[0, 0, 0, 0, 0])}, block {int(words[0, 0, 0, 0, 1])})"
        found.append(f"transfer {seq} block {j}/{len(ids)}: {wrong:.1%} of its words wrong; holds {what}")
    return found + ([f"transfer {seq}: {len(bad)} of {len(ids)} blocks wrong"] if len(bad) > 6 else [])


class _BlockPool:
    """A cache's free blocks; a transfer takes scattered ones (as block tables are) and gives them back when done."""

    def __init__(self, n: int, seed: int):
        self.free, self._rng, self._cond = list(range(n)), random.Random(seed), threading.Condition()

    def take(self, n: int, timeout_s: float) -> list[int]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.free) >= n, timeout_s):
                raise TimeoutError(f"{n} free blocks did not come in {timeout_s:.0f}s")
            self._rng.shuffle(self.free)
            taken, self.free = self.free[:n], self.free[n:]
            return taken

    def give(self, ids: list[int]) -> None:
        with self._cond:
            self.free.extend(ids)
            self._cond.notify_all()


def _busy_gpu(device: torch.device, stop: threading.Event) -> None:
    """An engine's steps on a stream of their own: matmuls, and a host sync every few (its sampled tokens)."""
    torch.cuda.set_device(device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        while not stop.is_set():
            for _ in range(8):
                a @ a
            torch.cuda.current_stream().synchronize()


class _StressRank:
    """One rank's side of the run (rank 0 sends, rank 1 receives), phase by phase, on a pool of 16 threads."""

    def __init__(self, rank: int, shape: StressShape, log) -> None:
        self.rank, self.shape, self.log, self._log_lock = rank, shape, log, threading.Lock()
        self.device = bench.rank_device(rank, shape.device)
        self.cache = torch.zeros(shape.layers, 2, shape.cache_blocks, shape.block, shape.heads, shape.dim,
                                 dtype=torch.bfloat16, device=self.device)
        self.cache.view(torch.int16).fill_(POISON_WORD if rank == 0 else FRESH_WORD)
        self.shard = RankShard(0, range(shape.layers), range(shape.heads))
        self.agent, self.spec = bench.connect_agents(rank, self.cache, self.shard, timeout_s=S_AGENT_TIMEOUT_S)
        self.agent.peer_ipc = shape.peer
        self._stores = threading.local()  # a store client per thread: a blocking get holds its client
        self.agent.warm(self.spec)  # the communicator and the copy kernels, as a served pair's warm-up
        self.threads = ThreadPoolExecutor(max_workers=16)

    def note(self, text: str) -> None:
        with self._log_lock:
            self.log.write(f"{time.monotonic():.3f} rank {self.rank}: {text}\n")

    def phase(self, name: str, first_seq: int, sizes: list[int], window: int, busy: bool) -> dict:
        """Transfers first_seq.. of `sizes` blocks, at most `window` at once, submitted in pairs in reverse order."""
        report = {"bad": [], "errors": [], "unfinished": []}
        pool, slots, batch, futures = _BlockPool(self.shape.cache_blocks, 17 + self.rank), threading.Semaphore(window), [], {}
        stop = threading.Event()
        busy = busy and self.device.type == "cuda"
        noise = threading.Thread(target=_busy_gpu, args=(self.device, stop), daemon=True) if busy else None
        noise.start() if noise else None
        start = time.perf_counter()
        try:
            for k, n in enumerate(sizes):
                if not slots.acquire(timeout=3 * S_AGENT_TIMEOUT_S):
                    raise TimeoutError(f"no transfer slot freed in {3 * S_AGENT_TIMEOUT_S:.0f}s")
                ids = pool.take(n, 3 * S_AGENT_TIMEOUT_S)
                if self.rank == 0:  # the prompt's KV, computed before its send starts (its first token on the host)
                    self.cache.view(torch.int16)[:, :, ids] = _stress_content(self.shape, first_seq + k, n, self.device)
                    self._sync()
                batch.append((first_seq + k, ids))
                if len(batch) == min(2, window) or k == len(sizes) - 1:
                    for seq, ids in reversed(batch):
                        futures[self.threads.submit(self._one, seq, ids, pool, slots, report)] = seq
                    batch = []
            _, pending = wait(futures, timeout=3 * S_AGENT_TIMEOUT_S)
            report["unfinished"] = sorted(futures[f] for f in pending)
        except BaseException as e:  # noqa: BLE001 - reported with the phase
            report["errors"].append(f"driver: {e!r}")
        finally:
            stop.set()
        report["seconds"] = round(time.perf_counter() - start, 3)
        self.note(f"phase {name}: {report}")
        return report

    def _one(self, seq: int, ids: list[int], pool: _BlockPool, slots: threading.Semaphore, report: dict) -> None:
        """One transfer on a pool thread; its blocks are freed (and reused: overwritten) the moment it returns."""
        try:
            torch.cuda.set_device(self.device) if self.device.type == "cuda" else None
            plan = [Transfer(0, 0, range(self.shape.layers), range(self.shape.heads), tuple(range(len(ids))))]
            self.note(f"transfer {seq} ({len(ids)} blocks) starts")
            if self.rank == 0:
                self._ids_store().set(str(seq), json.dumps(ids))  # the decode side learns the block table, as served
                self.agent.send(self.spec, plan, {0: self.shard}, ids, f"h{seq}", seq)
            else:
                src_ids = json.loads(self._ids_store().get(str(seq)))
                self.agent.recv(self.spec, plan, {0: self.shard}, ids, src_ids, seq)
                report["bad"] += _stress_bad_blocks(self.shape, self.cache, ids, seq)
            self.cache.view(torch.int16)[:, :, ids] = POISON_WORD if self.rank == 0 else FRESH_WORD
            self._sync()
            self.note(f"transfer {seq} done")
        except BaseException as e:  # noqa: BLE001 - reported with the phase
            report["errors"].append(f"transfer {seq}: {e!r}")
            self.note(f"transfer {seq} failed: {e!r}")
        finally:
            pool.give(ids)
            slots.release()

    def _ids_store(self):
        """This thread's client of the pair's store, under a prefix of its own: the sender's block ids by transfer (a
        served decode replica has the prefill replica's block table from its answer)."""
        store = getattr(self._stores, "store", None)
        if store is None:
            import torch.distributed as dist
            from datetime import timedelta

            pair = self.agent._stores[self.spec.pair_id]
            client = dist.TCPStore(pair.host, pair.port, is_master=False, timeout=timedelta(seconds=3 * S_AGENT_TIMEOUT_S))
            store = self._stores.store = dist.PrefixStore("stress-ids", client)
        return store

    def _sync(self) -> None:
        """This thread's default stream done (what a freed block waits for before the engine may reuse it)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()


def _stress_rank(rank: int, shape: StressShape, log) -> dict:
    side = _StressRank(rank, shape, log)
    rng = random.Random(7)  # the same sizes on both ranks
    sizes = [rng.choice(shape.sizes) for _ in range(S_TRANSFERS * len(S_PHASES))]
    out = {}
    for p, (name, window, busy) in enumerate(S_PHASES):
        out[name] = side.phase(name, p * S_TRANSFERS, sizes[p * S_TRANSFERS:(p + 1) * S_TRANSFERS], window, busy)
        if out[name]["errors"] or out[name]["unfinished"]:
            break  # the pair was dropped (or is stuck): later phases would only fail on it
    return out


def _stress_child(rank: int, port: int, log_dir: str, shape: StressShape, results) -> None:
    """A GPU process of the run: its result goes to the parent the moment it has one (no closing barrier, which a
    stuck peer would hold), then the process ends without tearing NCCL down."""
    import faulthandler
    import os
    import traceback

    import torch.distributed as dist

    log = open(Path(log_dir) / f"rank{rank}.log", "w", buffering=1)
    faulthandler.dump_traceback_later(S_DUMP_STACKS_S, file=log)  # every thread's stack, if still running then
    try:
        device, url = bench.rank_device(rank, shape.device), f"tcp://127.0.0.1:{port}"
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=url, rank=rank, world_size=2, device_id=device)
        else:
            dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
        results.put((rank, True, _stress_rank(rank, shape, log)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        log.flush()
        os._exit(0)


def _run_stress(log_dir: Path, shape: StressShape = StressShape()) -> dict[int, dict]:
    """Both ranks' reports; a run that outlives S_KILL_S is killed and fails with both ranks' logs."""
    import queue

    import torch.multiprocessing as mp

    from parallel.net import free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_stress_child, args=(r, port, str(log_dir), shape, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + S_KILL_S
    try:
        while len(got) < 2 and time.monotonic() < deadline:
            # A rank that exited is given a little longer: its result may be in the pipe still.
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            try:
                rank, ok, value = results.get(timeout=5.0 if dead else 1.0)
            except queue.Empty:
                assert not dead, f"rank {dead[0]} exited (code {procs[dead[0]].exitcode}) without a result:\n" + \
                    "\n".join((log_dir / f"rank{dead[0]}.log").read_text().splitlines()[-40:])
                continue
            assert ok, f"rank {rank} failed:\n{value}"
            got[rank] = value
    finally:
        for p in procs:
            p.kill() if p.is_alive() else None
    if len(got) < 2:
        logs = "\n".join(f"--- rank {r} ---\n" + "\n".join((log_dir / f"rank{r}.log").read_text().splitlines()[-60:])
                         for r in range(2) if (log_dir / f"rank{r}.log").exists())
        pytest.fail(f"HUNG: ranks {sorted(set(range(2)) - set(got))} had no result after {S_KILL_S:.0f}s\n{logs}")
    return got


@pytest.mark.parametrize("shape", list(STRESS_SHAPES))
def test_transfers_in_flight_from_threads_land_bit_for_bit(shape: str, tmp_path: Path):
    sender, receiver = (v for _, v in sorted(_run_stress(tmp_path, STRESS_SHAPES[shape]).items()))
    lines = [f"{name}: sender {sender.get(name)} | receiver {receiver.get(name)}" for name, _, _ in S_PHASES]
    print("\n".join(lines))
    for name, _, _ in S_PHASES:
        for side, report in (("sender", sender), ("receiver", receiver)):
            assert name in report, f"phase {name} never ran (an earlier one failed):\n" + "\n".join(lines)
            assert not report[name]["errors"] and not report[name]["unfinished"], f"{name} {side}: {report[name]}"
        assert not receiver[name]["bad"], f"{name}: blocks wrong:\n" + "\n".join(receiver[name]["bad"])
