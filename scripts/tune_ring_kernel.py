#!/usr/bin/env python3
"""Launch-config sweep of the ring-attention step kernel (parallel/kernels/ring_attention_triton.py), per SP rank.

For each prompt length, SP=1 attention over the whole prompt is timed with the engine's prefill kernel (the
baseline of scripts/bench_sp_rank.py; flash SDPA beside it is the reference of the error). Then, for each SP
size and each candidate config (`RingConfig`: BLOCK_M, BLOCK_N, num_warps, num_stages, and GQA packing), every
rank's whole ring is run on this one device (`ring_rank_attention`, the SP path's block-owned layout, no
communication): the slowest rank's median time over SP=1's is the ratio against issue 25's goals (<= 0.55x
at SP=2, <= 0.3x at SP=4), and each rank's rows are checked against SDPA (max abs error, bf16 tolerance
2e-2). SP=1 is timed again after a length's configs (`sp1_after_s`): if it moved, so did the clocks.

    python scripts/tune_ring_kernel.py                                    # 16K/64K/128K, SP 2 and 4, CANDIDATES
    python scripts/tune_ring_kernel.py --configs "128,128,8,3;128,64,8,3,pack" --lengths 16384
    python scripts/tune_ring_kernel.py --configs "128,128,8,3,pack" --splits 1,2,4,auto   # split-K counts
    python scripts/tune_ring_kernel.py --configs "default;128,128,8,3,pack,oneloop"      # the kernel's own choice
    python scripts/tune_ring_kernel.py --device cpu --dry-run             # tiny shapes, Triton's interpreter, seconds

Prints a table per (length, SP, config): the slowest rank's ms, the ratio, the error, each ring step's GPU
ms (CUDA events around that rank's launches, a split step's merge launch included, queued behind a spin kernel so
the host has issued them all first: the kernels' own time), its tile-table rows per step ('*': split-K, rows are
pieces), the host ms to issue them and the host ms of the set-up and of each step's call (if the whole is near the
total, the launches, not the kernel, bound it); per SP size also the prefill kernel over the prompt's first 1/sp
(one ring step's shape) times sp: the SP=1 kernel's own cost for sp short launches; --sp 1 times the ring kernel
itself over the whole prompt (one launch) beside the prefill kernel; then every config ranked by its worst
ratio / goal over all cells (< 1: every goal met); a config named "default" is the kernel's own choice. The
first config there is the one to put in `CONFIGS` of the kernel module; a config can also be tried without
editing anything through
TANDEM_RING_KERNEL="BLOCK_M,BLOCK_N,warps,stages[,pack][,split=N][,acc16]" (acc16: the running output between
steps in bf16, half the merges' traffic; the error column shows what it costs).
--splits crosses every config with split-K counts (1: never split; N: up to N pieces per query tile; auto: the
kernel's rule from the step's work per SM, what runs by default). --flags crosses every config with sets of
RingConfig flags ("none,early,pdl,early+pdl,fuse": early starts each merging step from the accumulators, pdl
chains the steps by programmatic dependent launch, fuse runs the steps after the first as one launch over the
other ranks' blocks scattered into position order; with fuse the middle step columns are those scatters alone,
the last one its scatter and the fused launch, and the tile rows are per launch; gather, SP >= 2: the own block
scattered too, one launch after every block arrived: a diagnostic of longer programs, its time omits that wait).
The "streamed" column is the slowest rank's GPU time per run with runs issued back to back over SP=1's taken
the same way (host launch time hidden, as behind a forward's earlier layers); the ratio column waits for the
GPU before each run, so it also counts the host's time to issue a rank's first launch. Both rankings print.
Writes JSON (--out). Stops starting new configs after --budget-s seconds (the rest are marked skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

# Tried on a GPU by default: the prefill kernel's tiles and their neighbours, each with and without packing
# the GQA group into M (BLOCK_M / G query rows x G heads per program). Compiled for sm_90 (D 128, bf16, TMA)
# none of these spills registers and all fit Hopper's 227 KiB of shared memory; 64 x 64 with 2 stages (83 KB,
# 182-202 registers x 128 threads) leaves room for two programs per SM. Left out: 128 x 128 with 4 stages
# (290 KB of shared memory), 128 x 64 with 4 warps and 256 x 64 packed (they spill).
CANDIDATES = ["128,128,8,3", "128,128,8,2", "128,64,8,3", "128,64,8,2", "64,128,4,3", "64,64,4,3", "64,64,4,2",
              "128,128,8,3,pack", "128,128,8,2,pack", "128,64,8,3,pack", "128,64,8,2,pack", "64,128,4,3,pack",
              "64,64,4,2,pack"]
DRY_CANDIDATES = ["16,16,4,1", "32,16,4,1,pack"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=None, help="prompt lengths (default 16384,65536,131072; dry run 40)")
    p.add_argument("--sp", default="2,4", help="SP sizes (1: the ring kernel over the whole prompt in one launch, "
                                                 "beside the prefill kernel; no goal)")
    p.add_argument("--configs", default=None,
                   help="';'-separated BLOCK_M,BLOCK_N,warps,stages[,pack] (default CANDIDATES; dry run "
                        "DRY_CANDIDATES)")
    p.add_argument("--splits", default=None,
                   help="comma-separated split-K counts crossed with every config: 1 (off), N, auto (default: each "
                        "config as written, which is auto unless it says split=N)")
    p.add_argument("--flags", default=None,
                   help="comma-separated flag sets crossed with every config, each '+'-joined or 'none': e.g. "
                        "'none,early,pdl,early+pdl,fuse+early+pdl' (RingConfig's early / pdl / acc16 / fuse)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; dry run 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; dry run 2)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; dry run 16)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="default bf16; dry run fp32 (the interpreter's dot mis-reads bf16)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size of the layout (default 16; dry run 4)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the kernel under Triton's interpreter (TRITON_INTERPRET=1): a check that this runs")
    p.add_argument("--reps", type=int, default=None, help="timed runs per rank (median; default 3, dry run 1)")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new config after this many seconds")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes")
    p.add_argument("--out", default="bench_results/tune_ring_kernel.json")
    a = p.parse_args(argv)
    tiny = a.dry_run
    a.lengths = [int(x) for x in (a.lengths or ("40" if tiny else "16384,65536,131072")).split(",") if x]
    a.sp = [int(x) for x in a.sp.split(",") if x]
    a.configs = with_flags(with_splits([c.strip() for c in (a.configs or ";".join(DRY_CANDIDATES if tiny else
                                                                            CANDIDATES)).split(";") if c.strip()],
                                       a.splits), a.flags)
    a.heads = a.heads or (4 if tiny else 32)
    a.kv_heads = a.kv_heads or (2 if tiny else 8)
    a.head_dim = a.head_dim or (16 if tiny else 128)
    a.block_size = a.block_size or (4 if tiny else 16)
    a.reps = a.reps or (1 if tiny else 3)
    a.dtype = a.dtype or ("fp32" if tiny else "bf16")
    if min(a.lengths) < 1 or min(a.sp) < 1 or a.heads % a.kv_heads or a.reps < 1:
        p.error("lengths must be positive, SP sizes >= 1, heads a multiple of kv-heads, reps >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (use --device cpu --dry-run to check the script)")
    return a


def with_splits(configs: list[str], splits: str | None) -> list[str]:
    """Every config crossed with every split-K count of `splits` ("1,2,auto"): its split field replaced by
    ",split=N" ("auto": none, the default rule). None: the configs as they are."""
    if not splits:
        return configs
    counts = [x.strip().lower() for x in splits.split(",") if x.strip()]
    out = []
    for config in configs:
        base = ",".join(f for f in config.split(",") if not f.strip().lower().startswith("split"))
        out += [base if n == "auto" else f"{base},split={n}" for n in counts]
    return out


def with_flags(configs: list[str], flags: str | None) -> list[str]:
    """Every config crossed with every flag set of `flags` ("none,early,early+pdl"): the set's flags appended
    (those the config has already are not repeated). None: the configs as they are."""
    if not flags:
        return configs
    sets = [[f for f in x.strip().lower().split("+") if f and f != "none"] for x in flags.split(",") if x.strip()]
    out = []
    for config in configs:
        have = {f.strip().lower() for f in config.split(",")}
        for extra in sets:
            config_with = ",".join([config] + [f for f in extra if f not in have])
            if config_with not in out:
                out.append(config_with)
    return out


def _interpreter_ready(device: str) -> None:
    """On CPU the kernel runs in Triton's interpreter, which must be on before the kernel module is imported."""
    if device != "cpu":
        return
    if "parallel.kernels.ring_attention_triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before the kernels are imported: run it as a script")
    os.environ["TRITON_INTERPRET"] = "1"


def step_profile(q, blocks, shards, rank: int, scale: float, config,
                 device: str) -> tuple[list[float] | None, float, list[list[int]], list[float]]:
    """One more run of rank `rank`'s ring: each step's GPU ms (CUDA events; None on CPU), the host ms to
    issue the whole ring (set-up, launches), per step [tile-table rows, split slots (0: not split; else the
    rows are split-K pieces), mean and max key tiles per row] (a program per row and head group: fewer key
    tiles per program, more of each program's fixed cost), and the host ms of [set-up, step 0, step 1, ...].

    On CUDA a spin kernel (~SPIN_MS) is queued first, so the host has issued every launch before the GPU reaches
    the first one: the step times are the kernels' own, without the host's time to issue them (which the host
    column gives; where the host took longer than the spin, `host_bound` says so and the first step's time
    holds part of it)."""
    from parallel.ring_attention import _RingSteps

    n = len(shards)
    srcs = [(rank - s) % n for s in range(n)]
    cuda = device == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 2)] if cuda else []
    if cuda:
        torch.cuda.synchronize()
        events[-1].record()
        torch.cuda._sleep(int(SPIN_MS * 1e-3 * _clock_hz()))
    t0 = time.perf_counter()
    steps = _RingSteps(q, blocks[rank], shards[rank], [shards[s] for s in srcs], scale, None, True,
                       as_kernel_config(config))
    host = [time.perf_counter()]
    for i, src in enumerate(srcs):
        if cuda and i == 0:
            events[0].record()
        steps.step(i, blocks[src])
        host.append(time.perf_counter())
        if cuda:
            events[i + 1].record()
    steps.result()
    issue_ms = (time.perf_counter() - t0) * 1e3
    host_ms = [(b - a) * 1e3 for a, b in zip([t0] + host[:-1], host)]
    if cuda:
        torch.cuda.synchronize()
    tables = []
    for tiles, _, slots in steps.tables:
        key_tiles = -(-(tiles[:, 4] - tiles[:, 2]).cpu().double() // config_block_n(config))
        tables.append([int(tiles.shape[0]), slots, round(float(key_tiles.mean()), 2) if len(key_tiles) else 0.0,
                       int(key_tiles.max()) if len(key_tiles) else 0])
    if not cuda:
        return None, issue_ms, tables, host_ms
    host_ms.append(float(events[-1].elapsed_time(events[0]) < issue_ms))  # 1.0: the spin ended before the host did
    return [events[i].elapsed_time(events[i + 1]) for i in range(n)], issue_ms, tables, host_ms


# gather (RingConfig): the rank's one launch waits for every block; this one-GPU time has no transfers, so it omits
# that wait ((SP - 1) x a block's bytes over the link), which the ring's other configs overlap with their steps.
GATHER_NOTE = "  [gather: omits the wait for the blocks]"
SPIN_MS = 3.0  # the spin kernel ahead of a profiled ring (step_profile): longer than any ring's host issue time


def _clock_hz() -> float:
    """The GPU's SM clock in Hz (torch.cuda._sleep spins in cycles); 1.98 GHz (H100/H200 boost) if unknown."""
    try:
        return torch.cuda.clock_rate() * 1e6
    except Exception:  # noqa: BLE001 - needs pynvml; the spin's length is only a lower bound on the host's time
        return 1.98e9


def config_block_n(config: str) -> int:
    """BLOCK_N of a config string (the key tile a program's loop steps by); "default": the default's for D 128."""
    from parallel.kernels.ring_attention_triton import CONFIGS, RingConfig

    return CONFIGS[128][0].block_n if config == DEFAULT else RingConfig.parse(config).block_n


# A config named "default" runs the kernel's own choice (`default_config`: CONFIGS, and `fuse` for short chunks).
DEFAULT = "default"


def as_kernel_config(config: str) -> str | None:
    """The kernel_config argument for a config of the sweep: None for "default"."""
    return None if config == DEFAULT else config


def run_config(qs, blocks, shards, positions, config: str, scale: float, ref: torch.Tensor,
               a: argparse.Namespace) -> dict:
    """Every rank's ring under `config`: per-rank seconds and error, the slowest, its step profile."""
    from bench_sp_rank import streamed, timed
    from parallel.ring_attention import ring_rank_attention

    ranks = []
    for r in range(len(shards)):
        run = lambda: ring_rank_attention(qs[r], blocks, shards, r, scale, "triton",  # noqa: E731
                                          kernel_config=as_kernel_config(config))
        seconds, out = timed(run, a.device, a.reps)
        rows = torch.tensor(positions[r], dtype=torch.long, device=ref.device)
        err = (out.float() - ref.index_select(0, rows).float()).abs().max().item() if rows.numel() else 0.0
        del out
        ranks.append({"rank": r, "seconds": seconds, "stream_s": streamed(run, a.device, a.reps), "max_abs_err": err})
    slow = max(ranks, key=lambda c: c["seconds"])
    step_ms, issue_ms, tables, host_ms = step_profile(qs[slow["rank"]], blocks, shards, slow["rank"], scale, config,
                                                      a.device)
    return {"ranks": ranks, "slowest_s": slow["seconds"], "slowest_rank": slow["rank"],
            "slowest_stream_s": max(c["stream_s"] for c in ranks),
            "max_abs_err": max(c["max_abs_err"] for c in ranks), "step_ms": step_ms, "issue_ms": issue_ms,
            "step_tables": tables, "host_ms": host_ms[:len(shards) + 1],
            "host_bound": bool(host_ms[-1]) if step_ms is not None else None}


def tune_length(n: int, a: argparse.Namespace, started: float) -> dict:
    """One prompt length: SP=1 before and after, every (SP size, config) cell; failures recorded per cell."""
    from bench_sp_rank import BF16_TOL, DTYPES, GOALS, sp1_attention, sp1_times, timed, _engine_prefill
    from parallel.ring_attention import split_for_ranks
    from workers.sp_plan import owned_positions

    gen = torch.Generator(device=a.device).manual_seed(n)
    dtype, d = DTYPES[a.dtype], a.head_dim
    q = torch.randn(n, a.heads, d, generator=gen, device=a.device, dtype=dtype)
    k, v = (torch.randn(n, a.kv_heads, d, generator=gen, device=a.device, dtype=dtype) for _ in range(2))
    scale = d ** -0.5
    sp1 = sp1_attention(q, k, v, scale, a.device)
    sp1["res"] = sp1_times(sp1, a.device, a.reps)
    base = sp1["res"]["baseline_s"]
    cell = {"tokens": n, "sp1": sp1["res"], "sp": {}, "chunk_prefill": {}}
    for sp in a.sp:
        if a.device == "cuda" and sp > 1:
            cell["chunk_prefill"][str(sp)] = chunk_prefill(q, k, v, n // sp, sp, scale, sp1["res"], a.reps)
        positions = [owned_positions(0, n, r, sp, a.block_size) for r in range(sp)]
        qs, blocks, shards = split_for_ranks(q, k, v, positions)
        cell["sp"][str(sp)] = res = {}
        for config in a.configs:
            if time.perf_counter() - started > a.budget_s:
                res[config] = {"skipped": f"budget of {a.budget_s:.0f} s spent"}
                continue
            try:
                r = run_config(qs, blocks, shards, positions, config, scale, sp1["ref"], a)
            except Exception as e:  # noqa: BLE001 - e.g. a tile that does not fit in shared memory: recorded
                res[config] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            r["ratio"] = r["slowest_s"] / base
            r["stream_ratio"] = r["slowest_stream_s"] / sp1["res"]["baseline_stream_s"]
            r["goal"] = GOALS.get(sp)
            r["meets_goal"] = None if r["goal"] is None else r["ratio"] <= r["goal"]
            r["within_bf16_tol"] = r["max_abs_err"] <= BF16_TOL
            res[config] = r
        del qs, blocks
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.device == "cuda":  # the baseline again: did the clocks move while the configs ran?
        cell["sp1_after_s"] = timed(_engine_prefill(q, k, v, scale), a.device, a.reps)[0]
    return cell


def chunk_prefill(q, k, v, tokens: int, sp: int, scale: float, sp1: dict, reps: int) -> dict:
    """The prefill kernel over the prompt's first `tokens` tokens (a causal prompt of one ring step's size: a rank
    of SP=sp runs sp steps of about this shape, its own chunk against each rank's), times sp, against SP=1: what
    the SP=1 kernel itself would take for a rank's work if it ran sp short launches (its short-program floor)."""
    from bench_sp_rank import streamed, timed, _engine_prefill

    run = _engine_prefill(q[:tokens], k[:tokens], v[:tokens], scale)
    seconds = timed(run, "cuda", reps)[0]
    stream = streamed(run, "cuda", reps)
    return {"tokens": tokens, "seconds": seconds, "stream_s": stream, "ratio_x_sp": sp * seconds / sp1["baseline_s"],
            "stream_ratio_x_sp": sp * stream / sp1["baseline_stream_s"]}


def summary(results: list[dict], configs: list[str], key: str = "ratio") -> list[dict]:
    """Per config: worst ratio / goal over the cells with a goal (None if any cell failed, was skipped or is
    off in error), and its ratios; best first. key: "ratio" (each run waits for the GPU first) or
    "stream_ratio" (runs issued back to back)."""
    rows = []
    for config in configs:
        ratios, worst, ok = {}, 0.0, True
        for cell in results:
            for sp, res in cell.get("sp", {}).items():
                r = res.get(config, {})
                if key not in r or not r["within_bf16_tol"]:
                    ok = False
                    continue
                ratios[f"{cell['tokens']}/sp{sp}"] = round(r[key], 4)
                if r["goal"]:
                    worst = max(worst, r[key] / r["goal"])
        rows.append({"config": config, "worst_ratio_over_goal": round(worst, 4) if ok else None, "ratios": ratios})
    return sorted(rows, key=lambda r: (r["worst_ratio_over_goal"] is None, r["worst_ratio_over_goal"] or 0.0))


def table(results: list[dict], configs: list[str]) -> str:
    lines = [f"{'tokens':>7} {'SP':>2} {'config':<34} {'slowest ms':>10} {'SP=1 ms':>8} {'ratio':>6} {'goal':>5} "
             f"{'max err':>8} {'streamed':>8}  {'step ms (slowest rank)':<26} {'issue ms':>8}  tile rows per step "
             f"('*' split)"]
    for cell in results:
        base = cell["sp1"]["baseline_s"] * 1e3
        after = f", after {cell['sp1_after_s'] * 1e3:.3f}" if "sp1_after_s" in cell else ""
        lines.append(f"{cell['tokens']:7d}  1 {cell['sp1']['baseline']:<34} {'-':>10} {base:8.3f}{after}; streamed "
                     f"{cell['sp1']['baseline_stream_s'] * 1e3:.3f}")
        for sp, c in cell.get("chunk_prefill", {}).items():
            name = f"prefill kernel at {c['tokens']} tokens x {sp}"
            lines.append(f"{cell['tokens']:7d} {sp:>2} {name:<34} "
                         f"{c['seconds'] * 1e3 * int(sp):10.3f} {base:8.3f} {c['ratio_x_sp']:6.3f} {'':>5} {'':>8} "
                         f"{c['stream_ratio_x_sp']:8.3f}  (one launch {c['seconds'] * 1e3:.3f} ms)")
        for sp, res in cell["sp"].items():
            for config in configs:
                r = res[config]
                if "ratio" not in r:
                    lines.append(f"{cell['tokens']:7d} {sp:>2} {config:<34} {r.get('error') or r.get('skipped')}")
                    continue
                goal = "-" if r["goal"] is None else f"{r['goal']:.2f}" + ("" if r["meets_goal"] else "!")
                steps = "-" if r["step_ms"] is None else " ".join(f"{x:.2f}" for x in r["step_ms"])
                rows = " ".join(f"{t[0]}{'*' if t[1] else ''}" for t in r["step_tables"])
                host = " ".join(f"{x:.3f}" for x in r.get("host_ms", []))
                lines.append(f"{cell['tokens']:7d} {sp:>2} {config:<34} {r['slowest_s'] * 1e3:10.3f} {base:8.3f} "
                             f"{r['ratio']:6.3f} {goal:>5} {r['max_abs_err']:8.1e}{'' if r['within_bf16_tol'] else '!'}"
                             f" {r['stream_ratio']:8.3f}  {steps:<26} {r['issue_ms']:8.2f}  {rows}   host ms "
                             f"[set-up, steps] {host}{' (host-bound)' if r.get('host_bound') else ''}"
                             f"{GATHER_NOTE if 'gather' in config else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    _interpreter_ready(a.device)
    from parallel.kernels.ring_attention_triton import CONFIGS, ENV, RingConfig, sm_count

    for c in a.configs:
        if c != DEFAULT:
            RingConfig.parse(c)  # a typo fails here, not after minutes of timing
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)"
    sms = sm_count(torch.device(a.device))  # what split=auto measures a step's work against
    results = [tune_length(n, a, started) for n in a.lengths]
    ranked = summary(results, a.configs)
    ranked_stream = summary(results, a.configs, "stream_ratio")
    report = {"benchmark": "tune_ring_kernel", "device": device_name, "date": time.strftime("%Y-%m-%d"),
              "sms": sms, "shape": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}, "dtype": a.dtype,
              "block_size": a.block_size, "reps": a.reps, "configs": a.configs,
              "default": str(CONFIGS.get(a.head_dim, (None,))[0]), "env_override": os.environ.get(ENV),
              "results": results, "summary": ranked, "summary_streamed": ranked_stream,
              "seconds": time.perf_counter() - started}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{device_name}: ring kernel configs, one SP rank's attention (slowest rank) vs SP=1 attention, "
          f"Hq={a.heads} Hkv={a.kv_heads} D={a.head_dim} {a.dtype}, block {a.block_size}, median of {a.reps}, "
          f"{sms} SMs; "
          f"'!' = goal missed / error over bf16 tolerance")
    print(table(results, a.configs))
    print(f"\nconfigs by worst ratio/goal over all cells (< 1: every goal met); current default {report['default']}:")
    for title, rows in (("", ranked), ("streamed (runs back to back, SP=1 too): ", ranked_stream)):
        if title:
            print(f"\n{title}")
        for r in rows:
            worst = "failed/skipped" if r["worst_ratio_over_goal"] is None else f"{r['worst_ratio_over_goal']:.3f}"
            print(f"  {r['config']:<34} {worst:>13}   " + " ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()))
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    return 0 if ranked and ranked[0]["worst_ratio_over_goal"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
