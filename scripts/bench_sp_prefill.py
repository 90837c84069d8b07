"""Long-prompt prefill under sequence parallelism against one rank, in one command: for each layout
and prompt length, `generate(prompt, max_tokens=1)` --runs times (best after the first), with tokens/s
and MFU per GPU. A layout that cannot start or a length that does not fit is recorded with its error,
so one run always reports every cell.

    python scripts/bench_sp_prefill.py --shape llama-3.1-8b --device cuda --lengths 16384,65536,131072 \
        --layouts "sp1 sp2+ring sp2+ulysses"
    python scripts/bench_sp_prefill.py --model models/tandem-tiny --device cpu --lengths 64,256   # dry run

Layouts as in bench_offline.py (`sp2`, `sp2+tp2`, ...; `sp1` is one rank). Each layout runs in a fresh
process of this script (--no-isolate: all in this one): an engine's GPU memory is only certainly given
back when its process exits. On 2 H100s (2026-11-25) the SP=1 engine's 77.8 GiB (KV cache, the
allocator's cached blocks) was still held after `shutdown()`, `del` and `gc.collect()`, and SP=2 could
not start. Writes OUT.json after each cell and prints the table with each layout's time over the first
layout's at the same length.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_offline import parse_layout, sync  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, per GPU
ERROR_CHARS = 2000  # an OOM's message names what PyTorch holds allocated and reserved only past its first 300


def prefill_flops(hf_config, n: int) -> float:
    """Linear layers (2 x non-embedding parameters per token) plus causal attention (QK^T and PV over
    half the n x n pairs, per layer)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    params = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
    layers = hf_config.num_hidden_layers
    heads, head_dim = hf_config.num_attention_heads, getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2.0 * params * n + 2.0 * 2.0 * (n * n / 2) * heads * head_dim * layers


def layout_of(spec: str) -> tuple[dict, int]:
    """A layout name -> (engine arguments, GPUs it uses)."""
    layout = parse_layout(spec.replace("sp1", "uni"))
    return layout, layout.get("sequence_parallel_size", 1) * layout.get("tensor_parallel_size", 1)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:ERROR_CHARS]}"


def time_length(llm, n: int, gen: torch.Generator, args) -> list[float]:
    """Seconds of each of --runs prefills of a random n-token prompt."""
    times = []
    for _ in range(args.runs):
        prompt = torch.randint(16, llm.llm_engine.vocab_size, (n,), generator=gen).tolist()
        sync(args.device)
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return times


def bench_layout(model: str, spec: str, lengths: list[int], args, save: Callable[[dict], None]) -> dict:
    """One layout's cells, in this process; `save` gets the result so far after start-up and after each cell."""
    layout, world = layout_of(spec)
    try:
        llm = LLM(model=model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  max_model_len=max(lengths) + 16, max_num_batched_tokens=max(lengths), max_num_seqs=4,
                  enable_prefix_caching=False, show_progress=False, **layout)
    except Exception as e:  # noqa: BLE001 - recorded: the table says which layout could not start and why
        result = {"gpus": world, "error": f"start-up: {error_text(e)}"}
        save(result)
        return result
    gen = torch.Generator().manual_seed(0)
    result: dict = {"gpus": world, "process": os.getpid(), "lengths": {}}
    for n in lengths:
        try:
            times = time_length(llm, n, gen, args)
        except Exception as e:  # noqa: BLE001 - recorded per cell
            result["lengths"][str(n)] = {"error": error_text(e)}
            save(result)
            continue
        t = min(times[1:] or times)  # the first run warms up (Triton compiles, allocator grows)
        fl = prefill_flops(llm.llm_engine.hf_config, n)
        result["lengths"][str(n)] = {"seconds": t, "tok_per_s": n / t, "all_seconds": times,
                                     "mfu_per_gpu": fl / t / world / (PEAK_BF16_TFLOPS * 1e12)}
        save(result)
        print(f"{spec} {n} tokens: {t:.3f} s (runs {', '.join(f'{x:.3f}' for x in times)})", flush=True)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()  # --no-isolate: what the next layout in this process can get back
    return result


def child_command(args, spec: str, out: Path) -> list[str]:
    """This script, run for one layout in this process's place (same model, lengths and runs)."""
    source = ["--model", args.model] if args.model else ["--shape", args.shape]
    return [sys.executable, str(Path(__file__).resolve()), *source, "--device", args.device, "--dtype", args.dtype,
            "--lengths", ",".join(map(str, args.length_list)), "--runs", str(args.runs), "--layouts", spec,
            "--out", str(out), "--layout-process"]


def run_isolated(spec: str, args) -> dict:
    """One layout in a fresh process of this script; its cells come back through its JSON, which it
    rewrites after each cell, so a process that dies mid-layout still reports the cells it finished."""
    with tempfile.TemporaryDirectory(prefix="tandem-sp-layout-") as tmp:
        out = Path(tmp) / "layout"
        code = subprocess.run(child_command(args, spec, out)).returncode
        path = out.with_suffix(".json")
        result = json.loads(path.read_text())["results"].get(spec) if path.exists() else None
    died = f"the layout's process exited with code {code} before"
    if result is None:
        return {"gpus": layout_of(spec)[1], "error": f"{died} the engine started"}
    if "lengths" in result:
        for n in args.length_list:
            result["lengths"].setdefault(str(n), {"error": f"{died} this length finished"})
    return result


def table(results: dict, lengths: list[int]) -> str:
    first = next(iter(results))
    lines = [f"{'layout':10} {'tokens':>8} {'seconds':>9} {'tok/s':>10} {'MFU/GPU':>8} {'vs ' + first:>9}"]
    for spec, res in results.items():
        if "error" in res:
            lines.append(f"{spec:10} {'-':>8} {res['error']}")
            continue
        for n in lengths:
            c = res["lengths"][str(n)]
            if "error" in c:
                lines.append(f"{spec:10} {n:8d} {c['error']}")
                continue
            base = results[first].get("lengths", {}).get(str(n), {})
            ratio = f"{c['seconds'] / base['seconds']:9.3f}" if "seconds" in base else f"{'-':>9}"
            lines.append(f"{spec:10} {n:8d} {c['seconds']:9.3f} {c['tok_per_s']:10.0f} {100 * c['mfu_per_gpu']:7.1f}% {ratio}")
    return "\n".join(lines)


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: --shape with dummy weights)")
    p.add_argument("--shape", default=None, help="a name in scripts/model_shapes.py (dummy weights)")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", default="16384,65536,131072")
    p.add_argument("--layouts", default="sp1 sp2", help="space-separated; the first is the baseline")
    p.add_argument("--runs", type=int, default=3, help="prefills per length; the best after the first counts")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="each layout in a fresh process of this script (default); --no-isolate: all in this one")
    p.add_argument("--out", default="bench_results/bench_sp_prefill")
    p.add_argument("--layout-process", action="store_true", help=argparse.SUPPRESS)  # one layout for a parent run: no table
    args = p.parse_args(argv)
    args.isolate = args.isolate and not args.layout_process
    if (args.model is None) == (args.shape is None):
        raise SystemExit("give exactly one of --model and --shape")
    args.length_list = [int(x) for x in args.lengths.split(",") if x]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    lengths = args.length_list
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    def save(spec: str, result: dict) -> None:  # the whole report, rewritten: a later cell that hangs loses nothing
        results[spec] = result
        out.write_text(json.dumps({"model": args.model or args.shape, "device": args.device, "lengths": lengths,
                                   "date": time.strftime("%Y-%m-%d"), "results": results}, indent=2))

    with tempfile.TemporaryDirectory(prefix="tandem-sp-bench-") as tmp:
        if args.shape and not args.isolate:  # an isolated run's processes write their own folders
            from model_shapes import write_model_folder

            model, args.load_format = write_model_folder(args.shape, tmp), "dummy"
        else:
            model, args.load_format = args.model, "auto"
        for spec in args.layouts.split():
            if args.isolate:
                save(spec, run_isolated(spec, args))
            else:
                bench_layout(model, spec, lengths, args, lambda result, spec=spec: save(spec, result))
    if not args.layout_process:
        print(table(results, lengths))
        print(f"wrote {out}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
