#!/usr/bin/env python3
"""One layer's attention of one SP rank on one device, against SP=1 attention over the whole prompt.

For each prompt length and SP size, every rank's share of ring attention is run on this one device with
no communication (`parallel.ring_attention.ring_rank_attention`): the rank's queries, laid out as the SP
path lays them out (block-owned: block i of the prompt belongs to rank `block_owner(i, sp)`,
`workers.sp_plan.owned_positions`), against every rank's K/V block in ring order, merged by log-sum-exp.
The slowest rank's time is compared with SP=1 attention over the whole prompt: the engine's own causal
prefill kernel (parallel/kernels/paged_attention.py `prefill_attention`, what the Triton backend runs on
GPU); PyTorch's flash SDPA is timed beside it for scale and is the reference of the error. Goals (issue
25): the slowest rank <= 0.55x SP=1 at SP=2 and <= 0.3x at SP=4, error within bf16 tolerance, memory
per rank linear in its chunk.

    python scripts/bench_sp_rank.py                                   # 16K/64K/128K, SP 2 and 4, Llama-3.1-8B heads
    python scripts/bench_sp_rank.py --device cpu --dry-run            # tiny shapes, CPU, seconds

Per rank it reports the median time of --reps runs (after one warm-up run; each waits for the GPU first, so it
also counts the host's time to issue the first launch) and the streamed time (--stream-runs runs issued back to
back, CUDA events around them, median of --reps rounds: GPU time per run once the host runs ahead, as in a
forward's layers; SP=1 timed the same way for the streamed ratio). Every cell of a length (SP=1, each rank of each
SP size, Ulysses) is timed once per round, the order reversed every other round (--order interleaved, the
default), so a drift of the clocks or of the host's load weighs on all of them alike; --order
sequential times each cell's runs one after another, as this script did before 2026-11-29. Also per rank: the
max abs error of its rows against SP=1 attention, and memory: `resident` (its queries, its own K/V block, the
received block in hand and the one in flight: what a ring rank holds for attention) and `work_peak`
(torch.cuda.max_memory_allocated during the call beyond what was allocated before it: accumulators, output,
positions). Not timed: communication (none here), the
gathers of K/V from the paged cache, the layout's host work. Writes JSON (--out) and prints a table.

Where the heads divide by the SP size, a Ulysses rank is timed beside the ring's (`ulysses_rank_attention`:
all the prompt's tokens for 1/sp of the heads, the same work on every rank; its all-to-alls not timed).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parallel.ring_attention import ring_rank_attention, split_for_ranks  # noqa: E402
from parallel.ulysses import heads_divide, ulysses_rank_attention  # noqa: E402
from workers.sp_plan import owned_positions  # noqa: E402

GOALS = {2: 0.55, 4: 0.3}  # issue 25: slowest rank's time / SP=1 attention's
BF16_TOL = 2e-2  # max abs error counted as "within bf16 tolerance"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=None, help="prompt lengths (default 16384,65536,131072; dry run 64,200)")
    p.add_argument("--sp", default="2,4", help="SP sizes")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; dry run 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; dry run 2)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; dry run 16)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--block-size", type=int, default=None, help="KV block size of the layout (default 16; dry run 4)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                   help="ring step: the Triton kernel, the PyTorch tiles, or auto (Triton on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per cell (median; default 5, dry run 1)")
    p.add_argument("--stream-runs", type=int, default=None,
                   help="back-to-back calls per streamed round (default --reps: fewer leave the first call's host "
                        "time less hidden)")
    p.add_argument("--order", default="interleaved", choices=["interleaved", "sequential"],
                   help="interleaved (default): every cell timed once per round, so all see the same clocks; "
                        "sequential: each cell's runs one after another (the order before 2026-11-29)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes: a check that the script runs")
    p.add_argument("--out", default="bench_results/bench_sp_rank.json")
    a = p.parse_args(argv)
    tiny = a.dry_run
    a.lengths = [int(x) for x in (a.lengths or ("64,200" if tiny else "16384,65536,131072")).split(",") if x]
    a.sp = [int(x) for x in a.sp.split(",") if x]
    a.heads = a.heads or (4 if tiny else 32)
    a.kv_heads = a.kv_heads or (2 if tiny else 8)
    a.head_dim = a.head_dim or (16 if tiny else 128)
    a.block_size = a.block_size or (4 if tiny else 16)
    a.reps = a.reps or (1 if tiny else 5)
    a.stream_runs = a.stream_runs or a.reps
    if min(a.lengths) < 1 or min(a.sp) < 1 or a.heads % a.kv_heads or a.reps < 1 or a.stream_runs < 1:
        p.error("lengths, SP sizes and reps must be positive and heads a multiple of kv-heads")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (use --device cpu --dry-run to check the script)")
    return a


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_once(fn, device: str) -> float:
    """Seconds of one call of fn(), the GPU idle before it and waited for after it (the host's time to issue the
    first launch counts in full)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def streamed_once(fn, device: str, runs: int) -> float:
    """Seconds per call of fn() issued `runs` times back to back with no wait in between, timed by CUDA events
    around them: the GPU time per call once the host runs ahead of the GPU, as a forward's layers queue their
    kernels. `timed_once` waits for the GPU before each call, so it also counts the host's time to issue the first
    launch (for a ring rank: its steps' set-up and first launch, ~0.1 ms at 16K tokens, which a served forward
    hides behind the previous layer's kernels)."""
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(runs):
            fn()
        return (time.perf_counter() - t0) / runs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / runs


def timed(fn, device: str, reps: int) -> tuple[float, object]:
    """Median seconds of `reps` calls of fn() (`timed_once`) after one warm-up call (compiles), and that call's
    result (scripts/tune_ring_kernel.py's timing of one cell; every call computes the same)."""
    result = fn()
    return statistics.median(timed_once(fn, device) for _ in range(reps)), result


def streamed(fn, device: str, reps: int) -> float:
    """`streamed_once` of `reps` calls after one warm-up call."""
    fn()
    return streamed_once(fn, device, reps)


def sp1_times(sp1: dict, device: str, reps: int) -> dict:
    """SP=1's cell timed on its own (scripts/tune_ring_kernel.py): its kernels' median seconds, the baseline's
    streamed time, the names."""
    res = {"sdpa_s": timed(sp1["fns"]["sdpa"], device, reps)[0], "baseline": sp1["baseline"]}
    base = sp1["fns"][sp1["baseline"]]
    res["baseline_s"] = timed(base, device, reps)[0]
    res["baseline_stream_s"] = streamed(base, device, reps)
    if "prefill_attention" in sp1["fns"]:
        res["prefill_attention_s"] = res["baseline_s"]
    return res


def measure(fns: dict, device: str, reps: int, stream_runs: int, order: str, streamed_names: set) -> dict:
    """Median timed-alone and streamed seconds of every fn (each already run once: compiled). `order`
    "interleaved": `reps` rounds, each timing every fn once (the order reversed every other round), then rounds of
    `stream_runs` back-to-back calls of each fn in `streamed_names`: a drift of the GPU's clocks or of the host's
    load during a length's runs (SP=1 at 128K moved 250.6 -> 264.9 ms within one run on 2026-11-27) then weighs on
    every cell alike, where "sequential" (each fn's `reps` runs, then its streamed run of `reps` calls, as before
    2026-11-29) charges it to the cells timed last. Returns {name: {"s", "min_s", "max_s"[,
    "stream_s"]}}."""
    names = list(fns)
    times: dict = {name: [] for name in names}
    stream: dict = {name: [] for name in names if name in streamed_names}
    if order == "sequential":
        for name in names:
            times[name] = [timed_once(fns[name], device) for _ in range(reps)]
            if name in stream:
                stream[name] = [streamed_once(fns[name], device, reps)]
    else:
        rounds = [names if r % 2 == 0 else names[::-1] for r in range(reps)]
        for order_of_round in rounds:
            for name in order_of_round:
                times[name].append(timed_once(fns[name], device))
        for order_of_round in rounds:
            for name in (n for n in order_of_round if n in stream):
                stream[name].append(streamed_once(fns[name], device, stream_runs))
    res = {name: {"s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for name, t in times.items()}
    for name, t in stream.items():
        res[name]["stream_s"] = statistics.median(t)
    return res


def sp1_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, device: str) -> dict:
    """SP=1 over the whole prompt: the engine's prefill kernel (CUDA; the baseline) and SDPA (flash on CUDA, math
    on CPU; the reference of the error, the baseline on CPU). Returns {"fns": {name: fn}, "baseline": name,
    "ref": SDPA's output}."""
    g = q.shape[1] // k.shape[1]
    # [1, H, T, D], MHA: the fused kernels take 4-D inputs only (3-D left flash unused: "No available kernel")
    kr, vr = (x.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0) for x in (k, v))
    qb = q.transpose(0, 1).unsqueeze(0)

    def sdpa() -> torch.Tensor:
        if device != "cuda":
            return F.scaled_dot_product_attention(qb, kr, vr, is_causal=True, scale=scale)[0].transpose(0, 1)
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qb, kr, vr, is_causal=True, scale=scale)[0].transpose(0, 1)

    fns = {"sdpa": sdpa}
    if device == "cuda":
        fns["prefill_attention"] = _engine_prefill(q, k, v, scale)
    return {"fns": fns, "baseline": "prefill_attention" if device == "cuda" else "sdpa", "ref": sdpa()}


def _engine_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """A call of the Triton backend's prefill for one fresh prompt (no cached context: the cache is never
    read), its metadata made once outside the timed call as the engine makes it once per step."""
    from parallel.kernels.paged_attention import prefill_attention

    t, dev = q.shape[0], q.device
    cache = torch.zeros(2, 1, 16, k.shape[1], k.shape[2], dtype=k.dtype, device=dev)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([t], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
    return lambda: prefill_attention(q, k, v, cache, tables, seq_lens, qsl, t, scale)


def ring_cells(q, k, v, sp: int, scale: float, ref: torch.Tensor, a: argparse.Namespace) -> tuple[dict, dict]:
    """Every rank of SP=sp for one prompt (and a Ulysses rank where the heads divide): {name: fn} to time, and
    each one's cell so far (its error against SP=1 from a first, compiling call; a ring rank's memory)."""
    backend = None if a.backend == "auto" else a.backend
    n = q.shape[0]
    positions = [owned_positions(0, n, r, sp, a.block_size) for r in range(sp)]
    qs, blocks, shards = split_for_ranks(q, k, v, positions)
    fns, cells = {}, {}
    for rank in range(sp):
        run = functools.partial(ring_rank_attention, qs[rank], blocks, shards, rank, scale, backend)
        out = run()
        rows = torch.tensor(shards[rank].positions[0], dtype=torch.long, device=ref.device)
        err = (out.float() - ref.index_select(0, rows).float()).abs().max().item() if rows.numel() else 0.0
        del out
        others = [b.nbytes for r, b in enumerate(blocks) if r != rank]
        cell = {"rank": rank, "query_tokens": qs[rank].shape[0], "max_abs_err": err,
                "resident_bytes": qs[rank].nbytes + blocks[rank].nbytes + 2 * max(others, default=0)}
        if a.device == "cuda":
            sync(a.device)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run()
            sync(a.device)
            cell["work_peak_bytes"] = torch.cuda.max_memory_allocated() - before
            cell["peak_bytes"] = cell["resident_bytes"] + cell["work_peak_bytes"]
            cell["peak_bytes_per_query_token"] = cell["peak_bytes"] / max(1, cell["query_tokens"])
        fns[f"sp{sp}/rank{rank}"], cells[f"sp{sp}/rank{rank}"] = run, cell
    if heads_divide(q.shape[1], k.shape[1], sp):
        run = functools.partial(ulysses_rank_attention, q, k, v, 0, sp, scale, backend)
        out = run()
        heads = out.shape[1]
        err = (out.float() - ref[:, :heads].float()).abs().max().item()
        fns[f"sp{sp}/ulysses"], cells[f"sp{sp}/ulysses"] = run, {"max_abs_err": err}
    return fns, cells


def sp_result(sp: int, cells: dict, times: dict, base: dict) -> dict:
    """SP=sp's cell: per-rank times, the slowest, its ratios to SP=1 and the goal, Ulysses beside it."""
    ranks = []
    for rank in range(sp):
        t = times[f"sp{sp}/rank{rank}"]
        ranks.append({**cells[f"sp{sp}/rank{rank}"], "seconds": t["s"], "min_s": t["min_s"], "max_s": t["max_s"],
                      "stream_s": t["stream_s"]})
    slowest = max(c["seconds"] for c in ranks)
    stream = max(c["stream_s"] for c in ranks)
    res = {"ranks": ranks, "slowest_s": slowest, "ratio": slowest / base["s"],
           "slowest_stream_s": stream, "stream_ratio": stream / base["stream_s"],
           "max_abs_err": max(c["max_abs_err"] for c in ranks), "goal": GOALS.get(sp)}
    res["meets_goal"] = None if res["goal"] is None else res["ratio"] <= res["goal"]
    res["within_bf16_tol"] = res["max_abs_err"] <= BF16_TOL
    if "peak_bytes" in ranks[0]:
        res["peak_bytes_max"] = max(c["peak_bytes"] for c in ranks)
    if f"sp{sp}/ulysses" in cells:
        u = {**cells[f"sp{sp}/ulysses"], "seconds": times[f"sp{sp}/ulysses"]["s"]}
        u["ratio"], u["goal"] = u["seconds"] / base["s"], GOALS.get(sp)
        u["meets_goal"] = None if u["goal"] is None else u["ratio"] <= u["goal"]
        res["ulysses"] = u
    return res


def bench_length(n: int, a: argparse.Namespace) -> dict:
    """One prompt length: SP=1 and every SP size, timed together (`measure`); an error (e.g. out of memory) is
    recorded for the length or the SP size it hit."""
    gen = torch.Generator(device=a.device).manual_seed(n)
    dtype, d = DTYPES[a.dtype], a.head_dim
    q = torch.randn(n, a.heads, d, generator=gen, device=a.device, dtype=dtype)
    k, v = (torch.randn(n, a.kv_heads, d, generator=gen, device=a.device, dtype=dtype) for _ in range(2))
    scale = d ** -0.5
    try:
        sp1 = sp1_attention(q, k, v, scale, a.device)
        for fn in sp1["fns"].values():
            fn()  # compiled before any timing
    except Exception as e:  # noqa: BLE001 - recorded: the table says which cell failed and why
        return {"tokens": n, "error": f"sp1: {type(e).__name__}: {str(e)[:300]}"}
    fns, cells, errors = dict(sp1["fns"]), {}, {}
    for sp in a.sp:
        try:
            sp_fns, sp_cells = ring_cells(q, k, v, sp, scale, sp1["ref"], a)
        except Exception as e:  # noqa: BLE001
            errors[str(sp)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if a.device == "cuda":
                torch.cuda.empty_cache()
            continue
        fns.update(sp_fns)
        cells.update(sp_cells)
    streamed_names = {sp1["baseline"]} | {name for name in fns if "/rank" in name}
    times = measure(fns, a.device, a.reps, a.stream_runs, a.order, streamed_names)
    base = times[sp1["baseline"]]
    res = {"sdpa_s": times["sdpa"]["s"], "baseline": sp1["baseline"], "baseline_s": base["s"],
           "baseline_min_s": base["min_s"], "baseline_max_s": base["max_s"], "baseline_stream_s": base["stream_s"]}
    if "prefill_attention" in times:
        res["prefill_attention_s"] = times["prefill_attention"]["s"]
    cell = {"tokens": n, "sp1": res, "sp": {}}
    for sp in a.sp:
        cell["sp"][str(sp)] = errors.get(str(sp)) or sp_result(sp, cells, times, base)
    return cell


def table(results: list[dict]) -> str:
    lines = [f"{'tokens':>8} {'SP':>3} {'slowest rank s':>14} {'SP=1 s':>9} {'ratio':>7} {'goal':>6} {'max err':>9} "
             f"{'peak/rank MiB':>13} {'streamed ratio':>14}"]
    for cell in results:
        if "error" in cell:
            lines.append(f"{cell['tokens']:8d} {cell['error']}")
            continue
        base = cell["sp1"]["baseline_s"]
        lines.append(f"{cell['tokens']:8d} {1:3d} {'-':>14} {base:9.4f} {'1':>7} {'-':>6} {'-':>9} {'-':>13} "
                     f"{'1':>14}   ({cell['sp1']['baseline']} {cell['sp1']['baseline_min_s']:.4f}-"
                     f"{cell['sp1']['baseline_max_s']:.4f} s over the rounds; sdpa {cell['sp1']['sdpa_s']:.4f} s; "
                     f"streamed {cell['sp1']['baseline_stream_s']:.4f} s)")
        for sp, r in cell["sp"].items():
            if "error" in r:
                lines.append(f"{cell['tokens']:8d} {sp:>3} {r['error']}")
                continue
            goal = "-" if r["goal"] is None else f"{r['goal']:.2f}" + ("" if r["meets_goal"] else "!")
            peak = f"{r['peak_bytes_max'] / 2**20:13.0f}" if "peak_bytes_max" in r else f"{'-':>13}"
            lines.append(f"{cell['tokens']:8d} {sp:>3} {r['slowest_s']:14.4f} {base:9.4f} {r['ratio']:7.3f} {goal:>6} "
                         f"{r['max_abs_err']:9.2e} {peak} {r['stream_ratio']:14.3f}   (ring)")
            if "ulysses" in r:
                u = r["ulysses"]
                ugoal = "-" if u["goal"] is None else f"{u['goal']:.2f}" + ("" if u["meets_goal"] else "!")
                lines.append(f"{cell['tokens']:8d} {sp:>3} {u['seconds']:14.4f} {base:9.4f} {u['ratio']:7.3f} "
                             f"{ugoal:>6} {u['max_abs_err']:9.2e} {'-':>13}   (ulysses)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    results = [bench_length(n, a) for n in a.lengths]
    report = {"benchmark": "sp_rank", "device": device_name, "date": time.strftime("%Y-%m-%d"),
              "shape": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}, "dtype": a.dtype,
              "block_size": a.block_size, "backend": a.backend, "reps": a.reps, "order": a.order,
              "stream_runs": a.stream_runs, "goals": GOALS, "results": results}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{device_name}: one SP rank's attention (slowest rank) vs SP=1, Hq={a.heads} Hkv={a.kv_heads} "
          f"D={a.head_dim} {a.dtype}, block {a.block_size}, '!' = goal missed")
    print(table(results))
    print(f"wrote {out}")
    failed = any("error" in c or any("error" in r for r in c["sp"].values()) for c in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
