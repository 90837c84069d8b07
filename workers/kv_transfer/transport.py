"""Point-to-point KV transport between the ranks of a prefill replica and a decode replica.

Each pair of replicas gets its own standalone process group (not the replica's TP/PP groups; on GPUs two, whose
turns carry a long transfer's messages: `pair_groups`): prefill ranks are pair-ranks 0..p-1, decode ranks p..p+d-1.
It is built when the decode side first asks
(a warm-up, `warm`, or the pair's first transfer), through a TCPStore that prefill rank 0 hosts on a port the
OS picks (the address travels through Ray, so no fixed ports), and cached until a transfer fails, after which
it is rebuilt.

NCCL on GPUs, gloo on CPU: the same code, so CI exercises it with gloo. A pair in which a prefill rank
and a decode rank share a GPU (`PairSpec.staged`) cannot use NCCL, which refuses two ranks on one
device; its group is gloo and its messages are staged through host memory. With `PairSpec.ipc`
(TANDEM_KV_IPC=1 on the decode side; opt-in until verified on a GPU end to end) two ranks on one GPU keep
the bytes on it: each prefill rank publishes a CUDA IPC handle of its KV cache in the pair's store, and
the decode rank copies the blocks straight out of the mapped cache, then tells the prefill rank it is
done (a one-byte gloo message, the send's ack). We do not use Ray's own
GPU tensor transport (RDT): it is alpha, and its NCCL path needs CuPy, which our GPU hosts lack.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.kv_layout import pool_ids
from workers.kv_transfer.blocks import (CacheBlocks, block_index, gather_blocks, scatter_blocks, transfer_shape, warm_kernels,
                                        wire_dtype)
from workers.kv_transfer.chunk_ends import ChunkEnds
from workers.kv_transfer.lanes import LANE_BYTES, Lane, Lanes
from workers.kv_transfer.peer_ipc import PeerCaches, export_cache, import_cache, peer_ipc_enabled, whole_heads
from workers.kv_transfer.plan import RankShard, Transfer

log = logging.getLogger(__name__)
MAX_UNCOLLECTED_ACKS = 1024  # sends whose ack nobody waited for (the handoff failed): the oldest are forgotten
# Handoffs decided on a prefill rank, sent or abandoned (`KVTransferAgent.send`, `abandon`): the newest this many of
# each are remembered (a send running now always is). A decision forgotten only matters if its handoff's other
# call comes this many handoffs later, long after any send or abandon of it could.
MAX_DECIDED_HANDOFFS = MAX_UNCOLLECTED_ACKS
# TANDEM_KV_PHASES=1: each send and receive logs (WARNING, this module's logger: a rank actor's log) where its
# host time went, phase by phase, as wall and this thread's CPU milliseconds, and how long this thread waited
# for the GIL once (`gil_ms`, a sleep(0)). A diagnostic of the served handoff (docs/benchmarks.md).
LOG_PHASES = os.environ.get("TANDEM_KV_PHASES") == "1"


class PhaseClock:
    """Wall and thread-CPU time per named phase: `mark(name)` charges the time since the last mark to it.
    Off (every call a no-op, no clocks read, no GIL given up) unless LOG_PHASES: it sits on every transfer."""

    def __init__(self) -> None:
        self.on = LOG_PHASES
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        if self.on:
            self.gil_s = self._gil_wait()  # before the clock starts: its sleep is no phase's (~55 us of timer slack)
            self._last = (time.perf_counter(), time.thread_time())

    @staticmethod
    def _gil_wait() -> float:
        t = time.perf_counter()
        time.sleep(0)  # lets go of the GIL and takes it back: how long another thread keeps it, right now
        return time.perf_counter() - t

    def mark(self, name: str) -> None:
        if not self.on:
            return
        now = (time.perf_counter(), time.thread_time())
        self.wall[name] = self.wall.get(name, 0.0) + now[0] - self._last[0]
        self.cpu[name] = self.cpu.get(name, 0.0) + now[1] - self._last[1]
        self._last = now

    def log(self, what: str, **extra) -> None:
        if self.on:
            log.warning("kv phases %s", json.dumps({"what": what, "gil_ms": round(self.gil_s * 1e3, 3), **extra,
                                                   "wall_ms": {k: round(v * 1e3, 3) for k, v in self.wall.items()},
                                                   "cpu_ms": {k: round(v * 1e3, 3) for k, v in self.cpu.items()}}))


# A transfer goes out as one message per few layers: the gather of the next chunk then overlaps the
# send of this one, and the receiver's scatter overlaps the next receive. A message holds as many whole
# layers as fit in MESSAGE_BYTES (at least one). Both sides derive the cut from the plan and the cache
# shape they share (block size, head dim, wire dtype), so their messages pair up.
# Why so large (256 MiB: a 2K-token Llama-3.1-8B prompt is one message, 32K tokens sixteen): each message
# costs the receiving thread a few calls, and in a served decode replica each call may wait, for the GIL
# (the event loop streaming tokens, the engine) or for the CUDA driver (until workers/host_fetch.py, behind
# the engine thread's blocking `.tolist()`). With 32 MiB messages a 2K-token push spent 44 ms posting its
# receives and queueing its scatters on 2 x H100, mostly waiting (TANDEM_KV_PHASES; docs/benchmarks.md,
# "Eighth session"). On an idle pair the overlap lost to the larger cut is the first gather and the last
# scatter of 256 MiB: ~0.2 ms each on an H100 (about 5% of a 32K-token handoff).
MESSAGE_BYTES = 256 << 20
SPLIT_BYTES = 64 << 20  # KVTransferAgent.split_bytes' default (see there)
# KVTransferAgent.pair_groups' and target_messages' defaults. On 2 x H100 (2026-11-27, one run, 30 iterations each,
# raw NCCL 3.00 / 11.60 ms): 8K-token handoffs took 3.90 ms as 4 messages of 256 MiB over one group, 4.06 over two, and
# 3.77 as 8 of 128 MiB over two (3.90 over one); 32K took 13.77 ms as 16 messages over one group and 13.10 over two, and
# 15.3-15.4 as 32 of 128 MiB either way. A 2K handoff (two messages) was slower over two groups (1.30 against 1.20 ms).
# With these defaults, two later runs (17:49-17:51 UTC, rows rotating each iteration): 8K 3.72 / 3.72 ms against the
# old path's 3.91 / 4.00 (raw 3.00 / 2.99), 32K 13.26 / 13.15 against 13.77 / 13.59 (raw 11.59 / 11.62).
PAIR_GROUPS, TARGET_MESSAGES, TARGET_MESSAGE_FLOOR = 2, 8, 128 << 20
LANE_MAX_BLOCKS = 4096  # a lane's index holds this many block ids (a transfer of more takes the ordinary path)
OVERLAP_COPY_PROGRAMS = 66  # KVTransferAgent.overlap_copy_programs' default (see there)

# Waiting for NCCL work: `Work.wait(timeout)` blocks the CPU in a loop that sleeps 1 ms between polls
# (ProcessGroupNCCL's kSynchronizeBusyWaitMillis), so each wait that is not done already costs up to a
# millisecond more than the transfer. We poll `is_completed()` instead, this often at first, then at
# WAIT_POLL_SLOW_S once a transfer has taken WAIT_POLL_FAST_FOR_S (the GIL is let go between polls).
# For its first WAIT_SPIN_S the wait only yields the GIL between polls (`sleep(0)`): a 50 us sleep lasts ~110 us with
# Linux's default timer slack (cProfile of a 1K-token handoff on 2 x H100: 6 such sleeps per receive), so a short
# transfer was noticed done ~55 us late on average, 6% of its 0.9 ms (scripts/profile_kv_transfer.py).
WAIT_POLL_FAST_S, WAIT_POLL_FAST_FOR_S, WAIT_POLL_SLOW_S = 5e-5, 0.02, 1e-3
WAIT_SPIN_S = 2e-3
# Linux stretches every short sleep of a thread by its timer slack (50 us by default): on the 2 x H100 host `sleep(0)`
# took 58 us, and 7.5 us with the thread's slack at 1 us (scripts/bench_kv_host_calls.py, 2026-11-27), so a poll noticed
# a finished transfer up to ~58 us late. A thread that polls sets its slack to this for the poll (`_fine_sleeps`); a
# second Python thread polling so did not slow the first one's torch calls there (the same script's poller_slack).
WAIT_TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


# The tag of `warm`'s messages (gloo pairs messages by tag; NCCL by order): none of a plan's, which count from 0.
WARM_TAG = 1 << 24
# Several transfers may be in flight on one pair (`send` / `recv` with a `seq`): transfer `seq`'s messages are tagged
# from (seq % TAG_SEQS) * TAG_STRIDE, so gloo never pairs a message with another in-flight transfer's; below WARM_TAG.
TAG_STRIDE, TAG_SEQS = 1 << 16, 255


class _PostOrder:
    """A pair group's transfers, in the order their messages are posted on this rank. NCCL pairs the point-to-point
    messages of two ranks by the order they were posted, not by tag, so every rank of a pair must post the transfers'
    messages in one order: the decode replica numbers its transfers on a pair (0, 1, 2, ... per group), and each rank
    posts transfer `seq` only once it has posted transfer `seq - 1` (`turn`); the transfers' waits, gathers after the
    first and scatters then overlap. Closed when the group is dropped: a transfer waiting for its turn fails."""

    def __init__(self) -> None:
        self.next = 0
        self.closed = False
        self._cond = threading.Condition()
        self._ended: set[int] = set()  # transfers that ended here (sent or failed), beyond `_ended_below`
        self._ended_below = 0  # every transfer numbered below this has ended here

    @contextlib.contextmanager
    def turn(self, seq: int | None, timeout_s: float):
        """Holds while this rank posts transfer `seq`'s messages (None: unnumbered, the caller orders them). The turn
        passes on when the block ends; a block that raised leaves the group out of step, and the caller drops it."""
        if seq is None:
            yield
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.next != seq and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0 or self.next > seq:
                    raise TimeoutError(f"transfer {seq}'s turn to post never came (next: {self.next})")
                self._cond.wait(left)
            if self.closed:
                raise KVTransferError("the pair group was dropped while this transfer waited for its turn to post")
        yield
        with self._cond:
            self.next = seq + 1
            self._cond.notify_all()

    def end(self, seq: int | None) -> None:
        """Transfer `seq` has ended on this rank: its gathers have run (its send waited for its stream)."""
        if seq is None:
            return
        with self._cond:
            self._ended.add(seq)
            while self._ended_below in self._ended:
                self._ended.remove(self._ended_below)
                self._ended_below += 1
            self._cond.notify_all()

    def wait_ended_below(self, seq: int | None, timeout_s: float) -> None:
        """Until every transfer numbered below `seq` has ended here (or the group is dropped, or the timeout). A
        handoff's last send acks only then: its pieces, numbered before it, gather on streams of their own, which
        nothing else orders before the ack that lets the prefill replica free (and reuse) their blocks."""
        if seq is None:
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ended_below < seq and not self.closed and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class KVTransferError(RuntimeError):
    """A transfer failed or timed out; the pair's group is dropped and rebuilt on next use."""


@dataclass(frozen=True)
class SendResult:
    """A prefill rank's `send`. `abandoned`: the handoff was abandoned on this rank before the send began, so
    its blocks may have been freed and reused: the messages went out as usual (the pair stays in step), but
    what they carried is not the prompt's KV, and the decode side must discard it."""

    bytes: int
    abandoned: bool = False
    began: float = 0.0  # wall clock (time.time()) when this rank's send began, and when its last message had gone:
    ended: float = 0.0  # the decode replica's timeline splits its KV push with them (the ranks share its host)


@dataclass(frozen=True)
class RecvResult:
    """A decode rank's `recv`: bytes received, and wall-clock stamps (time.time()) that split its time: `began`
    (the call reached this rank), `posted` (every receive posted and every scatter queued: the host's share),
    `ended` (every message landed and scattered). The decode replica's timeline carries them."""

    bytes: int
    began: float = 0.0
    posted: float = 0.0
    ended: float = 0.0


@dataclass
class PairSpec:
    pair_id: str  # e.g. "prefill-replica-a->decode-replica-b"
    num_prefill_ranks: int
    num_decode_ranks: int
    # Some prefill and decode rank share a GPU: a gloo group, messages staged through host memory.
    staged: bool = False
    # And ranks on one GPU copy by CUDA IPC instead (TANDEM_KV_IPC=1 on the decode side, which builds the
    # spec: opt-in until a GPU run has verified it end to end, docs/benchmarks.md).
    ipc: bool = False

    @property
    def size(self) -> int:
        return self.num_prefill_ranks + self.num_decode_ranks


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


class KVTransferAgent:
    """Lives in every rank process of a pool replica, next to the model runner's KV cache."""

    def __init__(self, kv_cache: torch.Tensor, shard: RankShard, role: str, timeout_s: float = 60.0,
                 chunk_ends: ChunkEnds | None = None):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        self.kv_cache = kv_cache  # [L_local, 2, num_blocks, block_size, H_local, D]
        self._blocks = CacheBlocks(kv_cache)  # its gathers and scatters, with the cache's views made once
        warm_kernels(kv_cache)  # compiled now, at set-up, not on a pair's first join while serving
        # Transfers run on CUDA streams of their own, one per thread that runs them (several transfers may be in
        # flight at once, each on its own actor thread: `_own_stream`): on the stream the engine computes on, a
        # send's gather queued behind the prefill step running then (tens of ms), and a receive's scatter and final
        # sync behind decode steps. Nothing orders them with the engine's stream, and nothing needs to:
        # - a send starts after its prefill's first token reached the host, so the kernels that wrote its blocks
        #   have finished, and no later step writes blocks held for a handoff; a piece sent while the prompt's
        #   later chunks compute (`send(piece=True)`) waits for the engine's stream instead (`_send`);
        # - a receive writes blocks reserved for its request, which no step reads before `start` (after `recv`
        #   has synchronised this stream), and which were free only once every step using them had answered
        #   (the scheduler's parked blocks).
        self._streams = threading.local()
        self.chunk_ends = chunk_ends  # a prefill rank's model runner's (GPU): the event a piece's gathers wait for
        self._orders: dict[str, _PostOrder] = {}  # pair id -> the order its transfers post in (`_PostOrder`)
        self.shard = shard
        self.role = role
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._stores: dict[str, dist.TCPStore] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._spread: dict[str, list[dist.ProcessGroup]] = {}  # pair id -> its groups, the first `_groups`' (`join`)
        self._peer_caches: dict[tuple[str, int], torch.Tensor] = {}  # (pair, prefill rank) -> its KV cache, mapped by IPC
        self.bytes_sent = 0
        self.bytes_received = 0
        # handoff id -> its KV left this rank, or was abandoned (the prefill side's ack); bounded, see `_ack`.
        self._sent: OrderedDict[str, threading.Event] = OrderedDict()
        self._acks_lock = threading.Lock()
        self._acks_changed = threading.Condition(self._acks_lock)  # notified whenever an ack is set (`sent_among`)
        # Whether each handoff's send or its abandon came first here, decided under `_acks_lock` (`_claim`, `abandon`):
        # handoffs whose send runs now, or ran (a later abandon is a no-op), or that were abandoned before any send
        # (a later send reports it). The last two keep the newest MAX_DECIDED_HANDOFFS each.
        self._sending: set[str] = set()
        self._claimed: OrderedDict[str, None] = OrderedDict()
        self._abandoned: OrderedDict[str, None] = OrderedDict()
        self._send_delay_s = 0.0  # failpoint, see set_send_delay
        self._set_cut(kv_cache)
        # Pair groups made after this is set run their NCCL kernels on a high-priority stream, so the block
        # scheduler would start them before queued gather/scatter blocks. A lead, not a finding: bench_kv_transfer.py's
        # 4- and 16-message runs did not overlap sends with gathers as intended, and SMs filled by those kernels
        # may be why; `--nccl-high-priority` measures it. Off by default until it has; TANDEM_KV_NCCL_HIGH_PRIORITY=1
        # sets it for served ranks.
        self.nccl_high_priority = os.environ.get("TANDEM_KV_NCCL_HIGH_PRIORITY") == "1"
        # Caps the GPU row copy's grid (`block_copy.copy_rows`) only for copies that run beside a message in flight:
        # every gather but a transfer's first, every scatter but its last, so NCCL's kernels find SMs free (a lone
        # copy keeps the whole GPU: capped too, a 1K-token handoff got slower). 66 programs, half an H100's or H200's
        # SMs: against no cap, in the same runs, 8K-token handoffs went from 68-69% to 75-76% of raw NCCL on 2 x H100
        # and from 77% to 81% on 2 x H200, 32K from 73% to 85% and from 82-83% to 88%, 1K unchanged (four runs,
        # docs/benchmarks.md, twelfth session). 0 caps nothing. TANDEM_KV_OVERLAP_COPY_PROGRAMS overrides it.
        self.overlap_copy_programs = int(os.environ.get("TANDEM_KV_OVERLAP_COPY_PROGRAMS") or OVERLAP_COPY_PROGRAMS)
        # Short transfers on a GPU take a lane (workers/kv_transfer/lanes.py): kept index and message buffers, planned
        # copies, one launch and one NCCL call a message (TANDEM_KV_LEAN=0, or lean = False: the ordinary path).
        # tests/gpu/test_disagg_gpu.py[pieces] parted from its reference at the same token with lanes on and off on
        # 2 x H100 (2026-11-27, sixteenth session), so lanes were not its cause; bench_kv_transfer.py's l1 / l0
        # variants compare both paths in one run.
        self.lean = os.environ.get("TANDEM_KV_LEAN", "1") != "0"
        self._lanes = Lanes(kv_cache.device, LANE_MAX_BLOCKS) if kv_cache.is_cuda else None
        # GPU pairs in one node: the decode rank copies the blocks straight out of the prefill rank's cache, mapped by
        # CUDA IPC, where every decode rank of the pair could map every prefill rank's (workers/kv_transfer/peer_ipc.py).
        # Must be the same on both sides of a pair (TANDEM_KV_PEER_IPC=0: off); bench_kv_transfer.py's p0 rows time
        # the NCCL path beside it.
        self.peer_ipc = peer_ipc_enabled()
        self._peers = PeerCaches()
        self._one = torch.ones(1, dtype=torch.uint8, device=kv_cache.device) if kv_cache.is_cuda else None  # acks

    def _set_cut(self, kv_cache: torch.Tensor) -> None:
        """The settings that cut a transfer into messages and spread them over the pair's groups (`_messages`,
        `_carrier`): each must be the same on both sides of a pair."""
        self.message_bytes = MESSAGE_BYTES  # must be the same on both sides of a pair (tests lower it)
        # And a message holds at most ceil(layers / min_messages) of a transfer's layers (both sides the same), so a
        # transfer that fits one message still goes as about min_messages: cut finer, the first gather and the last
        # scatter are smaller and overlap the sends more (bench_kv_transfer.py --min-messages measures it against 1,
        # the default, beside raw NCCL).
        self.min_messages = 1
        # A transfer of at least split_bytes that would fit one message goes as two (one that would be two goes as two
        # halves; longer ones are cut by message_bytes alone). Part of the cut: both sides the same; 0: never. The
        # second half's gather overlaps the first half's send, and the first half's scatter the second half's receive,
        # where one message waits for its whole gather and leaves its whole scatter after the wire. On 2 x H100 a
        # 1K-token (128 MiB) handoff through a lane took 0.72 ms in two messages against 0.75 in one (raw NCCL 0.44,
        # same run, 2026-11-27, bench_kv_transfer.py m2).
        self.split_bytes = SPLIT_BYTES
        # Pairs joined after this is set get this many process groups (communicators, NCCL streams), and a transfer
        # over long_bytes sends its messages over them in turn (`_carrier`: both sides by the message's tag), so one
        # message's NCCL kernel runs beside the one before instead of after it. Must be the same on both sides of a pair
        # (both read TANDEM_KV_PAIR_GROUPS); each group is a communicator of its own, warmed with the pair.
        # bench_kv_transfer.py --pair-groups 1 with g1 rows times one group beside the default in one run.
        # (CPU agents: one group unless set; gloo pairs make one whatever it says, `join`.)
        self.pair_groups = int(os.environ.get("TANDEM_KV_PAIR_GROUPS") or (PAIR_GROUPS if kv_cache.is_cuda else 1))
        # A transfer over long_bytes is cut into about target_messages messages (none under TARGET_MESSAGE_FLOOR nor
        # over message_bytes): an 8K-token handoff as 8 of 128 MiB, not 4 of 256 (32K stays 16 of 256); and its
        # messages take the pair's groups in turn. Part of the cut: both sides the same; target_messages 0: message_bytes
        # alone. Tests lower long_bytes.
        self.target_messages, self.long_bytes = TARGET_MESSAGES, LANE_BYTES

    def get_shard(self) -> RankShard:
        return self.shard

    def set_send_delay(self, seconds: float) -> None:
        """Failpoint for tests: every later `send` stalls this long after gathering its blocks and before
        posting them (a stuck link or peer). The stall is on the pair group the send started with, so
        a stalled send never posts into a group rebuilt after it gave up. 0 turns it off."""
        self._send_delay_s = max(0.0, seconds)

    # ---- group set-up (called through Ray by the pool that drives the handoff) ----
    def open_store(self, pair_id: str) -> tuple[str, int]:
        """Prefill rank 0 only: host the pair's rendezvous store; returns its address."""
        store = dist.TCPStore(_node_ip(), 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self._stores[pair_id] = store
        return _node_ip(), store.port

    def join(self, spec: PairSpec, host: str, port: int) -> None:
        """Every rank of both replicas calls this concurrently; returns when the group is connected."""
        if spec.pair_id in self._groups:
            return
        pair_rank = self.shard.rank if self.role == "prefill" else spec.num_prefill_ranks + self.shard.rank
        store = self._stores.get(spec.pair_id) or dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        self._stores[spec.pair_id] = store
        prefixed = dist.PrefixStore(spec.pair_id, store)
        if spec.ipc and self.kv_cache.is_cuda and self.role == "prefill":
            prefixed.set(f"ipc/{self.shard.rank}", export_cache(self.kv_cache))  # for decode ranks on this GPU
        # The pair's groups: the first carries every message unless pair_groups > 1 (`_carrier`); the others' stores
        # are prefixed apart, so each is a communicator of its own.
        # Gloo pairs keep one group: made right after the first, a second gloo group's full-mesh connect failed on one
        # rank ("Connection closed by peer") in about 1 CPU test run in 5, and the groups pay only on GPUs.
        count = max(1, self.pair_groups) if self._nccl(spec) else 1
        groups = [self._new_group(spec, dist.PrefixStore(f"g{k}", prefixed) if k else prefixed, pair_rank)
                  for k in range(count)]
        if self._nccl(spec):  # after the groups: every rank of the pair is here, so the store's waits are short
            self._peers.join(prefixed, spec.pair_id, self.role, self.shard.rank, spec.num_prefill_ranks,
                             spec.num_decode_ranks, self.kv_cache, self.peer_ipc)
        self._orders[spec.pair_id] = _PostOrder()
        self._spread[spec.pair_id] = groups
        self._groups[spec.pair_id] = groups[0]

    def _new_group(self, spec: PairSpec, store, pair_rank: int) -> dist.ProcessGroup:
        """One process group of the pair over store: NCCL (high-priority streams with nccl_high_priority), else gloo."""
        if self._nccl(spec):
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            opts.is_high_priority_stream = self.nccl_high_priority
            return dist.ProcessGroupNCCL(store, pair_rank, spec.size, opts)
        return dist.ProcessGroupGloo(store, pair_rank, spec.size, self.timeout)

    def _groups_of(self, pair_id: str, group: dist.ProcessGroup) -> list[dist.ProcessGroup]:
        """The pair's groups, `group` (its first) first: [group] where only one was made (or set by hand, tests)."""
        groups = self._spread.get(pair_id)
        return groups if groups and groups[0] is group else [group]

    def warm(self, spec: PairSpec) -> None:
        """Exchange one byte with every rank of the other replica over the pair's group, so that its communicator
        exists before a handoff needs it: NCCL creates a pair's communicator on its first message, about a second
        on 2 x H100, which the first handed-off request paid (router/kv_peers.py). Every rank of both replicas
        calls it concurrently, right after `join` and before any transfer on the pair: the first messages of each
        rank pair, so the transfers' messages after them stay paired."""
        group = self._group(spec.pair_id)
        device = self.kv_cache.device if self._nccl(spec) else torch.device("cpu")
        peers = range(spec.num_prefill_ranks, spec.size) if self.role == "prefill" else range(spec.num_prefill_ranks)
        # A pair that copies by peer IPC also sends the other way: each decode rank's acks (`_copy_from_mapped`). NCCL
        # connects each direction of a rank pair on its first message, ~100 ms of CPU on 2 x H200, which the first
        # handoff's ack paid (docs/benchmarks.md, twenty-second session); so that direction is warmed too, after the
        # first (every rank posts in the same order: no rank waits on one still connecting the other way).
        directions = (True, False) if self._peers.on(spec.pair_id) else (True,)
        with self._own_stream():
            works = []
            for forward in directions:
                for g in self._groups_of(spec.pair_id, group):  # each of the pair's communicators
                    op = g.send if (self.role == "prefill") == forward else g.recv
                    works += [op([torch.ones(1, dtype=torch.uint8, device=device)], peer, WARM_TAG) for peer in peers]
            self._wait(spec.pair_id, group, works)

    def _nccl(self, spec: PairSpec) -> bool:
        """Whether the pair's group is NCCL (else gloo)."""
        return self.kv_cache.is_cuda and not spec.staged

    def has_group(self, pair_id: str) -> bool:
        return pair_id in self._groups

    def drop(self, pair_id: str) -> None:
        self._groups.pop(pair_id, None)
        self._spread.pop(pair_id, None)
        self._stores.pop(pair_id, None)
        order = self._orders.pop(pair_id, None)
        if order is not None:
            order.close()  # transfers waiting for their turn on the dropped group fail now, not at their timeout
        for key in [k for k in self._peer_caches if k[0] == pair_id]:
            del self._peer_caches[key]
        self._peers.drop(pair_id)

    # ---- one handoff ----
    def send(self, spec: PairSpec, plan: list[Transfer], dst_shards: dict[int, RankShard], block_table: list[int],
             handoff_id: str = "", seq: int | None = None, piece: bool = False,
             piece_end: tuple[str, int] | None = None) -> SendResult:
        """Prefill side: send this rank's part of the plan. block_table: the request's block ids, indexed by
        the plan's block indices; handoff_id: the prefill's key (`PrefillReady.handoff_id`), which its acks and
        `abandon` use. The send claims the handoff first: from then on an `abandon` of it is a no-op, and the
        blocks stay held until this send has ended (its ack). If it was abandoned already, the messages still
        go out (the decode side has posted, or will post, the matching receives), and the result says so.
        seq: the transfer's number on the pair (`_PostOrder`; None: the caller runs one transfer at a time).
        piece: blocks of a prompt still being prefilled (`PrefillPiece`): no claim and no ack (the request's
        last transfer has them), and the gathers wait for the chunk that wrote the blocks, which may still be
        running (a step that samples nothing returns before its kernels end): piece_end (request id, tokens in
        the piece's blocks) finds its step's event (`ChunkEnds`); else they wait for the engine's whole stream."""
        began = time.time()
        claimed = True if piece else self._claim(handoff_id)
        order = self._order(spec.pair_id)
        try:
            with self._own_stream():
                if piece and self.kv_cache.is_cuda:
                    self._after_chunk(piece_end)
                sent = self._send(spec, plan, dst_shards, block_table, seq, piece)
        finally:
            order.end(seq)
            if claimed and not piece:  # an abandoned handoff was acked by its abandon
                order.wait_ended_below(seq, self.timeout.total_seconds())  # its pieces too have stopped reading
                self._end_claim(handoff_id)
        return SendResult(sent, abandoned=not claimed, began=began, ended=time.time())

    def _after_chunk(self, piece_end: tuple[str, int] | None) -> None:
        """Order this thread's stream after the prefill chunk that computed a piece's blocks (`ChunkEnds`)."""
        event = self.chunk_ends.event_for(*piece_end) if self.chunk_ends is not None and piece_end else None
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        else:
            torch.cuda.current_stream().wait_stream(torch.cuda.default_stream(self.kv_cache.device))

    def sent_among(self, handoff_ids: list[str], timeout_s: float) -> list[str]:
        """Prefill side: those of `handoff_ids` whose send finished here (or failed, or was abandoned), waiting
        up to `timeout_s` for at least one; their acks are collected. A prefill replica asks this for every
        handoff it holds in one call (`PrefillReplica`'s send watcher): a blocking wait per held handoff took
        one of this actor's threads each, so a few held handoffs nobody collected (until their lease) left none
        for the sends that end the others."""
        deadline = time.monotonic() + timeout_s
        with self._acks_changed:
            while True:
                done = [h for h in handoff_ids if (event := self._sent.get(h)) is not None and event.is_set()]
                left = deadline - time.monotonic()
                if done or left <= 0:
                    break
                self._acks_changed.wait(left)
            for h in done:
                del self._sent[h]
        return done

    def abandon(self, handoff_id: str) -> bool:
        """Prefill side: nobody will collect this handoff's KV (the request was given up): ack it now, so the
        prefill replica frees the blocks rather than at the lease; unless a send of it has begun here, which
        then may be moving the blocks to a decode replica: a no-op, the send's end acks it. A send that comes
        after an abandon tells its decode side (`SendResult.abandoned`). Idempotent. True if it acked."""
        with self._acks_lock:
            if handoff_id in self._sending or handoff_id in self._claimed or handoff_id in self._abandoned:
                return False
            _remember(self._abandoned, handoff_id)
        self._set_ack(handoff_id)
        return True

    def _claim(self, handoff_id: str) -> bool:
        """The send's side of the claim: False if the handoff was abandoned here first."""
        with self._acks_lock:
            if handoff_id in self._abandoned:
                return False
            self._sending.add(handoff_id)
            return True

    def _end_claim(self, handoff_id: str) -> None:
        """The claimed send has ended (sent or failed): remembered as claimed, then acked."""
        with self._acks_lock:
            self._sending.discard(handoff_id)
            _remember(self._claimed, handoff_id)
        self._set_ack(handoff_id)

    def _set_ack(self, handoff_id: str) -> None:
        self._ack(handoff_id).set()
        with self._acks_changed:
            self._acks_changed.notify_all()

    def _ack(self, handoff_id: str) -> threading.Event:
        """The handoff's ack event. A failed handoff never collects its ack, so only the newest
        MAX_UNCOLLECTED_ACKS are kept."""
        with self._acks_lock:
            event = self._sent.setdefault(handoff_id, threading.Event())
            while len(self._sent) > MAX_UNCOLLECTED_ACKS:
                self._sent.popitem(last=False)
            return event

    def _own_stream(self):
        """Make this thread's current CUDA stream its transfers' own, one per thread (so transfers in flight at once
        queue their gathers and scatters on streams of their own); nothing on CPU."""
        if not self.kv_cache.is_cuda:
            return contextlib.nullcontext()
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.kv_cache.device)
        return torch.cuda.stream(stream)

    def _posting(self, pair_id: str, group: dist.ProcessGroup, seq: int | None):
        """The block in which a transfer posts its messages: its turn on the pair (`_PostOrder.turn`), failing as
        `_check` does (and dropping the group, now out of step) if the turn never comes or the posting raises."""
        if self._groups.get(pair_id) is not group:
            raise KVTransferError(f"no transfer group for {pair_id} (dropped)")
        order = self._order(pair_id)
        return _checked(self, pair_id, group, order.turn(seq, self.timeout.total_seconds()))

    def _send(self, spec: PairSpec, plan: list[Transfer], dst_shards: dict[int, RankShard], block_table: list[int],
              seq: int | None = None, piece: bool = False) -> int:
        group, clock = self._group(spec.pair_id), PhaseClock()
        lane, messages = self._lane_for(spec, plan, dst_shards, True)
        try:
            with self._posting(spec.pair_id, group, seq):
                if lane is not None:
                    works, sent = self._post_lane_sends(spec, group, clock, lane, messages, block_table, seq)
                else:
                    works, sent = self._post_sends(spec, group, clock, plan, dst_shards, block_table, seq, piece)
            self._wait(spec.pair_id, group, [w for w, _ in works])
        except BaseException:
            if lane is not None:
                self._lanes.drop(lane)  # its buffers may still be in use on the GPU
            raise
        if lane is not None:
            self._lanes.give(lane)  # the wait synchronised this stream: its copies and sends are done
        clock.mark("sent")
        clock.log("send", messages=len(works), bytes=sent, lane=lane is not None)
        self.bytes_sent += sent
        return sent

    def _post_sends(self, spec: PairSpec, group: dist.ProcessGroup, clock: PhaseClock, plan: list[Transfer],
                    dst_shards: dict[int, RankShard], block_table: list[int], seq: int | None,
                    piece: bool = False) -> tuple[list, int]:
        """Gather and post this rank's messages of the plan: (works with their buffers, bytes). piece: as `send`'s (a
        peer-copied piece sends its block ids, which the decode rank's copy waits for)."""
        messages, groups = list(self._messages(plan, dst_shards, sending=True, seq=seq)), self._groups_of(spec.pair_id, group)
        clock.mark("setup")  # the turn, the plan's messages: pure Python
        # Every transfer's block ids and index tensor (once per transfer, not per message) before the first gather is
        # queued: the index's copy from pageable memory waits for this stream's earlier work, the gathers.
        ids: dict[int, tuple[list[int], torch.Tensor | None, bool]] = {}  # transfer -> (ids, index, peer-copied)
        for _, t, _, _ in messages:
            if id(t) not in ids:
                local_ids = self._local_ids([block_table[i] for i in t.blocks])
                peer = self._peer_copy(spec, t, self.shard, dst_shards[t.dst])
                ids[id(t)] = local_ids, None if self._same_gpu(spec, dst_shards[t.dst]) or (peer and not piece) else \
                    block_index(local_ids, self.kv_cache.device), peer
        clock.mark("index")
        works, sent, peer_copied = [], 0, set()
        for tag, t, layers, heads in messages:
            local_ids, index, peer = ids[id(t)]
            if peer:
                if id(t) not in peer_copied:  # the whole transfer, at its first message
                    peer_copied.add(id(t))
                    works += self._post_peer_send(spec, group, t, index, tag)
                    sent += self._layer_bytes(t) * len(t.layers)
                continue
            if index is None:
                # The decode rank copies these blocks out of this cache itself; wait for its word that it has.
                done = torch.zeros(1, dtype=torch.uint8)
                works.append((group.recv([done], spec.num_prefill_ranks + t.dst, tag), done))  # acks: the first group
                shape = transfer_shape(self.kv_cache, len(local_ids), layers, heads)
                sent += torch.Size(shape).numel() * wire_dtype(self.kv_cache.dtype).itemsize
                continue
            # Gathering the next chunk (this agent's stream) overlaps sending this one (NCCL's stream).
            buf = self._blocks.gather(local_ids, layers, heads, index, self._copy_programs(overlapped=bool(works)))
            if spec.staged:
                buf = _to_host(buf)
            clock.mark("gather")
            if self._send_delay_s and not works:
                time.sleep(self._send_delay_s)
            works.append((self._carrier(groups, tag, t).send([buf], spec.num_prefill_ranks + t.dst, tag), buf))
            clock.mark("post")
            sent += buf.numel() * buf.element_size()
        return works, sent

    def _post_peer_send(self, spec: PairSpec, group: dist.ProcessGroup, t: Transfer, index: torch.Tensor | None,
                        tag: int) -> list:
        """A peer-copied transfer's messages (workers/kv_transfer/peer_ipc.py), as (work, tensor): for a piece (index
        given) its blocks' ids in this cache out, on this stream, after the chunk it waits for; then the ack in."""
        dst, ack = spec.num_prefill_ranks + t.dst, torch.empty(1, dtype=torch.uint8, device=self.kv_cache.device)
        ids = [] if index is None else [(group.send([index], dst, tag), index)]
        return ids + [(group.recv([ack], dst, tag), ack)]

    def recv(self, spec: PairSpec, plan: list[Transfer], src_shards: dict[int, RankShard], block_table: list[int],
             src_block_table: list[int] | None = None, seq: int | None = None, piece: bool = False) -> RecvResult:
        """Decode side: receive this rank's part of the plan into the request's blocks (block_table, indexed
        by the plan's block indices). src_block_table: the prefill side's, needed where the blocks are copied out of a
        prefill rank's cache (one sharing this rank's GPU, or mapped by peer IPC). seq, piece: as the `send`'s."""
        began = time.time()
        with self._own_stream():
            received, posted = self._recv(spec, plan, src_shards, block_table, src_block_table, seq, piece)
        return RecvResult(received, began, posted, time.time())

    def _recv(self, spec: PairSpec, plan: list[Transfer], src_shards: dict[int, RankShard], block_table: list[int],
              src_block_table: list[int] | None, seq: int | None = None, piece: bool = False) -> tuple[int, float]:
        """(bytes received, when the last receive was posted and the last scatter queued)."""
        group, clock = self._group(spec.pair_id), PhaseClock()
        lane, messages = self._lane_for(spec, plan, src_shards, False)
        if lane is None:
            return self._recv_ordinary(spec, group, clock, plan, src_shards, block_table, src_block_table, seq, piece)
        try:
            with self._posting(spec.pair_id, group, seq):
                pending = self._post_lane_recvs(self._groups_of(spec.pair_id, group), clock, lane, messages, seq)
            result = self._scatter_lane(spec, group, clock, lane, pending, block_table)
        except BaseException:
            self._lanes.drop(lane)  # its buffers may still be in use on the GPU
            raise
        self._lanes.give(lane)  # the wait synchronised this stream: its receives and scatters are done
        return result

    def _recv_ordinary(self, spec: PairSpec, group: dist.ProcessGroup, clock: PhaseClock, plan: list[Transfer],
                       src_shards: dict[int, RankShard], block_table: list[int], src_block_table: list[int] | None,
                       seq: int | None, piece: bool = False) -> tuple[int, float]:
        """`_recv` without a lane: buffers from the allocator, the index by `block_index`, copies planned per call."""
        with self._posting(spec.pair_id, group, seq):
            pending, local, mapped = self._post_recvs(spec, group, clock, plan, src_shards, block_table, seq, piece)
            # The peers' acks are messages too: posted in this transfer's turn.
            received = self._copy_from_peers(spec, group, local, src_shards, block_table, src_block_table)
            received += self._copy_from_mapped(spec, group, clock, mapped, src_shards, block_table, src_block_table)
        clock.mark("peers")
        nccl = self._nccl(spec)
        # Each transfer's index tensor (once, not per message) only now that every receive is posted: the sender's
        # message can start as soon as it is, and the index is for the scatter after it. All before the first scatter
        # is queued: the index's copy from pageable memory waits for this stream's earlier work.
        indices = {id(t): block_index(block_ids, self.kv_cache.device) for _, _, t, block_ids, _, _ in pending}
        clock.mark("index")
        for k, (work, buf, t, block_ids, layers, heads) in enumerate(pending):
            index = indices[id(t)]
            if nccl:
                # Stream order only (no CPU wait): the scatter below runs on the GPU once this message has
                # landed, while the later ones are still arriving; the CPU queues every scatter at once.
                self._check(spec.pair_id, group, work.wait)
            else:
                self._wait(spec.pair_id, group, [work])
            clock.mark("wait")
            if spec.staged:
                buf = buf.to(self.kv_cache.device, non_blocking=True)
            self._blocks.scatter(block_ids, layers, heads, buf, index, self._copy_programs(overlapped=k < len(pending) - 1))
            clock.mark("scatter")
            received += buf.numel() * buf.element_size()
        posted = time.time()
        if nccl:
            self._wait(spec.pair_id, group, [work for work, *_ in pending])  # every message landed, then synchronised
        elif self.kv_cache.is_cuda:
            torch.cuda.current_stream().synchronize()
        clock.mark("landed")
        clock.log("recv", messages=len(pending), bytes=received)
        self.bytes_received += received
        return received, posted

    def _lane_for(self, spec: PairSpec, plan: list[Transfer], peers: dict[int, RankShard],
                  sending: bool) -> tuple[Lane | None, list]:
        """A lane for this transfer (workers/kv_transfer/lanes.py) and this rank's messages of the plan, each
        (tag within the transfer's range, transfer, layer slice, head slice, buffer shape); (None, []) where the transfer
        takes the ordinary path: lean off, not a GPU pair over NCCL, a head slice, transfers over different blocks, more
        than LANE_BYTES or LANE_MAX_BLOCKS, no message for this rank, or every lane busy."""
        if not (self.lean and self._lanes is not None and self._blocks.rows and self._nccl(spec) and not spec.ipc) \
                or (self.peer_ipc and self._peers.on(spec.pair_id)):  # peer copies take no buffers
            return None, []
        lane = self._lanes.take()
        if lane is None:
            return None, []
        # The messages depend on nothing else (tags are relative: the transfer's number adds its range's start).
        key = (tuple(plan), tuple(peers.items()), sending, self.message_bytes, self.min_messages, self.split_bytes,
               self.target_messages, self.long_bytes)
        messages = lane.messages.get(key)
        if messages is None:
            try:
                messages = [(tag, t, layers, heads, transfer_shape(self.kv_cache, len(t.blocks), layers, heads))
                            for tag, t, layers, heads in self._messages(plan, peers, sending)]
            except Exception:  # noqa: BLE001 - a plan the cut refuses: the ordinary path raises it in its place
                self._lanes.give(lane)
                return None, []
            lane.remember(key, messages if self._lane_fits(messages) else [])
            messages = lane.messages[key]
        if not messages:
            self._lanes.give(lane)
            return None, []
        return lane, messages

    def _lane_fits(self, messages: list) -> bool:
        """Whether a transfer of these messages takes a lane (see `_lane_for`)."""
        if not messages or any(not self._blocks.all_heads(heads) for _, _, _, heads, _ in messages):
            return False
        blocks = messages[0][1].blocks
        wire = wire_dtype(self.kv_cache.dtype).itemsize
        total = sum(torch.Size(shape).numel() * wire for *_, shape in messages)
        return 0 < len(blocks) <= LANE_MAX_BLOCKS and total <= LANE_BYTES and all(t.blocks == blocks for _, t, *_ in messages)

    def _post_lane_sends(self, spec: PairSpec, group: dist.ProcessGroup, clock: PhaseClock, lane: Lane, messages: list,
                         block_table: list[int], seq: int | None) -> tuple[list, int]:
        """`_post_sends` through a lane: the index by one asynchronous copy, each message's gather one planned launch
        into its kept buffer, then its send."""
        base, groups = 0 if seq is None else (seq % TAG_SEQS) * TAG_STRIDE, self._groups_of(spec.pair_id, group)
        ids = self._local_ids([block_table[i] for i in messages[0][1].blocks])
        index, n, wire = lane.index_of(ids), len(ids), self._blocks.wire.dtype
        clock.mark("index")
        works, sent = [], 0
        for tag, t, layers, heads, shape in messages:
            buf = lane.buffer((layers.start, layers.stop), shape, wire)
            programs = self._copy_programs(overlapped=bool(works))
            lane.copy((layers.start, layers.stop, n, True, programs),
                      lambda: self._blocks.prepare(layers, buf, index, True, programs))()
            clock.mark("gather")
            if self._send_delay_s and not works:
                time.sleep(self._send_delay_s)
            works.append((self._carrier(groups, tag, t).send([buf], spec.num_prefill_ranks + t.dst, base + tag), buf))
            clock.mark("post")
            sent += buf.numel() * buf.element_size()
        return works, sent

    def _post_lane_recvs(self, groups: list[dist.ProcessGroup], clock: PhaseClock, lane: Lane, messages: list,
                         seq: int | None) -> list:
        """`_post_recvs` through a lane: each message received into its kept buffer. Returns (work, buf, message)."""
        base = 0 if seq is None else (seq % TAG_SEQS) * TAG_STRIDE
        clock.mark("setup")
        wire, pending = self._blocks.wire.dtype, []
        for message in messages:
            tag, t, layers, _, shape = message
            buf = lane.buffer((layers.start, layers.stop), shape, wire)
            pending.append((self._carrier(groups, tag, t).recv([buf], t.src, base + tag), buf, message))
        clock.mark("post")
        return pending

    def _scatter_lane(self, spec: PairSpec, group: dist.ProcessGroup, clock: PhaseClock, lane: Lane, pending: list,
                      block_table: list[int]) -> tuple[int, float]:
        """The lane's scatters, each queued behind its message's receive on this stream (no CPU wait), then the wait
        for all: `_recv_ordinary`'s second half."""
        index = lane.index_of([block_table[i] for i in pending[0][2][1].blocks])
        n, received = index.numel(), 0
        clock.mark("index")
        for k, (work, buf, (_, _, layers, _, _)) in enumerate(pending):
            self._check(spec.pair_id, group, work.wait)  # NCCL: stream order only (the CPU waits below)
            programs = self._copy_programs(overlapped=k < len(pending) - 1)
            lane.copy((layers.start, layers.stop, n, False, programs),
                      lambda: self._blocks.prepare(layers, buf, index, False, programs))()
            clock.mark("scatter")
            received += buf.numel() * buf.element_size()
        posted = time.time()
        if _is_nccl(group):
            self._wait(spec.pair_id, group, [work for work, *_ in pending])  # every message landed, then synchronised
        elif self.kv_cache.is_cuda:  # gloo's wait above was the CPU's (a gloo work is waited for once)
            torch.cuda.current_stream().synchronize()
        clock.mark("landed")
        clock.log("recv", messages=len(pending), bytes=received, lane=True)
        self.bytes_received += received
        return received, posted

    def _post_recvs(self, spec: PairSpec, group: dist.ProcessGroup, clock: PhaseClock, plan: list[Transfer],
                    src_shards: dict[int, RankShard], block_table: list[int], seq: int | None,
                    piece: bool = False) -> tuple[list, list, list]:
        """Post this rank's receives of the plan, in the senders' order (NCCL pairs a rank pair's messages by order,
        not by tag); each chunk is then scattered as it lands (`_recv`), overlapping the later ones. Returns the
        posted receives, the messages to copy from a peer on this GPU instead, and the transfers copied out of a mapped
        prefill cache (`_copy_from_mapped`), each with the receive of its block ids."""
        pending, local, mapped, last, groups = [], [], [], None, self._groups_of(spec.pair_id, group)
        messages = list(self._messages(plan, src_shards, sending=False, seq=seq))
        clock.mark("setup")  # the turn, the plan's messages: pure Python
        for tag, t, layers, heads in messages:
            if self._peer_copy(spec, t, src_shards[t.src], self.shard):
                if not mapped or mapped[-1][2] is not t:  # the whole transfer, at its first message; a piece's ids come
                    ids = torch.empty(len(t.blocks), dtype=torch.long, device=self.kv_cache.device) if piece else None
                    mapped.append((group.recv([ids], t.src, tag) if piece else None, ids, t, tag))
                continue
            if self._same_gpu(spec, src_shards[t.src]):
                local.append((tag, t, layers, heads))
                continue
            if t is not last:  # the transfer's block ids: once, not per message
                last, block_ids = t, [block_table[i] for i in t.blocks]
            shape, wire = transfer_shape(self.kv_cache, len(t.blocks), layers, heads), wire_dtype(self.kv_cache.dtype)
            # Staged: received into pinned host memory, so its copy to the GPU below is asynchronous on this stream
            # (from pageable memory it would wait for the engine's work on the GPU too).
            buf = (torch.empty(shape, dtype=wire, pin_memory=self.kv_cache.is_cuda) if spec.staged
                   else torch.empty(shape, dtype=wire, device=self.kv_cache.device))
            clock.mark("alloc")
            pending.append((self._carrier(groups, tag, t).recv([buf], t.src, tag), buf, t, block_ids, layers, heads))
            clock.mark("post")
        return pending, local, mapped

    def _copy_from_peers(self, spec: PairSpec, group: dist.ProcessGroup, messages: list, src_shards: dict[int, RankShard],
                         block_table: list[int], src_block_table: list[int] | None) -> int:
        """The messages whose prefill rank shares this GPU: copied device to device out of its mapped cache;
        then each sender is told, so it may free the blocks (it waits for that as its send's end)."""
        if not messages:
            return 0
        if src_block_table is None:
            raise KVTransferError(f"{spec.pair_id}: a prefill rank shares this GPU, and recv() was not given its block table")
        copied = 0
        for tag, t, layers, heads in messages:
            peer = src_shards[t.src]
            cache = self._peer_cache(spec.pair_id, peer.rank)
            src_layers, src_heads, dst_layers, _ = t.local_slices(peer, self.shard)
            # `layers` is this message's chunk of the transfer in our cache; the same chunk in the peer's.
            src_layers = slice(src_layers.start + layers.start - dst_layers.start, src_layers.start + layers.stop - dst_layers.start)
            src_ids = _local_ids(cache, peer, [src_block_table[i] for i in t.blocks])
            buf = gather_blocks(cache, src_ids, src_layers, src_heads)
            scatter_blocks(self.kv_cache, [block_table[i] for i in t.blocks], layers, heads, buf)
            copied += buf.numel() * buf.element_size()
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream().synchronize()  # the copies are done before any sender frees its blocks
        self._wait(spec.pair_id, group, [group.send([torch.ones(1, dtype=torch.uint8)], t.src, tag)
                                         for tag, t, _, _ in messages])
        return copied

    def _copy_from_mapped(self, spec: PairSpec, group: dist.ProcessGroup, clock: PhaseClock, mapped: list,
                          src_shards: dict[int, RankShard], block_table: list[int], src_block_table: list[int] | None) -> int:
        """The peer-copied transfers (workers/kv_transfer/peer_ipc.py): each copied block to block out of its prefill
        rank's cache, mapped here; once all are copied (in stream order), each sender is acked: it frees the blocks
        then. A transfer's blocks were written before the decode side asked for them (its prefill's first token had
        reached the host), so the copy starts at once, except a piece's: it runs in stream order behind the receive of
        the blocks' ids, which the prefill rank sends once the chunk that wrote them is done."""
        if not mapped:
            return 0
        if src_block_table is None:
            raise KVTransferError(f"{spec.pair_id}: the blocks are copied out of the prefill cache, and recv() was not "
                                  "given its block table")
        from parallel.kernels.block_copy import copy_blocks

        # Every index before the first wait, in one copy: a copy from pageable memory waits for this stream's work. Each
        # list padded to an even length, so every slice of `flat` starts 16-byte aligned, as the kernel was compiled
        # for (`block_copy.warm_up`): an odd offset is another specialisation, compiled while serving.
        even = lambda ids: ids + [0] * (len(ids) % 2)  # noqa: E731
        ids = [(even(_local_ids(self._peers.words[(spec.pair_id, t.src)], src_shards[t.src], [src_block_table[i] for i in t.blocks])),
                even(self._local_ids([block_table[i] for i in t.blocks]))) for _, _, t, _ in mapped]
        flat = block_index([b for src, dst in ids for b in (*src, *dst)], self.kv_cache.device)
        clock.mark("peer_index")
        copied, at = 0, 0
        for (work, piece_ids, t, _), (src, dst) in zip(mapped, ids):
            n = len(t.blocks)
            src_ids, dst_ids = flat[at:at + n], flat[at + len(src):at + len(src) + n]
            at += len(src) + len(dst)
            src_layers, _, dst_layers, _ = t.local_slices(src_shards[t.src], self.shard)
            if work is not None:  # a piece: stream order only, the copy starts once its ids have landed
                self._check(spec.pair_id, group, work.wait)
                src_ids = piece_ids
            self._check(spec.pair_id, group, copy_blocks, self._peers.words[(spec.pair_id, t.src)][src_layers],
                        self._blocks.words[dst_layers], src_ids, dst_ids)
            copied += self._layer_bytes(t) * len(t.layers)
        clock.mark("peer_copy")  # the kernels queued (a piece's: behind its ids' receive)
        # The acks in stream order behind the copies (NCCL's stream waits for this one), so each leaves the moment the
        # copies are done on the GPU, with no host sync and launch between: a sender frees nothing still being read.
        self._wait(spec.pair_id, group, [group.send([self._one], t.src, tag) for _, _, t, tag in mapped])
        clock.mark("peer_ack")  # the copies done on the GPU and the acks sent
        return copied

    def _peer_copy(self, spec: PairSpec, t: Transfer, src: RankShard, dst: RankShard) -> bool:
        """Whether transfer t goes by the decode rank's copy out of the mapped prefill cache (peer_ipc.py): the pair
        copies so, and t moves whole rows (both ranks compute the same)."""
        return self.peer_ipc and self._peers.on(spec.pair_id) and self._blocks.rows and whole_heads(t, src, dst)

    def _same_gpu(self, spec: PairSpec, peer: RankShard) -> bool:
        """Whether this message goes by CUDA IPC: the pair uses it, and the peer is on this rank's GPU."""
        return spec.ipc and self.kv_cache.is_cuda and bool(peer.device) and peer.device == self.shard.device

    def _peer_cache(self, pair_id: str, rank: int) -> torch.Tensor:
        """Prefill rank `rank`'s KV cache, mapped into this process through the IPC handle it published."""
        key = (pair_id, rank)
        if key not in self._peer_caches:
            store = dist.PrefixStore(pair_id, self._stores[pair_id])
            self._peer_caches[key] = import_cache(store.get(f"ipc/{rank}"), self.kv_cache.device)
        return self._peer_caches[key]

    def _messages(self, plan: list[Transfer], peers: dict[int, RankShard], sending: bool, seq: int | None = None):
        """This rank's messages, in the order both sides agree on: each transfer of the plan cut into
        chunks of LAYERS_PER_MESSAGE layers, tagged by position in the whole plan (from the transfer's own tag
        range where it is numbered, `TAG_STRIDE`). Yields (tag, transfer, layer slice, head slice), the slices
        into this rank's cache."""
        tag = 0 if seq is None else (seq % TAG_SEQS) * TAG_STRIDE
        limit = tag + TAG_STRIDE
        for t in plan:
            n, step = len(t.layers), self._layers_per_message(t)
            mine = (t.src if sending else t.dst) == self.shard.rank
            if mine:
                src_layers, src_heads, dst_layers, dst_heads = t.local_slices(
                    self.shard if sending else peers[t.src], peers[t.dst] if sending else self.shard)
                layers, heads = (src_layers, src_heads) if sending else (dst_layers, dst_heads)
            for k in range(0, n, step):
                if tag >= limit:
                    raise ValueError(f"a transfer of more than {TAG_STRIDE} messages does not fit its tag range")
                if mine:
                    yield tag, t, slice(layers.start + k, layers.start + min(k + step, n)), heads
                tag += 1

    def _copy_programs(self, overlapped: bool) -> int | None:
        """The row copy's grid cap for a gather or scatter: `overlap_copy_programs` where a message is in flight beside
        it (and the cap is set), else the module default."""
        return self.overlap_copy_programs if overlapped and self.overlap_copy_programs else None

    def _layers_per_message(self, t: Transfer) -> int:
        """How many of t's layers one message carries: as many as fit in message_bytes (for a transfer over long_bytes,
        in its total / target_messages, but at least TARGET_MESSAGE_FLOOR), at most ceil(layers / min_messages) (or
        half of them for a transfer of split_bytes or more), at least one. From what both sides share (the plan, block
        size, head dim, wire dtype, these settings), so both cut t the same way."""
        per_layer, n = self._layer_bytes(t), len(t.layers)
        total, limit = per_layer * n, self.message_bytes
        if self.target_messages and total > self.long_bytes:
            limit = min(limit, max(TARGET_MESSAGE_FLOOR, total // self.target_messages))
        want = max(self.min_messages, 2) if self.split_bytes and total >= self.split_bytes else self.min_messages
        return max(1, min(n, limit // max(1, per_layer), -(-n // max(1, want))))

    def _layer_bytes(self, t: Transfer) -> int:
        """The bytes of one of t's layers on the wire (both sides compute the same)."""
        _, _, _, block_size, _, head_dim = self.kv_cache.shape
        return 2 * len(t.blocks) * block_size * len(t.heads) * head_dim * wire_dtype(self.kv_cache.dtype).itemsize

    def _carrier(self, groups: list[dist.ProcessGroup], tag: int, t: Transfer) -> dist.ProcessGroup:
        """The pair group that carries t's message tagged `tag`: for a transfer over long_bytes the pair's groups in
        turn, by the message's place in its transfer (the same on both sides, whatever the transfer's number); else
        the first (a one- or two-message transfer went no faster over two: `pair_groups`)."""
        if len(groups) == 1 or self._layer_bytes(t) * len(t.layers) <= self.long_bytes:
            return groups[0]
        return groups[(tag % TAG_STRIDE) % len(groups)]

    def _order(self, pair_id: str) -> _PostOrder:
        """The pair's post order, shared by its sends' posting turns and their acks: `join` makes it; a group set by
        hand (tests) gets one here. A throwaway one would never see the pair's earlier transfers end, and an ack
        would wait out the whole timeout."""
        return self._orders.setdefault(pair_id, _PostOrder())

    def _local_ids(self, block_ids: list[int]) -> list[int]:
        return _local_ids(self.kv_cache, self.shard, block_ids)

    def _group(self, pair_id: str) -> dist.ProcessGroup:
        group = self._groups.get(pair_id)
        if group is None:
            raise KVTransferError(f"no transfer group for {pair_id}: join() first")
        return group

    def _wait(self, pair_id: str, group: dist.ProcessGroup, works: list) -> None:
        """Block until every work is done (and, on a GPU, this thread's stream has caught up), or fail
        within the transfer timeout."""
        self._check(pair_id, group, self._wait_nccl if _is_nccl(group) else self._wait_blocking, works)

    def _wait_blocking(self, works: list) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        for w in works:
            left = max(0.001, deadline - time.monotonic())
            w.wait(datetime.timedelta(seconds=left))
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream().synchronize()

    def _wait_nccl(self, works: list) -> None:
        """NCCL works: polled (see WAIT_POLL_FAST_S), not `wait(timeout)` with its 1 ms sleeps."""
        pending = [w for w in works if not w.is_completed()]  # done, or failed (raised by wait below)
        if pending:
            with _fine_sleeps():
                self._poll_nccl(pending)
        for w in works:
            w.wait()  # raises a failed work's error; else only orders this thread's stream after it
        torch.cuda.current_stream().synchronize()

    def _poll_nccl(self, pending: list) -> None:
        """Until every pending work is done (or failed), polling; past the transfer timeout, abort and raise."""
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        while pending:
            now = time.monotonic()
            if now >= deadline:
                # Late: the timed wait aborts the communicator (so no kernel is left spinning on the GPU)
                # and raises, as it always did.
                for w in pending:
                    w.wait(datetime.timedelta(milliseconds=1))
                raise TimeoutError(f"{len(pending)} NCCL operations not done after {self.timeout.total_seconds():.0f}s")
            waited = now - start
            time.sleep(0.0 if waited < WAIT_SPIN_S else WAIT_POLL_FAST_S if waited < WAIT_POLL_FAST_FOR_S else WAIT_POLL_SLOW_S)
            pending = [w for w in pending if not w.is_completed()]

    def _check(self, pair_id: str, group: dist.ProcessGroup, fn, *args) -> None:
        """fn(*args); any failure drops the pair's group and raises KVTransferError."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - any transport failure leaves the group unusable
            if self._groups.get(pair_id) is group:  # not one rebuilt since this transfer began
                self.drop(pair_id)
            raise KVTransferError(f"KV transfer on {pair_id} failed ({self.role} rank {self.shard.rank}): {e}") from e


@contextlib.contextmanager
def _checked(agent: KVTransferAgent, pair_id: str, group: dist.ProcessGroup, inner):
    """`inner` (a context manager) and the block it guards, failing as `KVTransferAgent._check`: any error drops the
    pair's group (if it is still this one) and raises KVTransferError."""
    try:
        with inner:
            yield
    except Exception as e:  # noqa: BLE001 - a transfer that failed half-posted leaves the pair out of step
        if agent._groups.get(pair_id) is group:
            agent.drop(pair_id)
        if isinstance(e, KVTransferError):
            raise
        raise KVTransferError(f"KV transfer on {pair_id} failed ({agent.role} rank {agent.shard.rank}): {e}") from e


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, for prctl (None off Linux or where it cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@contextlib.contextmanager
def _fine_sleeps():
    """This thread's timer slack at WAIT_TIMER_SLACK_NS inside the block, restored after (no-op off Linux)."""
    libc = _libc()
    old = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) if libc is not None else -1
    if old > 0:
        libc.prctl(_PR_SET_TIMERSLACK, WAIT_TIMER_SLACK_NS, 0, 0, 0)
    try:
        yield
    finally:
        if old > 0:
            libc.prctl(_PR_SET_TIMERSLACK, old, 0, 0, 0)


def _to_host(buf: torch.Tensor) -> torch.Tensor:
    """A staged send's buffer in host memory. From a GPU: into pinned memory on this thread's stream, waiting for that
    stream only; `.cpu()` copies into pageable memory, which blocks in the CUDA driver until the GPU's other work (the
    engine's step) is done too (workers/host_fetch.py). The shared-GPU handoff test still waits out a busy kernel with
    this, for a cause not yet found (docs/benchmarks.md, "Tenth session")."""
    if not buf.is_cuda:
        return buf
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host


def _remember(decided: OrderedDict[str, None], handoff_id: str) -> None:
    """Add a decided handoff; the oldest beyond MAX_DECIDED_HANDOFFS are forgotten."""
    decided[handoff_id] = None
    decided.move_to_end(handoff_id)
    while len(decided) > MAX_DECIDED_HANDOFFS:
        decided.popitem(last=False)


def _is_nccl(group: dist.ProcessGroup) -> bool:
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU-only builds
    return nccl is not None and isinstance(group, nccl)


def _local_ids(kv_cache: torch.Tensor, shard: RankShard, block_ids: list[int]) -> list[int]:
    """Block ids -> indices into the cache of the rank `shard` describes. Under SP the ids are global and a
    cache holds only its SP rank's pool of them (engine/block_manager.py); without SP the two are the same."""
    pool_size = kv_cache.shape[2]
    ids = pool_ids(shard.sp_rank, pool_size)
    if block_ids and not (min(block_ids) in ids and max(block_ids) in ids):
        # the plan and the block manager disagree on ownership: never send another pool's bytes
        foreign = [b for b in block_ids if b not in ids]
        raise ValueError(f"blocks {foreign} are not in SP rank {shard.sp_rank}'s pool of {pool_size}")
    return block_ids if ids.start == 0 else [b - ids.start for b in block_ids]
