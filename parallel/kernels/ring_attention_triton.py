"""One ring-attention step in Triton: query rows against one K/V chunk, with the log-sum-exp, merged in place.

`chunk_attention(q, k, v, scale, q_pos, k_pos)`: q [Tq, Hq, D], k/v [Tk, Hkv, D] (GQA: query head h
reads KV head h // (Hq / Hkv), KV heads never repeated); q_pos [Tq] / k_pos [Tk] ascending absolute
positions of the rows (a query sees the keys at positions <= its own), or both None (every query sees
every key). Returns out [Tq, Hq, D] and lse [Tq, Hq] fp32 (-inf, out 0, for a row that sees no key).
`chunk_attention_merge_` instead merges the chunk's attention into running fp32 accumulators
(out, lse) in place, exactly (the LSE merge of parallel/ring_attention.py). `ring_step` is what
parallel/ring_attention.py's ring runs per step: one launch for a whole ragged batch, driven by a tile
table (`build_tiles`, made once per pair of shards and reused by every layer), whose first step writes the
fp32 accumulators (no zero fill), middle steps merge into them and last step merges and writes the output
in q's dtype (no separate cast); a ring of one writes the output directly. `StepLaunch` is a step's launch with
everything but its K/V worked out once (the ring plans each of its launches once per call, so its host cost per
step is one plan and Triton's launch path).

Flash-attention-2 style: one program per (head group, tile of query rows), online softmax over BLOCK_N key
tiles in registers, exp2 with log2(e) folded into the scale. Each tile-table row is one query tile:
rows [q0, q1) of one sequence, its keys rows [k0, k_end), of which [k0, k_full) are seen by every query of
the tile (those tiles run with no mask at all: no position loads, no compares) and [k_full, k_end) by some
(only the tiles there load positions and compare them; positions may be any ascending sets: the SP layout
interleaves the ranks' 16-token blocks); keys past k_end are in the whole tile's future and never loaded.
Rows are sorted heaviest first (the tiles with the most keys start first, the grid's tail is the short
ones) and heads vary fastest in the grid (programs sharing K/V tiles run together and hit L2).

GQA packing (`RingConfig.pack`): a program takes all Hq / Hkv query heads of one KV head for BLOCK_M / G
query rows, interleaved in the M dimension (row m: position m // G, head m % G), so every K/V tile it loads
serves G heads (G times fewer K/V loads from L2 than one program per query head); otherwise one program per
query head and BLOCK_M rows.

Split-K (`RingConfig.splits`, flash-decoding style): a query tile's key range cut into pieces at BLOCK_N
boundaries (`split_tiles`), one program each, so a step whose grid is too small for the GPU, or whose longest
program would outlast the rest, spreads its keys over more programs. Each piece writes its normalised partial
and LSE to scratch (`partial_buffers`, O(chunk)); a second launch (`_merge_kernel`) merges a tile's pieces by
LSE, exactly, and finishes as an unsplit step would (in-place merge into the accumulators, output in q's dtype).
How many pieces: `split_counts`, from the step's key tiles per SM (`sm_count`); "split=N" in a config forces
up to N. The split kernel is a compile of its own (SPLIT), so unsplit steps run the kernel as before.

Short steps (16K tokens at SP=4: ~16 key tiles per program against ~64 at SP=1, the same number of programs per
rank) pay each program's fixed cost four times as often per key tile. Two options cut it (`RingConfig`): `early`
starts a step's online softmax from the accumulators, loaded beside q, so the epilogue makes no second memory
round trip; `pdl` chains the steps by programmatic dependent launch, so a step's programs fill the SMs the
previous step's tail frees.

Launch configs: `RingConfig`, the `CONFIGS` table by head dim, the TANDEM_RING_KERNEL environment variable
("BLOCK_M,BLOCK_N,warps,stages[,pack][,split=N][,acc16][,early][,pdl][,fuse][,gather][,oneloop][,hybrid]
[,batchcopy][,overlap][,oneloop0][,plain0][,trim0][,hband=N][,first=N/W/S[/M]]");
scripts/tune_ring_kernel.py times candidates on a GPU.
Memory: the inputs, the accumulators and output, the tile table and, split, the pieces' partials: O(chunk).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from parallel.kernels.direct_launch import Handles, int_kind

try:  # TMA descriptors (Triton >= 3.4, Hopper and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

_LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_FIELDS = 7  # a tile-table row: q0, q1, k0, k_full, k_end, causal, slot (int32; slot -1: not a split piece)
MERGE_FIELDS = 4  # a merge-table row: q0, q1, first slot, pieces (int32)
ENV = "TANDEM_RING_KERNEL"
# The automatic split-K rule (`split_counts`): no program may hold more than 1 / SPLIT_TAIL of an SM's share of
# a step's key tiles (a longer one would end after the rest of the grid), but a program of SPLIT_MIN_TILES key
# tiles or fewer is never cut (each piece pays a program's fixed cost: its Q load, pipeline fill, partial store).
SPLIT_TAIL = 4
SPLIT_MIN_TILES = 4
MAX_SPLITS = 16
# ... unless the grid already fills SPLIT_WAVES waves of programs and none holds more than an SM's share: launched
# heaviest first, its longest programs start first and end before the rest of the grid (e.g. the fused launch of
# 16K tokens at SP=4: 1,024 programs of up to 96 key tiles, ~372 per SM), so pieces would only add the partials'
# stores and a merge launch.
SPLIT_WAVES = 2


@dataclass(frozen=True)
class RingConfig:
    """Launch configuration of the ring kernel: tile sizes, warps, pipeline stages, GQA packing (a program
    takes every query head of one KV head: BLOCK_M / G query rows x G heads, see the module docstring) and
    split-K (`splits`: 0 chooses per step from its work and the SM count, `split_counts`; 1 never splits; n
    cuts every query tile's key range into up to n pieces) and `acc16`: the ring's running output between steps
    in q's 16-bit dtype instead of fp32 (its LSE stays fp32): half the accumulators' traffic per step, each
    merge rounded to bf16 / fp16 as the output finally is. Off by default: fp32 keeps the merge exact.

    `early`: a step that merges starts its online softmax from the accumulators (m = their LSE, l = 1, acc =
    their output, exactly the state they stand for) instead of merging them into its result after its key loop:
    their load is issued beside q's at the program's start, the epilogue is a plain normalise-and-store (no
    second memory round trip, no merge arithmetic) and the result is the same merge. `pdl`: steps after the
    first are launched with programmatic dependent launch (Hopper+): a step's programs start on the SMs the
    previous step's tail frees and run up to the accumulators (`gdc_wait`, the previous step's writes complete
    and visible), instead of each launch draining the GPU first. Split steps launch plainly (their pieces share
    one scratch). In `ring_attention` a receive wait sits between two steps on the stream; CUDA then serialises
    the launch as usual (no overlap, still correct).

    `fuse` (read by parallel/ring_attention.py, not by the kernel): with three or more ranks, the steps after the
    first run as one launch over every received K/V block, scattered as it arrives into one buffer in position
    order, so each query tile has one key range (one masked stretch) as at SP=1 and the rank runs two launches
    (two rounds of q / accumulator traffic, half the programs) instead of SP. The blocks travel as the ring's
    do, all of them during the first step's compute; the rank holds them all (O(sequence) K/V, not O(chunk)),
    so it is meant for short chunks, where each step's fixed costs dominate.

    `oneloop`: a program's key tiles in one pipelined loop, the masked ones (from the first that straddles a query's
    position) by a uniform branch on the tile's start, instead of a second loop after the unmasked one: no pipeline
    drain and refill between the two, and the masked tile's K/V loads are prefetched with the others (a short
    program's fixed cost); the unmasked tiles then also compute the row max's -inf guard.

    `batchcopy` (read by parallel/ring_attention.py): under `fuse`, the other ranks' blocks are held as they arrive
    and scattered into position order at the last step in one launch per three blocks (`scatter_blocks`), not one
    copy launch per block as it arrives: the copies run after the first step's kernel either way (one stream),
    and the host issues one launch before the fused launch the GPU waits for (not yet measured on a GPU).

    `hybrid` (read by parallel/ring_attention.py; SP = 2): the first step runs the own block for a quarter of the
    head groups only (HYBRID_SHARE: enough work to cover the other block's transfer), then both blocks are
    scattered into position order and one launch takes the other head groups over every key (programs as long as
    SP=1's), and a last one the first quarter over the other block (merged into the first step's accumulators):
    three launches, fewer and longer programs than the ring's two steps, the transfer still overlapped.

    `overlap` (read by parallel/ring_attention.py): the one scatter of `hybrid` or `batchcopy` runs on a side stream
    from the ring's start (the blocks it copies are ready then, or on their receive), so the copy overlaps the first
    launch's compute instead of running between two attention launches; where the ring keeps its fused buffer
    (short chunks, `KEEP_ACC_TOKENS`), on CUDA. Off by default: at 16K tokens on an H100 (2026-11-27, two runs) it was
    no faster, 0.296-0.298x of SP=1 streamed at SP=4 against 0.294x without, 0.512-0.515x at SP=2 against 0.490-0.502x
    (the first launch's programs fill the SMs; the copy's then wait or slow them).

    `oneloop0` (read by parallel/ring_attention.py): `oneloop` for the ring's first launch only (the own block: short
    programs, whose fixed cost the one loop cuts), the other launches as the config says (at 16K tokens SP=4 on an
    H100, oneloop took the own block's launch from 0.321 to 0.303 ms and the fused launch from 0.810 to 0.834). Off by
    default: with fuse,batchcopy it was 0.298x of SP=1 streamed against 0.294x without (first launch 0.297-0.300 ms
    against 0.321, the rest within noise).

    `plain0` (read by parallel/ring_attention.py): the ring's first launch reads K/V by plain loads, not TMA. A TMA
    launch costs the host two tensor descriptors (built in Python, then encoded by Triton's launcher on every call),
    and a rank's first launch is the one the GPU waits for: nothing is queued before it, so its host time is the
    rank's own (each call timed alone, as scripts/bench_sp_rank.py does; in a forward, the previous layer's kernels
    hide it). The other launches keep TMA (issued while the first one runs). Opt-in: on one H100 at 16K tokens SP=4
    (2026-11-27) the first launch took 0.37 ms by plain loads against 0.32 by TMA, more than the host time it saves.

    `trim0` (read by parallel/ring_attention.py; with `fuse` and `batchcopy`, a rank holding one sequence): the first
    launch takes the rank's own keys from row R on (R: 1 / TRIM0_SHARE of them, whole query tiles) and the queries
    that see them, a smaller causal triangle; the own block's rows before R join the other ranks' blocks in the fused
    launch's position-ordered buffer (one more source of its one scatter). Every query still meets every key once.
    Why: the own block's causal triangle is the rank's shortest programs (at 16K tokens SP=4, 1,024 programs of 1-32
    key tiles), each paying a program's fixed cost; trimmed, the first launch has a quarter fewer programs, and the
    keys it gives up add key tiles to the fused launch's programs, which exist anyway. The first launch keeps (1 -
    1 / TRIM0_SHARE)^2 of the triangle's work, still more than the other blocks' transfers it overlaps in the ring.
    The rows no first-launch program writes are set once in the plan's kept accumulators (LSE -inf), so it needs them
    kept (short chunks, `KEEP_ACC_TOKENS`). Opt-in: on one H100 at 16K tokens SP=4 (2026-11-27) the first launch went
    from 0.32 to 0.21 ms and the fused one (with the scatter) from 0.80 to 0.95 ms: no faster in all.

    `hband` (N >= 1): the program order takes the head groups N at a time: every tile of groups [0, N), heaviest
    first and the N groups fastest, then groups [N, 2N), ...; 0: all groups fastest. With GQA packing a head
    group is one KV head, so programs of different groups share no K/V: running all of them at once, the launch's whole
    K/V (48 MiB for a fused launch at 16K tokens SP=4, an H100's L2 is 50 MB) is what the running programs read, at
    staggered positions; in bands, only N heads' share. The last band's heaviest programs start 1 - N / groups of the
    way through, so a band must hold more work than the longest program (N >= groups / 4 at 16K). Ignored where N does
    not divide a launch's groups. On one H100 (2026-11-27) the kernels took the same time with N = 1, 2, 4 as without,
    at 16K tokens SP=2 and 4 and at 64K SP=2 and 4 (within 2%); on one H200 (2026-11-29) N = 1 took 64K SP=2 from 0.518x
    to 0.493x of SP=1 and 128K SP=2 from 0.572x to 0.493x, where a block of K/V is 4-8 times L2: `default_config`
    sets N = 1 where the rank's block outgrows L2 (HBAND_L2).

    `first` (BLOCK_N, warps, stages[, BLOCK_M]; read by parallel/ring_attention.py): the ring's first launch with these
    instead of the config's; with a fourth value, the first launch's BLOCK_M too, and so its own tile table (built
    unsplit; where that BLOCK_M would change the heads a program packs, the config's is kept). The first launch is the
    rank's own block, a causal triangle of short programs (at 16K tokens SP=4 ~450 TFLOPS on an H100 against ~540 for
    the fused launch), which other tiles may suit better. A BLOCK_N that does not divide the config's, on a split
    table, is not applied. Opt-in: on one H100 (2026-11-27, sixteenth session) the first launch took 0.31 ms with
    64/8/3 against 0.32-0.33 by default at 16K tokens SP=4 (ratios within each other's noise, 0.300-0.318 against
    0.307-0.313 timed alone), and 69.7 against 71.0 ms at 128K SP=2 in one run whose SP=1 drifted 6%: not enough to
    make it the default. On one H200 (2026-11-29, scripts/ring_timeline.py) at 16K SP=4: default 315 us, 64/8/3 308,
    64/4/2 (two CTAs an SM, 116 registers spilled) 298, every BLOCK_M of 64 slower (339-749); 64/4/2 in
    bench_sp_rank.py gave 0.308 and 0.327 against the default's 0.318 and 0.312.

    `gather` (read by parallel/ring_attention.py; SP >= 2): as `fuse`, the rank's own block scattered too, so the
    rank runs ONE launch over every key in position order (programs as long as SP=1's for its query tiles: each
    program's fixed cost paid once per query tile, not once per step), after every block has arrived: nothing
    overlaps the transfers, so a rank's time is that launch plus the wait for the last block (the one-GPU
    per-rank benchmarks do not see that wait; it is about (SP - 1) x a block's bytes over the link)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: bool = False
    splits: int = 0
    acc16: bool = False
    early: bool = False
    pdl: bool = False
    fuse: bool = False
    gather: bool = False
    oneloop: bool = False
    hybrid: bool = False
    batchcopy: bool = False
    overlap: bool = False
    oneloop0: bool = False
    plain0: bool = False
    trim0: bool = False
    hband: int = 0
    first: tuple = ()

    @classmethod
    def parse(cls, text: str) -> "RingConfig":
        """"BLOCK_M,BLOCK_N,warps,stages" then optionally "pack" (or 1/0), "split=N" (or "splitN"; "split=auto"
        is the default), "acc16", "early", "pdl", "fuse", "gather", "oneloop", "hybrid", "batchcopy", "overlap",
        "oneloop0", "plain0", "trim0", "hband=N" and "first=BLOCK_N/warps/stages[/BLOCK_M]": as the env variable, e.g.
        "128,128,8,3,pack,split=2"."""
        parts = [p.strip().lower() for p in text.replace("x", ",").split(",") if p.strip()]
        pack, splits, hband, first, flags = None, None, None, None, set()
        for flag in parts[4:]:
            if flag in ("acc16", "early", "pdl", "fuse", "gather", "oneloop", "hybrid", "batchcopy", "overlap",
                        "oneloop0", "plain0", "trim0") \
                    and flag not in flags:
                flags.add(flag)
            elif flag.startswith("hband") and hband is None:
                n = flag[5:].lstrip("=")
                hband = int(n) if n.isdigit() else -1
            elif flag.startswith("first=") and first is None:
                first = tuple(int(x) if x.isdigit() else -1 for x in flag[6:].split("/"))
            elif flag.startswith("split") and splits is None:
                n = flag[5:].lstrip("=")
                splits = 0 if n == "auto" else int(n) if n.isdigit() else -1
            elif flag in ("pack", "1", "true", "p", "0", "false") and pack is None:
                pack = flag in ("pack", "1", "true", "p")
            else:
                raise ValueError(f"a ring kernel config is BLOCK_M,BLOCK_N,warps,stages[,pack][,split=N][,acc16]"
                                 f"[,early][,pdl][,fuse][,gather][,oneloop][,hybrid][,batchcopy][,overlap]"
                                 f"[,oneloop0][,plain0][,trim0][,hband=N][,first=N/W/S[/M]], not {text!r}")
        if len(parts) < 4 or not all(p.isdigit() for p in parts[:4]):
            raise ValueError(f"a ring kernel config is BLOCK_M,BLOCK_N,warps,stages[,pack][,split=N][,acc16]"
                             f"[,early][,pdl][,fuse][,gather][,oneloop][,hybrid][,batchcopy][,overlap][,oneloop0]"
                             f"[,plain0][,trim0][,hband=N][,first=N/W/S[/M]], "
                             f"not {text!r}")
        cfg = cls(*(int(p) for p in parts[:4]), bool(pack), splits or 0, "acc16" in flags, "early" in flags,
                  "pdl" in flags, "fuse" in flags, "gather" in flags, "oneloop" in flags, "hybrid" in flags,
                  "batchcopy" in flags, "overlap" in flags, "oneloop0" in flags, "plain0" in flags,
                  "trim0" in flags, hband or 0, first or ())
        if cfg.block_m < 16 or cfg.block_n < 16 or cfg.num_warps < 1 or cfg.num_stages < 1 \
                or cfg.block_m & (cfg.block_m - 1) or cfg.block_n & (cfg.block_n - 1) or not 0 <= cfg.splits <= 64 \
                or not 0 <= cfg.hband <= 64 or (first is not None and (
                    len(first) not in (3, 4) or min(first) < 1 or any(t < 16 or t & (t - 1) for t in first[::3]))):
            raise ValueError(f"bad ring kernel config {text!r}: tiles powers of two >= 16, warps and stages >= 1, "
                             f"split auto or 1..64, first=BLOCK_N/warps/stages[/BLOCK_M]")
        return cfg

    def __str__(self) -> str:
        return f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}" + (",pack" if self.pack else "") \
            + (f",split={self.splits}" if self.splits else "") + (",acc16" if self.acc16 else "") \
            + (",early" if self.early else "") + (",pdl" if self.pdl else "") + (",fuse" if self.fuse else "") \
            + (",gather" if self.gather else "") + (",oneloop" if self.oneloop else "") \
            + (",hybrid" if self.hybrid else "") + (",batchcopy" if self.batchcopy else "") \
            + (",overlap" if self.overlap else "") + (",oneloop0" if self.oneloop0 else "") \
            + (",plain0" if self.plain0 else "") + (",trim0" if self.trim0 else "") \
            + (f",hband={self.hband}" if self.hband else "") \
            + (",first=" + "/".join(map(str, self.first)) if self.first else "")

    def heads_per_program(self, gqa: int) -> int:
        """Query heads one program takes: the GQA group when packing (and it fits BLOCK_M with >= 1 row), else 1."""
        return gqa if self.pack and gqa > 1 and self.block_m % gqa == 0 and gqa & (gqa - 1) == 0 else 1


@functools.lru_cache(maxsize=None)
def parse_config(text: str) -> RingConfig:
    """`RingConfig.parse`, once per string (a ring parses its config on every layer's call)."""
    return RingConfig.parse(text)


# Long query chunks in 16/32-bit floats, by head dim: (TMA loads, plain loads). 128 x 128 tiles, 8 warps and
# 3 stages are the prefill kernel's best on an H100 at 8K tokens (scripts/bench_prefill_attention.py); three
# stages of 128 x 128 K/V tiles need Hopper's shared memory, hence 128 x 64 with plain loads.
# scripts/tune_ring_kernel.py times candidates for this kernel; edit here with what it finds. Its first run
# (H100, 2026-11-26, docs/benchmarks.md) put GQA packing first: each K/V tile then serves the group's query
# heads, 0.491x of SP=1 at 64K SP=2 against 0.516x unpacked, and at least as good in 5 of 6 cells.
CONFIGS: dict[int, tuple[RingConfig, RingConfig]] = {
    d: (RingConfig(128, 128, 8, 3, True), RingConfig(128, 64, 8, 3, True)) for d in (16, 32, 64, 128)
}


def default_config(tq: int, head_dim: int, element_size: int, tma: bool, ranks: int | None = None,
                   kv_bytes: int = 0, l2_bytes: int = 0) -> RingConfig:
    """The config for `tq` query rows of a ring over `ranks` blocks (None: not known): TANDEM_RING_KERNEL if set,
    else `CONFIGS` (16-bit floats, D <= 128, >= 128 rows), else fp32 (two stages: three would not fit in shared
    memory) or short chunks; `fuse` on where the rank's queries are at most FUSE_MAX_TOKENS (it applies from SP=3 on),
    with `batchcopy` at SP=4; `hybrid`, `oneloop` and `early` at SP=2 up to HYBRID_MAX_TOKENS; `hband=1` where
    neither applies and a block of K/V (`kv_bytes`, the rank's own) is larger than the GPU's L2 cache (`l2_bytes`,
    0: not known): see HBAND_L2."""
    env = os.environ.get(ENV)
    if env:
        return parse_config(env)
    if tq >= 128 and head_dim in CONFIGS and element_size == 2:
        config = CONFIGS[head_dim][0 if tma else 1]
    elif tq >= 128 and head_dim <= 128:
        config = RingConfig(128, 64, 8, 2)
    else:
        config = RingConfig(max(16, min(64, triton.next_power_of_2(max(tq, 1)))), 64, 4, 2)
    if tq <= FUSE_MAX_TOKENS:
        config = dataclasses.replace(config, fuse=True, batchcopy=ranks == 4)
    if ranks == 2 and tq <= HYBRID_MAX_TOKENS:
        config = dataclasses.replace(config, hybrid=True, oneloop=True, early=True)
    if HBAND_L2 and not (config.fuse or config.hybrid) and l2_bytes and kv_bytes > l2_bytes:
        config = dataclasses.replace(config, hband=1)
    return config


# `hband=1` by default where a rank's block of K/V outgrows L2. With every head group's programs running at once (the
# heads-fastest order), a launch's running programs read all the KV heads' keys at staggered positions: at 128K tokens
# SP=2 that is 256 MiB of K/V per launch against an H200's 60 MiB of L2, so the tiles go back and forth to HBM. One
# group at a time, the running programs share one head's 32 MiB. On one H200 (2026-11-29, scripts/tune_ring_kernel.py,
# docs/benchmarks.md) the slowest rank went from 0.572x to 0.493x of SP=1 at 128K SP=2 and 0.518x to 0.493x at 64K
# SP=2; at 16K tokens (48 MiB, within L2) an H100 measured no change (2026-11-27). TANDEM_RING_HBAND_L2=0 turns it off.
HBAND_L2 = os.environ.get("TANDEM_RING_HBAND_L2", "1") != "0"


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """A CUDA device's L2 cache in bytes (what `default_config` weighs a K/V block against); 0 elsewhere."""
    if torch.device(device).type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


# Tried as SP=4 defaults beside fuse,batchcopy on one H100 (2026-11-27, 16K tokens) and left opt-in, none measured
# faster in the same call: oneloop0, plain0 and trim0 (timed alone 0.320 / 0.345 / 0.327 against 0.332; streamed
# 0.282 / 0.295 / 0.289 against 0.284: plain loads slowed the first launch 0.32 -> 0.37 ms, trim0's keys cost the fused
# launch what they saved the first, 0.21 + 0.95 ms against 0.32 + 0.80); hband=4 (timed alone 0.300 / 0.328 against
# 0.332 / 0.322 in bench_sp_rank, kernels 0.306 + 0.761 ms against 0.312 + 0.745) and hband=1 / 2 (0.319 / 0.308
# against 0.322 in the sweep, the same kernel times within 2%).
# RingConfig.trim0: the own block's first 1 / TRIM0_SHARE rows go to the fused launch. At 16K tokens SP=4 the first
# launch then keeps 9/16 of the own triangle's work (~0.18 ms on an H100), more than the ~3 x 45 us the other three
# 16 MiB blocks take to arrive one after another over NVLink (~370 GB/s).
TRIM0_SHARE = max(2, int(os.environ.get("TANDEM_RING_TRIM0_SHARE", "4")))  # read once: plans cached by process

# RingConfig.hybrid: the share of head groups the first step (own block only) takes; at 16K tokens SP=2 that is ~0.26 ms
# of GPU time on an H100, ~3x an NVLink transfer of the other block (32 MiB).
HYBRID_SHARE = 4

# `fuse` by default up to this many query rows per rank: short chunks, whose per-step fixed costs dominate. On one H100
# (2026-11-27, docs/benchmarks.md) 16K tokens at SP=4 (4K per rank) ran 0.377x / 0.302x of SP=1 fused (split-K off,
# as the automatic rule now leaves it; each block copied as it arrives) against 0.391x / 0.343x in four steps (each
# run alone / runs back to back). 64K at SP=4 (16K per rank) was 0.249x fused against 0.263x on one H200 in an
# earlier session, not remeasured since: the default stops at the chunk measured here. Fused, a rank holds every
# other rank's K/V block at once (O(sequence) K/V for the layer's attention, not two blocks).
FUSE_MAX_TOKENS = 4096
# `batchcopy` with `fuse` by default at SP=4 only, and `hybrid` with `oneloop` and `early` at SP=2 for chunks up to this
# many query rows: what one H100 measured (2026-11-27, 16K tokens; docs/bench_data/2026-11-27n-h100): each rank's ring
# timed alone 0.358x of SP=1 fused with batchcopy against 0.390x fused, and 0.573x hybrid,oneloop against 0.609x in two
# steps (0.539x / 0.572x streamed); with the kept launches (call 3) hybrid,oneloop,early 0.506x (0.502x streamed)
# against 0.572x (0.539x) without early, and 0.571x in two steps. 64K at SP=2 (32K per rank) keeps the two steps:
# hybrid was not measured there.
HYBRID_MAX_TOKENS = 8192


@triton.jit
def _tile(q, k, v, m_i, l_i, acc, qk_scale, visible, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One K/V tile of online softmax in the log2 domain; q [M, D], k/v [N, D], visible [M, N] (MASK only)."""
    if IEEE:  # fp32 inputs: exact fp32 products, not TF32
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet stays at -inf: subtract 0 instead (exp2(-inf) = 0, no nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
    else:  # every score visible: the scale rides on the max subtraction (one FMA per score)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_safe)  # the old sums were relative to the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _one_loop(q, k_ptr, v_ptr, k_desc, v_desc, kpos_ptr, qpos, m_i, l_i, acc, qk_scale, k0, full_end, k_end, causal,
              kv_col, stride_kt, stride_vt, offs_d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
              IEEE: tl.constexpr):
    """Keys [k0, k_end) in one pipelined loop (RingConfig.oneloop): the tiles from full_end on (those that straddle
    some query's position, or run past k_end) masked by a uniform branch on the tile's start, the rest plain. The
    scores stay unscaled through the branch; the scale rides on the max and the exponent as in `_tile`'s
    unmasked path, and a row that has seen nothing keeps its max at -inf (subtract 0: no nan)."""
    for start_n in range(k0, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < k_end
        k = _load_kv(k_ptr, k_desc, start_n, mask_n, kv_col, stride_kt, offs_d, BLOCK_N, TMA, True)
        v = _load_kv(v_ptr, v_desc, start_n, mask_n, kv_col, stride_vt, offs_d, BLOCK_N, TMA, True)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if start_n >= full_end:
            kpos = tl.load(kpos_ptr + offs_n, mask=mask_n & ((tl.zeros([BLOCK_N], tl.int32) + causal) != 0), other=0)
            qk = tl.where(mask_n[None, :] & (qpos[:, None] >= kpos[None, :]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _load_kv(ptr, desc, start_n, valid, col, stride_t, offs_d, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
             BOUNDED: tl.constexpr):
    """K or V rows [start_n, start_n + BLOCK_N) of the KV head whose values start at column `col` (TMA: one
    box, rows past the tensor zero-filled; else plain loads, masked by `valid` when BOUNDED: a tile that may
    run past the keys in use). Rows past the tile's keys are masked by the caller."""
    if TMA:
        x = desc.load([start_n, col])
    else:
        rows = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        ptrs = ptr + rows[:, None] * stride_t + col + offs_d[None, :]
        if BOUNDED:
            x = tl.load(ptrs, mask=valid[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _finish(out, lse, rows, head, mask_m, offs_d, acc_o_ptr, acc_l_ptr, out_ptr, load_prev, store_acc, store_out,
            stride_at, stride_ah, stride_lt, stride_lh, stride_ot, stride_oh, MERGE: tl.constexpr = True):
    """A program's result (out [M, D], lse [M] fp32, of query rows `rows`, heads `head`): merged into the
    accumulators when `load_prev` (as merge_into does; not compiled without MERGE: an `early` program started
    from them), then stored to them and/or to the output."""
    a_ptrs = acc_o_ptr + rows[:, None] * stride_at + head[:, None] * stride_ah + offs_d[None, :]
    l_ptrs = acc_l_ptr + rows * stride_lt + head * stride_lh
    if MERGE:
        if load_prev != 0:  # out, lse := the merge of the accumulators and this chunk's partial
            prev_o = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
            prev_lse = tl.load(l_ptrs, mask=mask_m, other=float("-inf"))
            hi = tl.maximum(prev_lse, lse)
            hi = tl.where(hi == float("-inf"), 0.0, hi)
            w_prev = tl.exp(prev_lse - hi)
            w_new = tl.exp(lse - hi)
            total = w_prev + w_new
            out = (prev_o * w_prev[:, None] + out * w_new[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
            lse = tl.where(total > 0, hi + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    if store_acc != 0:
        tl.store(a_ptrs, out.to(acc_o_ptr.dtype.element_ty), mask=mask_m[:, None])
        tl.store(l_ptrs, lse, mask=mask_m)
    if store_out != 0:  # the final output, in its own dtype
        o_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


@triton.jit(do_not_specialize=["hg0", "load_prev", "store_acc", "store_out"])  # one compile for every step
def _ring_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, qpos_ptr, kpos_ptr, tiles_ptr, acc_o_ptr, acc_l_ptr, out_ptr,
                 part_o_ptr, part_l_ptr, qk_scale, n_groups, hg0, load_prev, store_acc, store_out,
                 stride_qt, stride_qh, stride_kt, stride_vt, stride_at, stride_ah, stride_lt, stride_lh,
                 stride_ot, stride_oh,
                 GQA: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                 EARLY: tl.constexpr, PDL: tl.constexpr, ONELOOP: tl.constexpr = False, HBAND: tl.constexpr = 0):
    # Heads vary fastest: the programs of one tile (same keys) run side by side. SPLIT: the table has split-K
    # pieces (a compile of its own, so the unsplit kernel's registers are as before). EARLY: start from the
    # accumulators (RingConfig.early; pieces never do: their merge kernel merges). PDL: RingConfig.pdl.
    if PDL:  # the next step may launch now: its programs take the SMs this grid's tail frees
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if HBAND > 0:  # RingConfig.hband: HBAND groups at a time, each band's tiles heaviest first, its groups fastest
        per_band = (tl.num_programs(0) // n_groups) * HBAND
        hg = hg0 + (pid // per_band) * HBAND + pid % HBAND
        row = tiles_ptr + ((pid % per_band) // HBAND) * 7
    else:
        hg = hg0 + pid % n_groups  # head group: query heads hg * HP .. hg * HP + HP - 1 (this launch's from hg0)
        row = tiles_ptr + (pid // n_groups) * 7
    q0 = tl.load(row)
    q1 = tl.load(row + 1)
    k0 = tl.load(row + 2)
    k_full = tl.load(row + 3)  # keys [k0, k_full) are seen by every query of the tile
    k_end = tl.load(row + 4)  # keys [k_end, ...) by none of them
    causal = tl.load(row + 5)  # 0: every key in [k0, k_end) is seen by every query (bounds masks only)
    slot = -1
    if SPLIT:
        slot = tl.load(row + 6)  # >= 0: one piece of a split key range, its partial goes to slot `slot`
    if (k_end == k0) & (load_prev != 0) & (store_out == 0) & (slot < 0):  # nothing to add: accumulators stay
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    t_idx = q0 + offs_m // HP  # query row of each M row (HP > 1: GQA packing, heads interleaved)
    head = hg * HP + offs_m % HP
    mask_m = t_idx < q1
    rows = t_idx.to(tl.int64)
    kv_col = ((hg * HP) // GQA) * D  # k/v rows hold Hkv heads of D contiguous values
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)
    if EARLY and not SPLIT:
        if PDL:  # the accumulators are the previous step's: wait until that grid is done and its writes visible
            tl.extra.cuda.gdc_wait()
        # The online softmax's state for the keys merged so far, exactly: max m = their LSE (log2 domain), sum
        # l = 1 (the output is normalised), acc = the output. Masked loads (load_prev 0): nothing seen, no traffic.
        # Addresses as int32 offsets from the tile's first row and head (not the epilogue's 64-bit pointers, which
        # the compiler would otherwise keep live, spilled, across the key loops).
        prev = mask_m & ((tl.zeros([BLOCK_M], tl.int32) + load_prev) != 0)
        rel = (offs_m // HP) * stride_at + (offs_m % HP) * stride_ah
        a_base = acc_o_ptr + q0.to(tl.int64) * stride_at + (hg * HP) * stride_ah
        acc = tl.load(a_base + rel[:, None] + offs_d[None, :], mask=prev[:, None], other=0.0).to(tl.float32)
        l_rel = (offs_m // HP) * stride_lt + (offs_m % HP) * stride_lh
        l_base = acc_l_ptr + q0.to(tl.int64) * stride_lt + (hg * HP) * stride_lh
        m_i = tl.load(l_base + l_rel, mask=prev, other=float("-inf")) * 1.4426950408889634
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
    full_end = k0 + ((k_full - k0) // BLOCK_N) * BLOCK_N
    if ONELOOP:  # RingConfig.oneloop: the masked tiles in the same pipelined loop (no drain and refill between)
        use_pos = (tl.zeros([BLOCK_M], tl.int32) + causal) != 0
        qpos = tl.load(qpos_ptr + t_idx, mask=mask_m & use_pos, other=2147483647)
        m_i, l_i, acc = _one_loop(q, k_ptr, v_ptr, k_desc, v_desc, kpos_ptr, qpos, m_i, l_i, acc, qk_scale, k0,
                                  full_end, k_end, causal, kv_col, stride_kt, stride_vt, offs_d, BLOCK_M, BLOCK_N, TMA,
                                  IEEE)
    else:
        for start_n in range(k0, full_end, BLOCK_N):  # every score visible: no mask, no positions
            k = _load_kv(k_ptr, k_desc, start_n, None, kv_col, stride_kt, offs_d, BLOCK_N, TMA, False)
            v = _load_kv(v_ptr, v_desc, start_n, None, kv_col, stride_vt, offs_d, BLOCK_N, TMA, False)
            m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, None, False, IEEE)
        # The tiles that straddle some query's position (and the partial last tile). Query positions are loaded
        # only now, so they take no registers in the loop above; without `causal` no position is read.
        use_pos = (tl.zeros([BLOCK_M], tl.int32) + causal) != 0
        qpos = tl.load(qpos_ptr + t_idx, mask=mask_m & use_pos, other=2147483647)
        for start_n in range(full_end, k_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < k_end
            k = _load_kv(k_ptr, k_desc, start_n, mask_n, kv_col, stride_kt, offs_d, BLOCK_N, TMA, True)
            v = _load_kv(v_ptr, v_desc, start_n, mask_n, kv_col, stride_vt, offs_d, BLOCK_N, TMA, True)
            kpos = tl.load(kpos_ptr + offs_n, mask=mask_n & ((tl.zeros([BLOCK_N], tl.int32) + causal) != 0), other=0)
            visible = mask_n[None, :] & (qpos[:, None] >= kpos[None, :])
            m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, visible, True, IEEE)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if SPLIT:  # every row a piece: its partial, in this program's own M x D layout (contiguous), for _merge_kernel
        p_rows = (slot.to(tl.int64) * n_groups + (hg - hg0)) * BLOCK_M + offs_m
        tl.store(part_o_ptr + p_rows[:, None] * D + offs_d[None, :], out)
        tl.store(part_l_ptr + p_rows, lse)
    else:
        if PDL and not EARLY:  # the accumulators are the previous step's (see above)
            tl.extra.cuda.gdc_wait()
        _finish(out, lse, rows, head, mask_m, offs_d, acc_o_ptr, acc_l_ptr, out_ptr, load_prev, store_acc, store_out,
                stride_at, stride_ah, stride_lt, stride_lh, stride_ot, stride_oh, not EARLY)


@triton.jit(do_not_specialize=["load_prev", "store_acc", "store_out"])
def _merge_kernel(merge_ptr, part_o_ptr, part_l_ptr, acc_o_ptr, acc_l_ptr, out_ptr, n_groups, load_prev, store_acc,
                  store_out, stride_at, stride_ah, stride_lt, stride_lh, stride_ot, stride_oh,
                  HP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr):
    # One program per (query tile, head group), as the pieces' programs were laid out: the pieces' partials
    # merged by LSE (flash-decoding's reduction), then the step's usual epilogue (_finish). SUB rows at a time:
    # BLOCK_M x D fp32 at once (partial, sum, accumulator) would not fit in registers.
    pid = tl.program_id(0)
    hg = pid % n_groups
    row = merge_ptr + (pid // n_groups) * 4
    q0 = tl.load(row)
    q1 = tl.load(row + 1)
    slot0 = tl.load(row + 2)
    pieces = tl.load(row + 3)
    offs_d = tl.arange(0, D)
    for r0 in tl.static_range(0, BLOCK_M, SUB):
        offs_m = r0 + tl.arange(0, SUB)
        t_idx = q0 + offs_m // HP
        head = hg * HP + offs_m % HP
        mask_m = t_idx < q1
        rows = t_idx.to(tl.int64)
        base = (slot0.to(tl.int64) * n_groups + hg) * BLOCK_M + offs_m  # piece j's rows: base + j * n_groups * BLOCK_M
        step = n_groups * BLOCK_M
        m = tl.full([SUB], float("-inf"), tl.float32)
        for j in range(0, pieces):  # first the pieces' largest LSE, so the weights below need no rescaling
            m = tl.maximum(m, tl.load(part_l_ptr + base + j * step))
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row no piece saw: weights exp(-inf) = 0, no nan
        s = tl.zeros([SUB], tl.float32)
        acc = tl.zeros([SUB, D], tl.float32)
        for j in range(0, pieces):
            w = tl.exp(tl.load(part_l_ptr + base + j * step) - m_safe)
            acc += tl.load(part_o_ptr + (base + j * step)[:, None] * D + offs_d[None, :]) * w[:, None]
            s += w
        seen = s > 0
        out = acc / tl.where(seen, s, 1.0)[:, None]
        lse = tl.where(seen, m_safe + tl.log(tl.where(seen, s, 1.0)), float("-inf"))
        _finish(out, lse, rows, head, mask_m, offs_d, acc_o_ptr, acc_l_ptr, out_ptr, load_prev, store_acc, store_out,
                stride_at, stride_ah, stride_lt, stride_lh, stride_ot, stride_oh, True)


SCATTER_SOURCES = 4  # K/V blocks one `scatter_blocks` launch copies (a fused step's at SP=4: the other three ranks',
# and under RingConfig.trim0 the first rows of the rank's own block)
SCATTER_BLOCK = 1024  # 8-byte words per program


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "w0", "w1", "w2", "w3", "dst_kv", "kv0", "kv1", "kv2", "kv3"])
def _scatter_kernel(dst_ptr, src0, src1, src2, src3, idx0, idx1, idx2, idx3, n0, n1, n2, n3, w0, w1, w2, w3, dst_kv,
                    kv0, kv1, kv2, kv3, BLOCK: tl.constexpr):
    # Program (run i, source * 2 + K/V, slice): run i of that source's K or V (w contiguous 8-byte words: the
    # source's run length) to run idx[i] of the buffer's. Sources past the caller's count have n 0.
    i = tl.program_id(0)
    sk = tl.program_id(1)
    src_id = sk // 2
    kv = (sk % 2).to(tl.int64)
    if src_id == 0:
        src, idx, n, w, src_kv = src0, idx0, n0, w0, kv0
    elif src_id == 1:
        src, idx, n, w, src_kv = src1, idx1, n1, w1, kv1
    elif src_id == 2:
        src, idx, n, w, src_kv = src2, idx2, n2, w2, kv2
    else:
        src, idx, n, w, src_kv = src3, idx3, n3, w3, kv3
    if i < n:
        run = tl.load(idx + i).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < w
        words = tl.load(src + kv * src_kv + i.to(tl.int64) * w + offs, mask=mask)
        tl.store(dst_ptr + kv * dst_kv + run * w + offs, words, mask=mask)


def scatter_blocks(buf: torch.Tensor, blocks: list[torch.Tensor], runs: list[tuple[int, torch.Tensor]]) -> None:
    """buf [2, T, Hkv, D] := each block [2, Tk_j, Hkv, D] scattered by its runs (R_j rows per run, the destination
    run of each source run, in units of R_j rows; parallel/ring_attention.py `_runs`), in one launch per
    SCATTER_SOURCES blocks (a fused ring step's K/V at once, where a copy per block costs the host a launch each
    while the GPU waits for the fused launch). Every block and buf contiguous, of one dtype; each run a whole
    number of 8-byte words."""
    if not blocks:
        return
    row = buf.shape[2] * buf.shape[3] * buf.element_size()
    if any(run * row % 8 for run, _ in runs) or not buf.is_contiguous() or \
            any(not b.is_contiguous() or b.dtype != buf.dtype for b in blocks):
        raise ValueError("scatter_blocks: contiguous blocks of buf's dtype, runs of whole 8-byte words")
    dst = buf.view(torch.int64)
    for lo in range(0, len(blocks), SCATTER_SOURCES):
        part = [(b.view(torch.int64), idx, run * row // 8)
                for b, (run, idx) in zip(blocks[lo:lo + SCATTER_SOURCES], runs[lo:lo + SCATTER_SOURCES])]
        counts = [idx.numel() if b.shape[1] else 0 for b, idx, _ in part]
        if not any(counts):
            continue
        while len(part) < SCATTER_SOURCES:  # unused sources: no runs
            part.append(part[0])
            counts.append(0)
        words = [w for _, _, w in part]
        grid = (max(counts), 2 * SCATTER_SOURCES, triton.cdiv(max(words), SCATTER_BLOCK))
        args = (dst, *(b for b, _, _ in part), *(idx for _, idx, _ in part), *counts, *words, dst.stride(0),
                *(b.stride(0) for b, _, _ in part))
        _SCATTER_HANDLES.launch(_scatter_key(args), lambda: _scatter_kernel[grid](*args, BLOCK=SCATTER_BLOCK), grid,
                                args, (SCATTER_BLOCK,))


# `scatter_blocks`' launches after the first of a specialisation go through the compiled kernel (as the ring's steps,
# `direct_launch_ok`): a fused or hybrid ring issues it between two attention launches, while the GPU runs the first.
_SCATTER_HANDLES = Handles()
_SCATTER_KERNELS: dict = {}  # `ScatterLaunch`'s compiled kernels by `_scatter_key`


class ScatterLaunch:
    """`scatter_blocks` into one buffer with fixed runs and block sizes, planned once (a ring plan keeps it beside its
    kept fused buffer): a call makes the blocks' 8-byte word views and launches (through the compiled kernel after the
    first launch of a specialisation, a runner per launch for its fixed grid), where scatter_blocks works out the
    groups, counts, words, strides and grid and checks the runs every time. On a loaded host that work sat between a
    fused ring's first launch and its fused launch (16K tokens at SP=4 on an H100: 143 us of host time against the first
    launch's 320 us of GPU time). tokens[j]: block j's rows (a block of none takes no part, as in `_scatter_all`); its
    runs may read its first rows only (RingConfig.trim0: the first rows of the rank's own block).
    Calling it with blocks of other sizes, dtype or layout launches nothing and returns False."""

    def __init__(self, buf: torch.Tensor, runs: list[tuple[int, torch.Tensor]], tokens: list[int]):
        row = buf.shape[2] * buf.shape[3] * buf.element_size()
        if not buf.is_contiguous() or any(run * row % 8 for run, _ in runs) or len(runs) != len(tokens):
            raise ValueError("ScatterLaunch: a contiguous buffer, runs of whole 8-byte words, one per block")
        self.dst, self.tokens, self.dtype = buf.view(torch.int64), list(tokens), buf.dtype
        self.direct = direct_launch_ok(buf.device)
        used = [j for j, t in enumerate(tokens) if t]
        self.groups = []  # per launch: (blocks it reads, index tensors, integer arguments, grid, runners by alignment)
        for lo in range(0, len(used), SCATTER_SOURCES):
            sel = used[lo:lo + SCATTER_SOURCES]
            counts = [runs[j][1].numel() for j in sel]
            words = [runs[j][0] * row // 8 for j in sel]
            src_kv = [tokens[j] * row // 8 for j in sel]  # a contiguous block's K-to-V stride in words
            while len(sel) < SCATTER_SOURCES:  # unused sources: no runs (the first one's pointers)
                sel, counts, words, src_kv = sel + sel[:1], counts + [0], words + words[:1], src_kv + src_kv[:1]
            grid = (max(counts), 2 * SCATTER_SOURCES, triton.cdiv(max(words), SCATTER_BLOCK))
            self.groups.append((sel, tuple(runs[j][1] for j in sel), (*counts, *words, self.dst.stride(0), *src_kv),
                                grid, {}))

    def __call__(self, blocks: list[torch.Tensor]) -> bool:
        if len(blocks) != len(self.tokens) or any(b.shape[1] != t or b.dtype != self.dtype or not b.is_contiguous()
                                                  for b, t in zip(blocks, self.tokens)):
            return False
        for sel, idxs, ints, grid, runners in self.groups:
            args = (self.dst, *(blocks[j].view(torch.int64) for j in sel), *idxs, *ints)
            if not self.direct:
                _scatter_kernel[grid](*args, BLOCK=SCATTER_BLOCK)
                continue
            dyn = tuple(a.data_ptr() % 16 == 0 for a in args[1:1 + SCATTER_SOURCES])
            runner = runners.get(dyn)
            if runner is None:
                key = _scatter_key(args)
                kernel = _SCATTER_KERNELS.get(key)
                if kernel is None:
                    kernel = _scatter_kernel[grid](*args, BLOCK=SCATTER_BLOCK)
                    if hasattr(kernel, "run") and hasattr(kernel, "__getitem__"):
                        if len(_SCATTER_KERNELS) >= MAX_HANDLES:
                            _SCATTER_KERNELS.clear()
                        _SCATTER_KERNELS[key] = kernel
                    continue
                runner = runners[dyn] = _Runner(kernel, grid)
            runner(args, (SCATTER_BLOCK,))
        return True


def _scatter_key(args: tuple) -> tuple | None:
    """What Triton specialises `_scatter_kernel` on: the device, the pointers' (buffer, sources, indices) dtypes and
    16-byte alignment, and the integers' types (none is specialised on its value: do_not_specialize); None where
    handles are off."""
    n_ptr = 1 + 2 * SCATTER_SOURCES
    ptrs = args[:n_ptr]
    if not direct_launch_ok(ptrs[0].device):
        return None
    return (ptrs[0].device.index, tuple(t.dtype for t in ptrs), tuple(t.data_ptr() % 16 == 0 for t in ptrs),
            tuple(int_kind(v) for v in args[n_ptr:]))


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: one float dtype, head dim a power of two in [16, 256],
    Hq a multiple of Hkv, unit stride along D and the KV heads packed (k/v rows [Hkv * D])."""
    d = q.shape[-1]
    return (q.dtype in DTYPES and k.dtype == v.dtype == q.dtype and 16 <= d <= 256 and d & (d - 1) == 0
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and q.stride(2) == 1
            and all(x.stride(2) == 1 and x.stride(1) == d for x in (k, v)))


def supported_block(q: torch.Tensor, block: torch.Tensor) -> bool:
    """`supported(q, block[0], block[1])` for a K/V block [2, Tk, Hkv, D] without making the two views (a ring checks
    its inputs on every call, on the way to its first launch)."""
    if block.dim() != 4 or block.shape[0] != 2:
        return False
    d = q.shape[-1]
    _, _, s_h, s_d = block.stride()
    return (q.dtype in DTYPES and block.dtype == q.dtype and 16 <= d <= 256 and d & (d - 1) == 0
            and block.shape[3] == d and block.shape[2] > 0 and q.shape[1] % block.shape[2] == 0 and q.stride(2) == 1
            and s_d == 1 and s_h == d)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def tma_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K/V can be read by TMA: Hopper or newer and 16-byte aligned bases and row strides."""
    if _TensorDescriptor is None or not k.is_cuda or _capability(k.device)[0] < 9:
        return False
    return all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in (k, v))


def tma_ok_block(block: torch.Tensor) -> bool:
    """`tma_ok(block[0], block[1])` for a K/V block [2, Tk, Hkv, D] without making the two views where it is
    contiguous (a ring checks every block it attends): K's and V's row strides are then Hkv * D values and V starts
    Tk rows after K, so one alignment check of the base and of a row covers both."""
    if not block.is_contiguous() or block.dim() != 4:
        return tma_ok(block[0], block[1])
    if _TensorDescriptor is None or not block.is_cuda or _capability(block.device)[0] < 9:
        return False
    return block.data_ptr() % 16 == 0 and block.shape[2] * block.shape[3] * block.element_size() % 16 == 0


def pdl_ok(device: torch.device) -> bool:
    """Whether programmatic dependent launch can be used: a Hopper-or-newer CUDA device and a Triton that has
    `gdc_wait` (never under the interpreter)."""
    device = torch.device(device)
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and _capability(device)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))


def rows_per_tile(config: RingConfig, num_q_heads: int, num_kv_heads: int) -> int:
    """Query rows (tokens) per tile-table row under `config`: BLOCK_M, or BLOCK_M / G when packing GQA."""
    return config.block_m // config.heads_per_program(num_q_heads // num_kv_heads)


def build_tiles(q_pos: list[np.ndarray], k_pos: list[np.ndarray], q_offsets: list[int], k_offsets: list[int],
                block_q: int, cover: bool = False) -> np.ndarray:
    """The tile table of one ring step for a ragged batch, on the host: int32 [n, TILE_FIELDS].

    Sequence b's queries are rows [q_offsets[b], + len(q_pos[b])) at positions q_pos[b] (ascending), its keys
    rows [k_offsets[b], + len(k_pos[b])) at k_pos[b]. Per query tile of `block_q` rows (from the first query
    that sees any key): q0, q1, k0, k_full, k_end (absolute rows, see the module docstring) and causal (0 where
    every key up to k_end is seen by every query of the tile), slot -1 (not split: `split_tiles` splits).
    `cover`: also rows for the queries that see none of these keys (k_end = k0), so a launch that writes the
    accumulators or the output reaches every row. Sorted by keys per tile, most first."""
    parts = []
    for qp, kp, qo, ko in zip(q_pos, k_pos, q_offsets, k_offsets):
        nq = len(qp)
        k_hi = int(np.searchsorted(kp, qp[-1], side="right")) if nq and len(kp) else 0
        q_lo = int(np.searchsorted(qp, kp[0], side="left")) if k_hi else nq  # earlier queries see no key
        if cover and q_lo:
            s = np.arange(0, q_lo, block_q)
            empty = np.stack([s, np.minimum(s + block_q, q_lo), *([np.zeros_like(s)] * 4)], 1)
            parts.append(np.concatenate([empty + [qo, qo, ko, ko, ko, 0], np.full_like(s, -1)[:, None]], 1))
        if q_lo < nq:
            s = np.arange(q_lo, nq, block_q)
            e = np.minimum(s + block_q, nq)
            kf = np.searchsorted(kp[:k_hi], qp[s], side="right")
            ke = np.searchsorted(kp[:k_hi], qp[e - 1], side="right")
            causal = (kf < ke).astype(s.dtype)
            no_slot = np.full_like(s, -1)
            parts.append(np.stack([s + qo, e + qo, np.full_like(s, ko), kf + ko, ke + ko, causal, no_slot], 1))
    if not parts:
        return np.zeros((0, TILE_FIELDS), dtype=np.int32)
    tiles = np.concatenate(parts).astype(np.int32)
    return tiles[np.argsort(tiles[:, 2] - tiles[:, 4], kind="stable")]


def _device_tiles(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, tq: int, tk: int, block_q: int,
                  device: torch.device) -> torch.Tensor:
    """The tile table of one sequence (rows [0, Tq), keys [0, Tk)) built on the device from device positions
    (no host round trip): tiles last-first, which is most keys first for ascending positions."""
    s = torch.arange(0, tq, block_q, device=device)
    e = torch.clamp(s + block_q, max=tq)
    if q_pos is None:
        kf = ke = torch.full_like(s, tk)
    else:
        kf = torch.searchsorted(k_pos, q_pos[s], right=True)
        ke = torch.searchsorted(k_pos, q_pos[e - 1], right=True)
    table = torch.stack([s, e, torch.zeros_like(s), kf, ke, (kf < ke).to(s.dtype), torch.full_like(s, -1)], 1)
    return table.flip(0).to(torch.int32).contiguous()


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, what the split rule fills; 1 elsewhere (the interpreter)."""
    if torch.device(device).type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_counts(tiles: np.ndarray, block_n: int, n_groups: int, sms: int, splits: int = 0) -> np.ndarray:
    """Pieces per tile-table row (int64 [n]): how many programs share its key range.

    `splits` >= 1: min(splits, the row's key tiles) for every row (1: no split). 0 (auto): a step's programs
    hold sum(key tiles) * n_groups key tiles of work, about that over `sms` per SM. A program longer than
    cap = max(SPLIT_MIN_TILES, that share / SPLIT_TAIL) key tiles is cut into the fewest pieces no longer
    than cap (at most MAX_SPLITS), except in a grid of SPLIT_WAVES waves or more whose longest program holds at
    most a share (heaviest first, it ends before the rest: nothing splits). A large grid (e.g. 16K tokens at SP=4
    with Llama-8B heads: 1,024 programs of <= 32 key tiles, ~128 per SM) is never split; a small one (few query tiles,
    long key ranges: short prompts against long context, few heads) is, so the grid fills the GPU and its
    longest program no longer outlasts the rest."""
    key_tiles = -(-(tiles[:, 4].astype(np.int64) - tiles[:, 2]) // block_n)
    if splits >= 1:
        return np.clip(np.minimum(key_tiles, splits), 1, None)
    share = key_tiles.sum() * n_groups / max(sms, 1)
    if len(key_tiles) * n_groups >= SPLIT_WAVES * max(sms, 1) and len(key_tiles) and key_tiles.max() <= share:
        return np.ones(len(key_tiles), dtype=np.int64)
    cap = max(SPLIT_MIN_TILES, int(np.ceil(share / SPLIT_TAIL)))
    return np.clip(-(-key_tiles // cap), 1, MAX_SPLITS)


def split_tiles(tiles: np.ndarray, counts: np.ndarray, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Split-K: row i of a `build_tiles` table cut into counts[i] pieces along its keys, at BLOCK_N boundaries
    from k0, each piece with its own k_full / k_end / causal and slot (consecutive per row). Returns the new
    tile table (heaviest first) and the merge table int32 [n, MERGE_FIELDS] (q0, q1, first slot, pieces) for
    `_merge_kernel`. Once any row splits, every row is written as pieces (a row of one piece too), so the
    split kernel's epilogue is one plain store (it compiles without spills, where a branch to the in-place
    merge did not); no row splits: the table as it was and an empty merge table."""
    if not (counts > 1).any():
        return tiles, np.zeros((0, MERGE_FIELDS), dtype=np.int32)
    rows = tiles.astype(np.int64)
    c = np.maximum(counts, 1).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(c)[:-1]])
    owner = np.repeat(np.arange(len(rows)), c)  # the row of each piece
    j = np.arange(c.sum()) - first[owner]  # the piece's index within its row
    r = rows[owner]
    n_tiles = -(-(r[:, 4] - r[:, 2]) // block_n)
    lo = np.minimum(r[:, 2] + (j * n_tiles // c[owner]) * block_n, r[:, 4])
    hi = np.minimum(r[:, 2] + ((j + 1) * n_tiles // c[owner]) * block_n, r[:, 4])
    kf = np.clip(r[:, 3], lo, hi)  # every query of the tile sees the piece's keys up to its own k_full
    table = np.stack([r[:, 0], r[:, 1], lo, kf, hi, (r[:, 5] != 0) & (kf < hi), first[owner] + j], 1)
    table = table[np.argsort(table[:, 2] - table[:, 4], kind="stable")].astype(np.int32)
    merge = np.stack([rows[:, 0], rows[:, 1], first, c], 1).astype(np.int32)
    return table, merge


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None,
           k_pos: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"want q [Tq, Hq, D], k and v [Tk, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not supported(q, k, v):
        raise ValueError(f"chunk_attention needs fp16/bf16/fp32 q, k, v of one dtype, D a power of two in [16, 256], "
                         f"Hq a multiple of Hkv and packed heads; got {q.dtype}/{k.dtype}/{v.dtype}, "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos go together: both position tensors (causal) or both None")
    if q_pos is not None and (q_pos.shape != (q.shape[0],) or k_pos.shape != (k.shape[0],)):
        raise ValueError(f"q_pos must be [Tq] and k_pos [Tk]; got {tuple(q_pos.shape)}, {tuple(k_pos.shape)}")


def as_config(tiles: RingConfig | tuple | None, tq: int, q: torch.Tensor, tma: bool) -> RingConfig:
    """`tiles` as a RingConfig: given one, a (BLOCK_M, BLOCK_N, warps, stages[, pack]) tuple, or None (default)."""
    if isinstance(tiles, RingConfig):
        return tiles
    if tiles is not None:
        return RingConfig(*tiles[:4], bool(tiles[4]) if len(tiles) > 4 else False)
    return default_config(tq, q.shape[-1], q.element_size(), tma)


def partial_buffers(slots: int, n_groups: int, config: RingConfig, head_dim: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for `slots` split pieces of one step: out [slots * n_groups * BLOCK_M, D] and lse fp32, each piece's
    program writing its BLOCK_M x D partial contiguously (reused by every step: a step's merge ends before the
    next step's pieces start, on one stream)."""
    n = max(slots, 1) * n_groups * config.block_m
    return (torch.empty((n, head_dim), dtype=torch.float32, device=device),
            torch.empty((n,), dtype=torch.float32, device=device))


def ring_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: torch.Tensor,
              q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, config: RingConfig,
              acc: tuple[torch.Tensor, torch.Tensor] | None, load_prev: bool, store_acc: bool,
              out: torch.Tensor | None = None, tma: bool | None = None, merge: torch.Tensor | None = None,
              partials: tuple[torch.Tensor, torch.Tensor] | None = None, chained: bool = True) -> None:
    """One launch over a tile table (`build_tiles` with `rows_per_tile(config, ...)` rows per tile, on q's device),
    and with split-K (`split_tiles`) a second over its merge table: `StepLaunch` made and run once.

    q [Tq, Hq, D]; k/v [Tk, Hkv, D] (rows as the table's k0.. k_end); q_pos [Tq] / k_pos [Tk] int32 positions on
    the device (None: no row of the table is causal). acc (out [Tq, Hq, D] fp32 or any float dtype, lse [Tq, Hq]
    fp32): merged with this step's partial when `load_prev`, written with the result when `store_acc`. out
    [Tq, Hq, D]: written with the result when given (a last step). A step that writes without loading, or
    writes `out`, must have a table that covers every row (`build_tiles(..., cover=True)`). merge: the merge
    table of a split table (None or empty: no row split), partials: `partial_buffers` with room for its slots.
    chained: the kernel before this one on the stream is the ring's previous step (under RingConfig.pdl this step
    may then start in its tail: it reads nothing that kernel writes before `gdc_wait`); False after other work
    (the fused step's scatters), which a programmatic launch could read before it is visible."""
    _check(q, k, v, q_pos, k_pos)
    use_tma = k.shape[0] > 0 and (tma_ok(k, v) if tma is None else tma)
    StepLaunch(q, k.shape[0], k.shape[1], scale, tiles, q_pos, k_pos, config, acc, load_prev, store_acc, out, use_tma,
               merge, partials, chained)(k, v)


# The ring kernel's constexpr parameters in signature order (upper-case names), after its runtime ones.
_CONSTEXPRS = ("GQA", "HP", "D", "BLOCK_M", "BLOCK_N", "TMA", "IEEE", "SPLIT", "EARLY", "PDL", "ONELOOP", "HBAND")
DIRECT_ENV = "TANDEM_RING_DIRECT"  # "0": every launch through Triton's JIT path; else repeats through the handle
_HANDLES: dict = {}  # the compiled kernels (`CompiledKernel`) by everything Triton specialises a launch on, or more
MAX_HANDLES = 4096


def direct_launch_ok(device: torch.device) -> bool:
    """Whether a ring launch may reuse the compiled kernel's handle: on CUDA, not under the interpreter, unless
    TANDEM_RING_DIRECT=0. On by default: on an H100 (2026-11-27) rings launched through handles were bitwise the JIT
    path's (tests/gpu/test_ring_attention_triton.py, bench_ring_launch.py's handle_exact) and the launch cost the host
    47 us against 65 us (16K tokens, SP=2)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get(DIRECT_ENV) != "0"


class _Runner:
    """A compiled ring kernel's launcher for one grid (`CompiledKernel[grid]`, made once: it reads the current stream
    at each call, so nothing in it goes stale), and the argument form its Triton wants: the kernel's arguments in
    signature order with the constexprs, or only the runtime ones (found at the first call: a wrong count is a
    TypeError before anything launches)."""

    __slots__ = ("run", "with_constexprs")

    def __init__(self, kernel, grid: tuple[int, ...]):
        self.run = kernel[(*grid, *(1,) * (3 - len(grid)))]  # the runner reads grid[0], grid[1] and grid[2]
        self.with_constexprs: bool | None = None

    def __call__(self, args: tuple, const: tuple) -> None:
        if self.with_constexprs is None:
            try:
                self.run(*args, *const)
                self.with_constexprs = True
            except TypeError:
                self.run(*args)
                self.with_constexprs = False
        elif self.with_constexprs:
            self.run(*args, *const)
        else:
            self.run(*args)


@functools.lru_cache(maxsize=None)
def _stand_in(device: torch.device) -> torch.Tensor:
    """A one-value fp32 tensor for pointer arguments a launch never reads nor writes (the split scratch of an unsplit
    step, the accumulators of a ring of one): a plan kept across calls then holds no call's tensors."""
    return torch.empty(1, 1, 1, dtype=torch.float32, device=device)


class StepLaunch:
    """One ring step's launch(es) with everything worked out once but its tensors: the kernel's arguments, constexprs,
    grid and launch options, from what `ring_step` takes (its docstring): `tk` keys of `hkv` heads, and `tma`
    (whether K/V are read by TMA; the caller checked `tma_ok`). `run(k, v, q, acc, out)` launches over k/v [tk, Hkv, D]
    (rows of Hkv * D packed values, as `supported` wants) with this call's queries, accumulators and output, which
    must have the shapes, strides and dtypes of those it was planned with (`_RingSteps` keeps its launches in the
    ring's cached plan, `release`d, and allocates the accumulators and output the same way at every call);
    calling it with k/v alone runs with those it was planned with. On CUDA a launch after the first with the same
    specialisation goes through the compiled kernel (`_Runner`, `direct_launch_ok`): what a planned step then costs
    the host is the K/V descriptors and Triton's launcher."""

    def __init__(self, q: torch.Tensor, tk: int, hkv: int, scale: float, tiles: torch.Tensor,
                 q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, config: RingConfig,
                 acc: tuple[torch.Tensor, torch.Tensor] | None, load_prev: bool, store_acc: bool,
                 out: torch.Tensor | None, tma: bool, merge: torch.Tensor | None,
                 partials: tuple[torch.Tensor, torch.Tensor] | None, chained: bool,
                 groups: tuple[int, int] | None = None):
        tq, hq, d = q.shape
        self.tk, self.hkv, self.d, self.block_n, self.dtype = tk, hkv, d, config.block_n, q.dtype
        self.q, self.acc, self.out = q, acc, out
        self.empty = tq == 0 or tiles.shape[0] == 0
        if self.empty:
            return
        if (load_prev or store_acc) and acc is None:
            raise ValueError("ring_step: loading or storing accumulators needs them")
        split = merge is not None and merge.shape[0] > 0
        if split and partials is None:
            raise ValueError("ring_step: a split table needs partial buffers (partial_buffers)")
        self.tma = tk > 0 and tma
        hp = config.heads_per_program(hq // hkv)
        self.no_keys = q.new_empty((1, hkv, d)) if tk == 0 else None  # no tile loads any, but pointers of q's dtype
        stand = _stand_in(q.device)
        # Never read nor written without accumulators: fp32 stand-ins, so the kernel compiled for the ring serves too.
        self.stand_acc = (stand, stand.view(1, 1))
        acc_o, acc_l = acc if acc is not None else self.stand_acc
        self.writes_out = out is not None
        fin = out if out is not None else acc_o
        part_o, part_l = partials if split else (stand.view(1, 1), stand.view(1))  # never written without a split
        q_pos = tiles if q_pos is None else q_pos  # int32 stand-ins, never read
        k_pos = tiles if k_pos is None else k_pos
        n_groups = hq // hp
        hg0 = 0
        if groups is not None:  # only head groups [hg0, hg0 + count) of the n_groups (RingConfig.hybrid), never split
            hg0, n_groups = groups
            if split:
                raise ValueError("ring_step: a launch over some head groups cannot be split")
        flags = (int(load_prev), int(store_acc), int(out is not None))
        strides = (acc_o.stride(0), acc_o.stride(1), acc_l.stride(0), acc_l.stride(1), fin.stride(0), fin.stride(1))
        self._plan_launch(q, config, split, load_prev, chained, hp, d, hq, hkv)
        # RingConfig.hband where it divides this launch's groups (and leaves more than one band)
        self.kw["HBAND"] = config.hband if 0 < config.hband < n_groups and n_groups % config.hband == 0 else 0
        # The arguments around q, K/V's five (k, v, their descriptors; k/v's row strides after `post`) and the
        # accumulators and output: `args`.
        self.pre = (q_pos, k_pos, tiles)
        self.post = (part_o, part_l, scale * _LOG2E, n_groups, hg0, *flags, q.stride(0), q.stride(1))
        self.tail = strides
        self.grid = (n_groups * tiles.shape[0],)
        self.const = tuple(self.kw[name] for name in _CONSTEXPRS)
        # The compiled kernel's handle (`_HANDLES`), keyed by every value Triton specialises on (or more): dtypes,
        # the integer arguments themselves, pointer alignments, the constexprs and launch options; q's and K/V's
        # alignment and K/V's row strides at each launch (`run`). The accumulators' and output's alignment is the
        # planned one's: `run` takes them from the caller that planned it (`_RingSteps`: torch.empty's, always
        # 16-byte aligned), while q and K/V may be any views.
        self.static_key = None
        self._runners: dict = {}
        if direct_launch_ok(q.device):
            tensors = (*self.pre, acc_o, acc_l, fin, part_o, part_l)
            self.static_key = (q.device.index, tuple(self.kw.items()), q.dtype, tuple(t.dtype for t in tensors),
                               tuple(t.data_ptr() % 16 == 0 for t in tensors), self.post[2:], self.tail, tk, hkv, d)
        self.merge = merge if split else None
        if split:  # the split rows' pieces, merged and finished as an unsplit row would have been
            self.merge_grid = (n_groups * merge.shape[0],)
            self.merge_parts = (merge, part_o, part_l)
            self.merge_post = (n_groups, *flags, *strides)
            self.merge_kw = dict(HP=hp, D=d, BLOCK_M=config.block_m, SUB=min(config.block_m, max(16, 4096 // d)),
                                 num_warps=8)

    def _plan_launch(self, q: torch.Tensor, config: RingConfig, split: bool, load_prev: bool, chained: bool, hp: int,
                     d: int, hq: int, hkv: int) -> None:
        """The constexprs and launch options (`kw`)."""
        # PDL: one compile for every step of the ring (a launch without it makes the kernel's PDL calls no-ops);
        # only a step that merges (load_prev: its predecessor is this ring's own step) launches programmatically,
        # never a split one (its pieces reuse the scratch its predecessor's merge read).
        pdl = config.pdl and not split and pdl_ok(q.device)
        self.kw = dict(GQA=hq // hkv, HP=hp, D=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n, TMA=self.tma,
                       IEEE=q.dtype == torch.float32, SPLIT=split, EARLY=config.early, PDL=pdl, ONELOOP=config.oneloop,
                       num_warps=config.num_warps, num_stages=config.num_stages)
        if pdl and load_prev and chained:
            self.kw["launch_pdl"] = True

    def release(self) -> "StepLaunch":
        """Forget the tensors it was planned with (kept in a cache across calls, it must not hold a call's memory);
        `run` still takes a call's own."""
        self.q = self.acc = self.out = None
        return self

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.empty and self.q is None:
            raise ValueError("a released StepLaunch runs with a call's tensors: run(k, v, q, acc, out)")
        self.run(k, v, self.q, self.acc, self.out)

    def args(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
             acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor | None) -> tuple:
        """The kernel's runtime arguments in signature order for this call's tensors (k/v already checked)."""
        acc_o, acc_l = acc if acc is not None else self.stand_acc
        k_desc = v_desc = None
        ks, vs = k.stride(0), v.stride(0)
        if self.tma:  # 2-D views [Tk, Hkv * D] with their row strides: one box is one head's BLOCK_N rows
            k_desc = _TensorDescriptor(k, [self.tk, self.hkv * self.d], [ks, 1], [self.block_n, self.d])
            v_desc = _TensorDescriptor(v, [self.tk, self.hkv * self.d], [vs, 1], [self.block_n, self.d])
        return (q, k, v, k_desc, v_desc, *self.pre, acc_o, acc_l, out if self.writes_out else acc_o, *self.post,
                ks, vs, *self.tail)

    def run(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, acc: tuple[torch.Tensor, torch.Tensor] | None,
            out: torch.Tensor | None, checked: bool = False) -> None:
        """Launch over k/v with this call's q, accumulators and output (see the class docstring). checked: the caller
        vouches for k/v's shape, dtype and head strides (the ring's own block, whose layout its cached plan is keyed
        by and checked against, or the plan's own buffer): their checks are skipped on the way to the first launch."""
        if self.empty:
            return
        if not checked and (k.shape != (self.tk, self.hkv, self.d) or v.shape != k.shape or k.dtype != self.dtype
                            or v.dtype != k.dtype or k.stride()[1:] != (self.d, 1) or v.stride()[1:] != (self.d, 1)):
            raise ValueError(f"this step was planned for k/v [{self.tk}, {self.hkv}, {self.d}] {self.dtype} with "
                             f"packed heads, got {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
        if self.no_keys is not None:
            k = v = self.no_keys
        args = self.args(k, v, q, acc, out)
        if self.static_key is None:
            _ring_kernel[self.grid](*args, **self.kw)
        else:
            self._direct(args)
        if self.merge is not None:
            acc_o, acc_l = acc if acc is not None else self.stand_acc
            _merge_kernel[self.merge_grid](*self.merge_parts, acc_o, acc_l, out if self.writes_out else acc_o,
                                           *self.merge_post, **self.merge_kw)

    def _direct(self, args: tuple) -> None:
        """The launch through the compiled kernel kept for this specialisation, else through the JIT (keeping it)."""
        q, k, v = args[0], args[1], args[2]
        # args[-8] and args[-7]: K's and V's row strides (before `tail`'s six)
        dyn = (q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, args[-8], args[-7])
        runner = self._runners.get(dyn)
        if runner is None:
            key = (self.static_key, dyn)
            kernel = _HANDLES.get(key)
            if kernel is None:
                kernel = _ring_kernel[self.grid](*args, **self.kw)
                if hasattr(kernel, "run") and hasattr(kernel, "__getitem__"):
                    if len(_HANDLES) >= MAX_HANDLES:  # keys follow the shapes (a server sees many prompt lengths)
                        _HANDLES.clear()
                    _HANDLES[key] = kernel
                return
            runner = self._runners[dyn] = _Runner(kernel, self.grid)
        runner(args, self.const)


def _launch(q, k, v, scale, q_pos, k_pos, out, lse, merge: bool, tiles, tma) -> None:
    """chunk_attention(_merge_): one sequence, its tile table built on the device; a config of split=N >= 2 splits
    it on the host (a copy back, which waits for the device: tests and tools, not the ring's path)."""
    _check(q, k, v, q_pos, k_pos)
    tq, hq, d = q.shape
    tk = k.shape[0]
    if tq == 0:
        return
    if tk == 0:  # no keys: nothing seen (answered here, no launch)
        if not merge:
            out.zero_()
            lse.fill_(float("-inf"))
        return
    use_tma = tk > 0 and (tma_ok(k, v) if tma is None else tma)
    config = as_config(tiles, tq, q, use_tma)
    if q_pos is not None:
        q_pos, k_pos = q_pos.to(q.device, torch.int32), k_pos.to(q.device, torch.int32)
    table = _device_tiles(q_pos, k_pos, tq, tk, rows_per_tile(config, hq, k.shape[1]), q.device)
    merge_table = partials = None
    if config.splits >= 2:
        host, merge_np = split_tiles(table.cpu().numpy(), split_counts(table.cpu().numpy(), config.block_n, 1, 1,
                                                                       config.splits), config.block_n)
        table, merge_table = torch.from_numpy(host).to(q.device), torch.from_numpy(merge_np).to(q.device)
        slots = int((merge_np[:, 2] + merge_np[:, 3]).max()) if len(merge_np) else 0
        partials = partial_buffers(slots, hq // config.heads_per_program(hq // k.shape[1]), config, d, q.device)
    ring_step(q, k, v, scale, table, q_pos, k_pos, config, (out, lse), merge, True, tma=use_tma, merge=merge_table,
              partials=partials, chained=False)  # after whatever the caller ran: never a programmatic launch


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32, tiles: RingConfig | tuple | None = None,
                    tma: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Tq, Hq, D] over k/v [Tk, Hkv, D] -> out [Tq, Hq, D] (out_dtype), lse [Tq, Hq] fp32.

    q_pos [Tq], k_pos [Tk]: ascending absolute positions (causal by position), or both None (no mask).
    tiles: a RingConfig or (BLOCK_M, BLOCK_N, num_warps, num_stages[, pack]), default `default_config`;
    tma: force TMA loads of K/V on or off (default: on where Hopper and alignment allow)."""
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    _launch(q, k, v, scale, q_pos, k_pos, out, lse, False, tiles, tma)
    return out, lse


def chunk_attention_merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None,
                           k_pos: torch.Tensor | None = None, tiles: RingConfig | tuple | None = None,
                           tma: bool | None = None) -> None:
    """acc := merge(acc, attention of q over k/v), in place and exact; acc_out [Tq, Hq, D] fp32 and
    acc_lse [Tq, Hq] fp32 (lse -inf: nothing seen yet). Arguments otherwise as `chunk_attention`."""
    if acc_out.shape != q.shape or acc_lse.shape != q.shape[:2] or acc_out.dtype != torch.float32 \
            or acc_lse.dtype != torch.float32 or acc_out.stride(2) != 1:
        raise ValueError(f"accumulators must be fp32 out {tuple(q.shape)} (unit stride on D) and lse "
                         f"{tuple(q.shape[:2])}; got {acc_out.dtype} {tuple(acc_out.shape)}, "
                         f"{acc_lse.dtype} {tuple(acc_lse.shape)}")
    _launch(q, k, v, scale, q_pos, k_pos, acc_out, acc_lse, True, tiles, tma)
