#!/usr/bin/env python3
"""KV transfer between two GPUs: `KVTransferAgent` (the prefill -> decode handoff's transport) against a
raw NCCL send/recv of the same bytes, in the same run.

Two processes, one per GPU: rank 0 holds a prefill rank's KV cache, rank 1 a decode rank's, both of
the given shape (default Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, bf16, block 16). For each
prompt length, the prompt's blocks (scattered over the cache, as block tables are) move from the
prefill cache into other blocks of the decode cache:

  agent    KVTransferAgent.send / recv over their pair group (NCCL): gather -> one message -> scatter
  raw      torch.distributed send / recv of one contiguous buffer of the same size (default NCCL group)
  gather   the sender's gather of the blocks into one contiguous buffer, alone
  scatter  the receiver's scatter of that buffer into its blocks, alone

agent and raw are timed on the receiver, from a common start (a barrier) until the data is in place
(CUDA synchronised); medians over --iters runs after --warmup. GB/s = bytes / seconds / 1e9. After the
timed runs the decode blocks are checked against the prefill blocks, bit for bit.

    python scripts/bench_kv_transfer.py                              # 1K, 8K, 32K-token prompts
    python scripts/bench_kv_transfer.py --tokens 1024 131072 --out bench_results/kv.json
    python scripts/bench_kv_transfer.py --dtype fp8                  # an FP8 KV cache: half the bytes of bf16
    python scripts/bench_kv_transfer.py --min-messages 1,4           # the agent as is, and cut into ~4 messages
    python scripts/bench_kv_transfer.py --nccl-high-priority         # and over a pair with high-priority NCCL streams
    python scripts/bench_kv_transfer.py --copy-programs 32,64         # and with the row copy's grid capped (GPU)
    python scripts/bench_kv_transfer.py --overlap-copy-programs 0,132 # the overlap cap off / at 132 (default 66, GPU)
    python scripts/bench_kv_transfer.py --variants m2o66,o32          # any mix: m<min_messages> o<overlap cap> c<cap>
    python scripts/bench_kv_transfer.py --variants l0s0,s0            # the old path; lanes without the 2-message split
    python scripts/bench_kv_transfer.py --pair-groups 2 --variants g2s0  # messages over 2 communicators in turn
    python scripts/bench_kv_transfer.py --device cpu --tokens 64 --layers 2   # the same code over gloo, as a check
Prints a table; writes JSON (--out). Needs 2 CUDA GPUs (or --device cpu).
"""
from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import re
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.net import free_port  # noqa: E402
from workers.kv_transfer.blocks import gather_blocks, scatter_blocks  # noqa: E402
from workers.kv_transfer.plan import RankShard, plan_transfers  # noqa: E402
from workers.kv_transfer.transport import KVTransferAgent, PairSpec  # noqa: E402

# fp8: a kv_cache_dtype="fp8" cache (float8_e4m3fn), which moves as one byte per value, half of bf16's.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    def cache(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.layers, 2, num_blocks, self.block_size, self.kv_heads, self.head_dim,
                           dtype=DTYPES[self.dtype], device=device)


# ---------------------------------------------------------------- two processes, one GPU each


def rank_device(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _child(rank: int, port: int, device_type: str, fn: Callable[[int, Any], Any], args: Any, results: mp.Queue) -> None:
    try:
        device = rank_device(rank, device_type)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        value = fn(rank, args)
        sync_start(rank)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_pair(fn: Callable[[int, Any], Any], args: Any, device_type: str = "cuda", timeout_s: float = 900.0) -> list[Any]:
    """fn(rank, args) on rank 0 (GPU 0, the prefill side) and rank 1 (GPU 1, the decode side), each in
    a fresh process joined to a default NCCL group of 2 (gloo with device_type "cpu"); returns their
    results by rank. fn must be importable (module level). The first failure, or a rank exiting
    without a result, is raised."""
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        raise RuntimeError(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(rank, port, device_type, fn, args, results), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < 2:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited (code {procs[dead[0]].exitcode}) without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {timeout_s:.0f}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[0], got[1]]


def connect_agents(rank: int, kv_cache: torch.Tensor, shard: RankShard, timeout_s: float = 120.0,
                   pair_id: str = "bench-prefill->bench-decode", high_priority: bool = False,
                   groups: int | None = None) -> tuple[KVTransferAgent, PairSpec]:
    """Inside run_pair: rank 0 gets a prefill agent, rank 1 a decode agent, joined in one pair (its NCCL kernels on
    high-priority streams with high_priority; `groups` process groups, KVTransferAgent.pair_groups, else its default)."""
    agent = KVTransferAgent(kv_cache, shard, "prefill" if rank == 0 else "decode", timeout_s)
    agent.nccl_high_priority = high_priority
    if groups is not None:
        agent.pair_groups = groups
    spec = PairSpec(pair_id, 1, 1)
    address = [agent.open_store(pair_id) if rank == 0 else None]
    dist.broadcast_object_list(address, src=0)  # the store's address, over the default group
    agent.join(spec, *address[0])
    return agent, spec


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def sync_start(rank: int) -> None:
    """Both ranks idle and aligned: the common start of a timed run."""
    synchronize()
    dist.barrier(device_ids=[rank]) if dist.get_backend() == "nccl" else dist.barrier()
    synchronize()


# ---------------------------------------------------------------- the benchmark (runs in each GPU process)


def block_ids(num_tokens: int, shape: Shape, cache_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """The prompt's blocks on each side: distinct, scattered, the same on both ranks."""
    n = -(-num_tokens // shape.block_size)
    rng = random.Random(seed * 1_000_003 + num_tokens)
    return rng.sample(range(cache_blocks), n), rng.sample(range(cache_blocks), n)


def _timed(rank: int, fn: Callable[[], Any]) -> float:
    sync_start(rank)
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


def _bench_rank(rank: int, cfg: dict) -> dict:
    shape, tokens = Shape(**cfg["shape"]), cfg["tokens"]
    device = rank_device(rank, cfg["device"])
    cache_blocks = 2 * -(-max(tokens) // shape.block_size)  # room to scatter the largest prompt
    cache = shape.cache(cache_blocks, device)
    if rank == 0:  # drawn in float32: normal_ has no float8 kernel
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator(device).manual_seed(cfg["seed"]), device=device))
    shard = RankShard(0, range(shape.layers), range(shape.kv_heads))
    agent, spec = connect_agents(rank, cache, shard, cfg["timeout_s"])
    # --nccl-high-priority: a second pair on the same caches whose NCCL kernels run on high-priority streams.
    hp = connect_agents(rank, cache, shard, cfg["timeout_s"], "bench-hp-prefill->bench-hp-decode", True) \
        if cfg["nccl_high_priority"] else None
    # --pair-groups N: a pair of N process groups on the same caches, its messages over them in turn (the g<N> rows)
    spread = {n: connect_agents(rank, cache, shard, cfg["timeout_s"], f"bench-g{n}-prefill->bench-g{n}-decode", groups=n)
              for n in cfg["pair_groups"]}
    everything = slice(None)
    peer_words = _map_peer_cache(rank, cache) if cache.is_cuda else None  # the other rank's cache, mapped here
    defaults = {k: getattr(agent, k) for k in AGENT_KNOBS.values()}  # before any variant sets them
    out: dict[int, dict] = {}
    next_seq = [0]  # the numbered transfers' next number on the pair, the same on both ranks (`_in_flight_run`)
    for n_tok in tokens:
        src, dst = block_ids(n_tok, shape, cache_blocks, cfg["seed"])
        plan = plan_transfers([shard], [shard], range(len(src)))
        nbytes = len(src) * shape.bytes_per_block
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        staged = gather_blocks(cache, dst, everything, everything) if rank == 1 else None  # the scatter's input
        variants = _variants(cfg, (agent, spec), hp, spread, defaults)
        flights = {f"agent_x{n}": n for n in cfg["in_flight"]}  # "agent_x<N>": N transfers on the pair at once
        times: dict[str, list[float]] = {**{v: [] for v in variants}, **{v: [] for v in flights}, "raw": [], "gather": [],
                                         "scatter": [], "pull": [], "push": []}
        copies = _peer_copies(rank, cache, peer_words, src, dst)
        for i in range(cfg["warmup"] + cfg["iters"]):
            if rank == 0:
                runs = {"raw": lambda: dist.send(raw, dst=1),
                        "gather": lambda: gather_blocks(cache, src, everything, everything)}
                move = lambda name: variants[name][0][0].send(variants[name][0][1], plan, {0: shard}, src, f"r{n_tok}-{i}-{name}")
            else:
                runs = {"raw": lambda: dist.recv(raw, src=0),
                        "scatter": lambda: scatter_blocks(cache, dst, everything, everything, staged)}
                move = lambda name: variants[name][0][0].recv(variants[name][0][1], plan, {0: shard}, dst, src)
            for name in variants:
                runs[name] = lambda name=name: move(name)
            for name, n in flights.items():
                runs[name] = _in_flight_run(rank, agent, spec, shard, plan, src, dst, n, next_seq, f"x{n_tok}-{i}")
            # The same order on both ranks, so the barriers pair up; the agent rows rotate by one each iteration, so
            # that none always runs after the same other (a row's time depends on the one before it by up to ~0.1 ms
            # at 1K tokens).
            rows = list(variants)
            rows = rows[i % len(rows):] + rows[:i % len(rows)]
            runs.update(copies)
            for name in ("gather", "scatter", "pull", "push", "raw", *flights, *rows):
                fn = runs.get(name, lambda: None)
                if name in variants:  # the variant's settings, before its timed run (they are not the handoff's work)
                    _configure(*variants[name])
                seconds = _timed(rank, fn)
                if i >= cfg["warmup"] and name in runs:
                    times[name].append(seconds / flights.get(name, 1))  # in flight together: the time per transfer
        _configure(*variants["agent"])  # the default writes last, untimed: what it wrote is what gets verified
        _timed(rank, lambda: move("agent"))
        del raw, staged
        out[n_tok] = {"bytes": nbytes, "blocks": len(src), "verified": _verify(rank, cache, src, dst),
                      **{f"{k}_s": statistics.median(v) for k, v in times.items() if v}}
    return out


def _map_peer_cache(rank: int, cache: torch.Tensor) -> torch.Tensor | None:
    """The other rank's cache mapped into this process by CUDA IPC, as 8-byte words (workers/kv_transfer/peer_ipc.py),
    for the pull and push rows; None where it cannot be mapped."""
    from workers.kv_transfer.blocks import _as_wire, _as_words
    from workers.kv_transfer.peer_ipc import export_cache, import_cache

    handles: list = [None, None]
    dist.all_gather_object(handles, export_cache(cache))
    try:
        return _as_words(_as_wire(import_cache(handles[1 - rank], cache.device)))
    except Exception as e:  # noqa: BLE001 - no peer access between these GPUs: no such rows
        print(f"rank {rank}: the other cache cannot be mapped here ({type(e).__name__}: {e})", flush=True)
        return None


def _peer_copies(rank: int, cache: torch.Tensor, peer_words: torch.Tensor | None, src: list[int],
                 dst: list[int]) -> dict[str, Callable[[], None]]:
    """The block-to-block copy alone (`block_copy.copy_blocks`, no messages): "pull" on the decode rank, reading the
    prefill cache over the link (what the agent's peer copy runs), "push" on the prefill rank, writing the decode cache."""
    if peer_words is None:
        return {}
    from parallel.kernels.block_copy import copy_blocks
    from workers.kv_transfer.blocks import _as_wire, _as_words

    mine = _as_words(_as_wire(cache))
    src_index, dst_index = (torch.tensor(ids, dtype=torch.long, device=cache.device) for ids in (src, dst))
    if rank == 1:
        return {"pull": lambda: copy_blocks(peer_words, mine, src_index, dst_index)}
    return {"push": lambda: copy_blocks(mine, peer_words, src_index, dst_index)}


# A --variants knob's letter -> the KVTransferAgent attribute it sets (the others: c, the row copy's grid cap for every
# copy; d, its launches through the compiled kernel's handle).
AGENT_KNOBS = {"m": "min_messages", "o": "overlap_copy_programs", "l": "lean", "s": "split_bytes", "b": "message_bytes",
               "n": "target_messages", "k": "long_bytes", "p": "peer_ipc"}


def _variants(cfg: dict, pair: tuple, hp: tuple | None, spread: dict[int, tuple],
              defaults: dict) -> dict[str, tuple[tuple, dict]]:
    """Each agent row's (agent, spec) pair and settings: the agent attributes of AGENT_KNOBS (s in MiB), plus "programs"
    (the row copy's grid cap for every copy, 0: none) and "direct" (its compiled kernel's handle, else the JIT path).
    g<N> picks the pair of N process groups (--pair-groups)."""
    first = cfg["min_messages"][0]

    def row(agent_pair: tuple, **knobs) -> tuple[tuple, dict]:
        settings = {**defaults, "programs": 0, "direct": True}
        settings.update(knobs)
        return agent_pair, settings

    # The agent once per --min-messages value (the first is "agent"; later ones "agent_m<N>"), each cutting its
    # transfers into messages of at most ceil(layers / N) layers.
    rows = {("agent" if k == 0 else f"agent_m{m}"): row(pair, min_messages=m) for k, m in enumerate(cfg["min_messages"])}
    if hp is not None:  # "agent_hp": the first min_messages value over the high-priority pair
        rows["agent_hp"] = row(hp, min_messages=first)
    for c in cfg["copy_programs"]:  # "agent_c<N>": every gather and scatter on <= N programs (no overlap-only cap)
        rows[f"agent_c{c}"] = row(pair, min_messages=first, programs=c, overlap_copy_programs=0)
    for c in cfg["overlap_copy_programs"]:  # "agent_o<N>": capped at N only where a message is in flight beside it
        rows[f"agent_o{c}"] = row(pair, min_messages=first, overlap_copy_programs=c)
    for n in spread:  # "agent_g<N>": the defaults over the pair of N groups
        rows[f"agent_g{n}"] = row(spread[n], min_messages=first)
    for spec_text in cfg["variants"]:  # "agent_<spec>": any mix of m<N> o<N> c<N> d<0|1> l<0|1> s<MiB> g<N> b<MiB>
        knobs = {k: int(v) for k, v in re.findall(r"([mocdlsgbnkp])(\d+)", spec_text)}
        if "g" in knobs and knobs["g"] not in spread:
            raise SystemExit(f"variant {spec_text}: no pair of {knobs['g']} groups (--pair-groups {knobs['g']})")
        settings = {AGENT_KNOBS[k]: v for k, v in knobs.items() if k in AGENT_KNOBS}
        for k in ("l", "p"):  # on / off
            if k in knobs:
                settings[AGENT_KNOBS[k]] = bool(knobs[k])
        for k in ("s", "b", "k"):  # in MiB
            if k in knobs:
                settings[AGENT_KNOBS[k]] = knobs[k] << 20
        rows[f"agent_{spec_text}"] = row(spread[knobs["g"]] if "g" in knobs else pair,
                                         **{"min_messages": first, **settings, "programs": knobs.get("c", 0),
                                                  "direct": bool(knobs.get("d", 1))})
    return rows


def _configure(pair: tuple, settings: dict) -> None:
    """A row's settings on its agent and on the row copy's module (`_variants`)."""
    for attr in AGENT_KNOBS.values():
        setattr(pair[0], attr, settings[attr])
    _copy_programs(settings["programs"])
    _direct(settings["direct"])


def _in_flight_run(rank: int, agent: KVTransferAgent, spec: PairSpec, shard: RankShard, plan: list, src: list[int],
                   dst: list[int], n: int, next_seq: list[int], key: str) -> Callable[[], None]:
    """N numbered transfers of the prompt's blocks on the pair at once (issue 24: several in flight per pair), each on a
    thread of its own and started in reverse number order, so each rank's `_PostOrder` has to order their posts, as
    in a served decode replica whose calls reach the ranks in any order. Every one writes the same blocks."""
    def run() -> None:
        base = next_seq[0]
        next_seq[0] += n

        def one(seq: int) -> None:
            if agent.kv_cache.is_cuda:
                torch.cuda.set_device(agent.kv_cache.device)
            if rank == 0:
                agent.send(spec, plan, {0: shard}, src, f"{key}-{seq}", seq)
            else:
                agent.recv(spec, plan, {0: shard}, dst, src, seq)

        for done in [_rank_threads().submit(one, base + k) for k in reversed(range(n))]:
            done.result()  # the first failure raises here

    return run


_THREADS: ThreadPoolExecutor | None = None


def _rank_threads() -> ThreadPoolExecutor:
    """The threads in-flight transfers run on: 16 for the whole run, as a rank actor's (max_concurrency=16). Not new ones
    per run: the agent gives each thread a CUDA stream of its own (`KVTransferAgent._own_stream`), and torch hands out
    its pool's 32 streams a device round robin, so a few dozen short-lived threads made later transfers share streams
    with each other and with the pair's NCCL stream, queueing their copies behind its kernels, which a served rank's
    few long-lived threads do not."""
    global _THREADS
    if _THREADS is None:
        _THREADS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-in-flight")
    return _THREADS


def _copy_programs(n: int) -> None:
    """The row copy's grid cap for the coming transfers (GPU only: elsewhere the handoff uses PyTorch's index ops)."""
    if torch.cuda.is_available():
        from parallel.kernels import block_copy

        block_copy.MAX_PROGRAMS = n


def _direct(on: bool) -> None:
    """Whether the row copy's launches after the first go through the compiled kernel's handle (GPU only; d0 in
    --variants: the JIT path every time, as before)."""
    if torch.cuda.is_available():
        from parallel.kernels import block_copy

        block_copy.DIRECT = on


def _verify(rank: int, cache: torch.Tensor, src: list[int], dst: list[int]) -> bool | None:
    """The decode blocks equal the prefill blocks, bit for bit (the sender's copy travels raw)."""
    everything = slice(None)
    if rank == 0:
        dist.send(gather_blocks(cache, src, everything, everything), dst=1)
        return None
    mine = gather_blocks(cache, dst, everything, everything)
    theirs = torch.empty_like(mine)
    dist.recv(theirs, src=0)
    return bool(torch.equal(mine, theirs))


VARIANT = r"agent_(hp|x\d+|(?:[mocdlsgbnkp]\d+)+)"  # the agent beside the first: other --min-messages, high-priority NCCL, capped copies, mixes


def summarize(results: list[dict], cfg: dict) -> list[dict]:
    sender, receiver = results
    rows = []
    for n_tok in cfg["tokens"]:
        r, s = receiver[n_tok], sender[n_tok]
        gb = r["bytes"] / 1e9
        rows.append({
            "tokens": n_tok, "blocks": r["blocks"], "bytes": r["bytes"], "verified": r["verified"],
            "agent_ms": 1e3 * r["agent_s"], "agent_gbps": gb / r["agent_s"],
            "raw_ms": 1e3 * r["raw_s"], "raw_gbps": gb / r["raw_s"],
            "gather_ms": 1e3 * s["gather_s"], "scatter_ms": 1e3 * r["scatter_s"],
            "agent_over_raw": r["agent_s"] / r["raw_s"], "min_messages": cfg["min_messages"][0],
            **({"pull_ms": 1e3 * r["pull_s"]} if "pull_s" in r else {}), **({"push_ms": 1e3 * s["push_s"]} if "push_s" in s else {}),
            **{f"{k.removesuffix('_s')}_ms": 1e3 * v for k, v in r.items() if re.fullmatch(VARIANT + "_s", k)},
            **{f"{k.removesuffix('_s')}_over_raw": v / r["raw_s"] for k, v in r.items() if re.fullmatch(VARIANT + "_s", k)},
        })
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'tokens':>7} {'blocks':>6} {'MiB':>8} {'agent ms':>9} {'agent GB/s':>10} {'raw ms':>8} {'raw GB/s':>9} " \
           f"{'gather ms':>9} {'scatter ms':>10} {'agent/raw':>9} {'ok':>3}"
    print(head)
    for r in rows:
        print(f"{r['tokens']:>7} {r['blocks']:>6} {r['bytes'] / 2**20:>8.1f} {r['agent_ms']:>9.2f} {r['agent_gbps']:>10.1f} "
              f"{r['raw_ms']:>8.2f} {r['raw_gbps']:>9.1f} {r['gather_ms']:>9.2f} {r['scatter_ms']:>10.2f} "
              f"{r['agent_over_raw']:>9.2f} {'yes' if r['verified'] else 'NO':>3}")
        if "pull_ms" in r or "push_ms" in r:
            print(f"{'':>7} {'copy alone':>15}: pull {r.get('pull_ms', float('nan')):.2f} ms, "
                  f"push {r.get('push_ms', float('nan')):.2f} ms")
        for key in (k for k in r if re.fullmatch(VARIANT + "_ms", k)):
            name = key.removesuffix("_ms")
            print(f"{'':>7} {name:>15}: {r[key]:.2f} ms, {r[name + '_over_raw']:.2f}x raw")


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768], help="prompt lengths")
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--kv-heads", type=int, default=Shape.kv_heads)
    p.add_argument("--head-dim", type=int, default=Shape.head_dim)
    p.add_argument("--block-size", type=int, default=Shape.block_size)
    p.add_argument("--dtype", choices=list(DTYPES), default=Shape.dtype)
    p.add_argument("--min-messages", default="1", help="comma-separated: the agent's min_messages for each agent run "
                   "(the first is the 'agent' column and is verified; e.g. 1,4 compares the default with 4)")
    p.add_argument("--nccl-high-priority", action="store_true", help="also time the agent over a pair whose NCCL "
                   "kernels run on high-priority streams (the 'agent_hp' row; KVTransferAgent.nccl_high_priority)")
    p.add_argument("--copy-programs", default="", help="comma-separated: also time the agent with its gather and scatter "
                   "capped at N programs each (the 'agent_c<N>' rows; TANDEM_KV_COPY_PROGRAMS)")
    p.add_argument("--overlap-copy-programs", default="", help="comma-separated: also time the agent with gathers and "
                   "scatters capped at N programs only beside a message in flight (the 'agent_o<N>' rows; "
                   "KVTransferAgent.overlap_copy_programs)")
    p.add_argument("--variants", default="", help="comma-separated agent settings to time, each any mix of m<N> "
                   "(min_messages), o<N> (overlap_copy_programs), c<N> (copy programs), d<0|1> (the row copy through "
                   "its compiled kernel's handle, default 1), l<0|1> (short transfers through the agent's lanes: "
                   "KVTransferAgent.lean, default TANDEM_KV_LEAN=1 or off), s<MiB> (KVTransferAgent.split_bytes: a transfer "
                   "of at least this many MiB that fits one message goes as two; s0: never), b<MiB> (KVTransferAgent.message_bytes), "
                   "n<N> (KVTransferAgent.target_messages, n0: off), k<MiB> (KVTransferAgent.long_bytes: longer transfers "
                   "are cut by n and spread over the groups), g<N> (the pair of N groups, --pair-groups), p<0|1> (same-node "
                   "pairs copy out of the mapped prefill cache: KVTransferAgent.peer_ipc, default TANDEM_KV_PEER_IPC=1; p0: "
                   "NCCL messages), e.g. m2o66,o32,d0,g1n0l0s0,p0 "
                   "(the 'agent_<spec>' rows)")
    p.add_argument("--pair-groups", default="", help="comma-separated N: also time the agent over a pair of N process "
                   "groups (the 'agent_g<N>' rows; KVTransferAgent.pair_groups, default 2, whose turns carry the messages "
                   "of a transfer over 256 MiB); g<N> in --variants picks that pair for a row")
    p.add_argument("--in-flight", default="", help="comma-separated: also time N transfers of each prompt on the pair "
                   "at once, numbered, as a decode replica runs several handoffs per pair (the 'agent_x<N>' rows: time "
                   "per transfer, so agent_x4_ms below agent_ms is what overlapping them gains)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="the agent's transfer timeout, seconds")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: two processes over gloo (a check, not a benchmark)")
    p.add_argument("--out", default="bench_results/kv_transfer.json")
    args = p.parse_args(argv)
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.block_size, args.dtype)
    cfg = {"shape": asdict(shape), "tokens": args.tokens, "warmup": args.warmup, "iters": args.iters,
           "seed": args.seed, "timeout_s": args.timeout, "device": args.device,
           "min_messages": [int(m) for m in args.min_messages.split(",") if m], "nccl_high_priority": args.nccl_high_priority,
           "copy_programs": [int(c) for c in args.copy_programs.split(",") if c],
           "overlap_copy_programs": [int(c) for c in args.overlap_copy_programs.split(",") if c],
           "variants": [v for v in args.variants.split(",") if v],
           "in_flight": [int(n) for n in args.in_flight.split(",") if n],
           "pair_groups": [int(n) for n in args.pair_groups.split(",") if n and int(n) >= 1]}
    rows = summarize(run_pair(_bench_rank, cfg, args.device), cfg)
    print_table(rows)
    report = {
        "bench": "kv_transfer", "backend": "nccl" if args.device == "cuda" else "gloo",
        "shape": asdict(shape), "bytes_per_block": shape.bytes_per_block,
        "warmup": args.warmup, "iters": args.iters,
        "devices": [torch.cuda.get_device_name(i) for i in range(2)] if args.device == "cuda" else ["cpu (gloo)"] * 2,
        "torch": torch.__version__, "nccl": _nccl_version() if args.device == "cuda" else None,
        "host": platform.node(), "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if not all(r["verified"] for r in rows):
        raise SystemExit("the received blocks differ from the sent blocks")
    return report


if __name__ == "__main__":
    main()
