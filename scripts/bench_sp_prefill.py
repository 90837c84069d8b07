"""Long-prompt prefill under sequence parallelism against one rank, in one command: for each layout
and prompt length, `generate(prompt, max_tokens=1)` three times (best of the last two), with tokens/s
and MFU per GPU. A layout that cannot start or a length that does not fit is recorded with its error,
so one run always reports every cell.

    python scripts/bench_sp_prefill.py --shape llama-3.1-8b --device cuda --lengths 16384,65536,131072 --layouts "sp1 sp2"
    python scripts/bench_sp_prefill.py --model models/tandem-tiny --device cpu --lengths 64,256   # dry run

Layouts as in bench_offline.py (`sp2`, `sp2+tp2`, ...; `sp1` is one rank). Writes OUT.json and prints
the table with each layout's time over the first layout's at the same length.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_offline import parse_layout, sync  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, per GPU


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


def bench_layout(model: str, spec: str, lengths: list[int], args) -> dict:
    layout = parse_layout(spec.replace("sp1", "uni"))
    world = layout.get("sequence_parallel_size", 1) * layout.get("tensor_parallel_size", 1)
    try:
        llm = LLM(model=model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  max_model_len=max(lengths) + 16, max_num_batched_tokens=max(lengths), max_num_seqs=4,
                  enable_prefix_caching=False, show_progress=False, **layout)
    except Exception as e:  # noqa: BLE001 - recorded: the table says which layout could not start and why
        return {"gpus": world, "error": f"start-up: {type(e).__name__}: {str(e)[:300]}"}
    vocab = llm.llm_engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    cells = {}
    for n in lengths:
        times = []
        try:
            for _ in range(args.runs):
                prompt = torch.randint(16, vocab, (n,), generator=gen).tolist()
                sync(args.device)
                t0 = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                sync(args.device)
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - recorded per cell
            cells[str(n)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        t = min(times[1:] or times)  # the first run warms up (Triton compiles, allocator grows)
        fl = prefill_flops(llm.llm_engine.hf_config, n)
        cells[str(n)] = {"seconds": t, "tok_per_s": n / t, "mfu_per_gpu": fl / t / world / (PEAK_BF16_TFLOPS * 1e12),
                         "all_seconds": times}
        print(f"{spec} {n} tokens: {t:.3f} s (runs {', '.join(f'{x:.3f}' for x in times)})", flush=True)
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return {"gpus": world, "lengths": cells}


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: --shape with dummy weights)")
    p.add_argument("--shape", default=None, help="a name in scripts/model_shapes.py (dummy weights)")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", default="16384,65536,131072")
    p.add_argument("--layouts", default="sp1 sp2", help="space-separated; the first is the baseline")
    p.add_argument("--runs", type=int, default=3, help="prefills per length; the best after the first counts")
    p.add_argument("--out", default="bench_results/bench_sp_prefill")
    args = p.parse_args(argv)
    if (args.model is None) == (args.shape is None):
        raise SystemExit("give exactly one of --model and --shape")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="tandem-sp-bench-") as tmp:
        if args.shape:
            from model_shapes import write_model_folder

            model, args.load_format = write_model_folder(args.shape, tmp), "dummy"
        else:
            model, args.load_format = args.model, "auto"
        out = Path(args.out).with_suffix(".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        results = {}
        for spec in args.layouts.split():  # the JSON is rewritten after each layout: a later one that hangs loses nothing
            results[spec] = bench_layout(model, spec, lengths, args)
            out.write_text(json.dumps({"model": args.model or args.shape, "device": args.device, "lengths": lengths,
                                       "date": time.strftime("%Y-%m-%d"), "results": results}, indent=2))
    print(table(results, lengths))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
