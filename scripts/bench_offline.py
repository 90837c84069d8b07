#!/usr/bin/env python3
"""Offline throughput: Tandem's `LLM.generate` vs Hugging Face `generate`, same model, same prompts, one run.

Requests are synthetic token-id prompts with input/output lengths drawn from a ShareGPT-like
(log-normal) distribution with a fixed seed. Tandem gets all requests at once (continuous batching);
HF runs them in static batches of `--hf-batch-size`, left-padded, each batch generating until its
longest request is done — only the requested tokens are counted for either side.

    python scripts/bench_offline.py                                  # shipped tiny model on CPU
    python scripts/bench_offline.py --model M --device cuda --dtype bfloat16 --num-requests 1000
    python scripts/bench_offline.py --model CONFIG_DIR --load-format dummy --device cuda   # real shapes, random weights
    python scripts/bench_offline.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --num-requests 1000 \
        --hf-num-requests 128      # writes a dummy-weight folder of the real shapes (scripts/model_shapes.py)
On CUDA, HF runs on --hf-num-requests of the same requests (the first ones; all by default) and the
two engines are compared by tokens per second.
Prints a table and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem import LLM, SamplingParams  # noqa: E402
from workers.config import DEFAULT_MODEL  # noqa: E402
from workers.config import DTYPES  # noqa: E402


def _engine_facts(llm) -> dict:
    """KV blocks and whether decode replays CUDA graphs, from the in-process runner or the Ray ranks."""
    ex = llm.llm_engine.executor
    runner = getattr(ex, "runner", None)
    if runner is not None:
        return {"num_kv_blocks": runner.num_blocks, "cuda_graphs": getattr(runner, "cuda_graphs", None) is not None}
    import ray

    sizes = ray.get([w.cuda_graph_sizes.remote() for w in ex.workers])
    # step_groups: steps in flight at once over disjoint groups of sequences (pipelined steps under PP), else 1.
    return {"num_kv_blocks": ex.num_blocks, "cuda_graphs": all(sizes), "step_groups": llm.llm_engine.step_groups}


def synthetic_requests(n: int, vocab: int, mean_in: int, mean_out: int, max_in: int, max_out: int, seed: int):
    rng = np.random.default_rng(seed)
    # Log-normal lengths, sigma as in ShareGPT's long tail; the median is set so the mean is as asked.
    ins = np.clip(rng.lognormal(np.log(mean_in) - 0.5 * 0.9**2, 0.9, n), 4, max_in).astype(int)
    outs = np.clip(rng.lognormal(np.log(mean_out) - 0.5 * 0.8**2, 0.8, n), 4, max_out).astype(int)
    low = min(16, vocab // 4)  # keep clear of the special tokens at the start of most vocabularies
    prompts = [rng.integers(low, vocab, size=k).tolist() for k in ins]
    return prompts, outs.tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_layout(spec: str) -> dict:
    """"uni", "ray", "tp2", "pp2", "sp2", "ep2", "gN" (cuda_graph_max_tokens=N: g0 runs prefill and mixed
    steps eagerly), "nop2p" (NCCL-only TP all-reduce), "async" / "sync" (async_scheduling on / off; on is the
    default), "nooverlap" (pipeline_step_overlap off: under PP one step at a time, cut into micro-batches),
    "ring" / "ulysses" (the SP attention mode) and
    "+"-joined combinations ("tp2+ray", "tp2+g0", "sp2+ring") as engine arguments."""
    sizes = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "sp": "sequence_parallel_size",
             "ep": "expert_parallel_size"}
    layout: dict = {}
    for part in spec.split("+"):
        if part in ("uni", "ray", "auto"):
            layout["distributed_executor_backend"] = part
        elif part[:2] in sizes and part[2:].isdigit():
            layout[sizes[part[:2]]] = int(part[2:])
        elif part[:1] == "g" and part[1:].isdigit():
            layout["cuda_graph_max_tokens"] = int(part[1:])
        elif part == "nop2p":
            layout["disable_p2p_all_reduce"] = True
        elif part == "sync":
            layout["async_scheduling"] = False
        elif part == "async":
            layout["async_scheduling"] = True
        elif part == "nooverlap":
            layout["pipeline_step_overlap"] = False
        elif part in ("ring", "ulysses"):
            layout["sequence_parallel_attention"] = part
        else:
            raise SystemExit(f"--layouts: cannot read {part!r} (uni, ray, tpN, ppN, spN, epN, gN, nop2p, async, sync, nooverlap, ring, "
                             "ulysses, joined with +)")
    return layout


def run_tandem(args, prompts, out_lens, layout: dict | None = None) -> dict:
    extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    layout = layout if layout is not None else {"tensor_parallel_size": args.tensor_parallel_size}
    if args.device.startswith("cuda"):
        extra.update(attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                     gpu_memory_utilization=args.gpu_memory_utilization)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              show_progress=False, **layout, **extra)
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in out_lens]
    llm.generate(prompts[:2], params[:2])  # warm-up (allocator, kernels)
    profile = None
    if args.profile_steps or args.step_times:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from step_profile import StepProfile

        profile = StepProfile(llm.llm_engine, gpu_every=args.profile_steps, ranks=not args.step_times)
    sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    sync(args.device)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(out_lens), "Tandem produced a different number of tokens than requested"
    result = {"seconds": dt, "output_tokens": n_out, "preemptions": llm.llm_engine.scheduler.num_preemptions,
              **_engine_facts(llm)}
    if profile is not None:
        result["step_profile"] = profile.summary()
        print(profile.table())
    llm.llm_engine.shutdown()
    del llm, outs, profile  # the profile's hooks hold the engine
    if args.device.startswith("cuda"):  # free the weights and KV cache before HF loads its copy
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return result


def run_isolated(spec: str) -> dict:
    """One layout's run in a child process of this script with the same arguments (same prompts: same seed)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--no-isolate", "--layouts", spec, "--repeat", "1",
               "--skip-hf", "--out", out]
        code = subprocess.run(cmd).returncode
        if not os.path.exists(out):  # a child that wrote its JSON and then failed to exit cleanly still counts
            raise RuntimeError(f"the isolated run {spec!r} failed (exit code {code})")
        if code:
            print(f"warning: the isolated run exited with code {code} after writing its result", file=sys.stderr)
        with open(out) as f:
            return json.load(f)["results"][f"tandem[{spec}]#1"]


def run_hf(args, prompts, out_lens) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = DTYPES.get(args.dtype, torch.float32) if args.dtype != "auto" else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    if args.load_format == "dummy":
        cfg = AutoConfig.from_pretrained(args.model)
        with torch.device(args.device):  # random init where it runs: an 8B model is slow to init on CPU
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model = model.to(args.device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # fair to HF: similar lengths batched
    n_out = 0
    sync(args.device)
    t0 = time.perf_counter()
    for b in range(0, len(order), args.hf_batch_size):
        idx = order[b : b + args.hf_batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        new = max(out_lens[i] for i in idx)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
        n_out += sum(out_lens[i] for i in idx)
    sync(args.device)
    return {"seconds": time.perf_counter() - t0, "output_tokens": n_out, "batch_size": args.hf_batch_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--shape", default=None, help="a name in scripts/model_shapes.py: real shapes, dummy weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--mean-input", type=int, default=128)
    p.add_argument("--mean-output", type=int, default=64)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (Ray ranks) Tandem shards the model over")
    p.add_argument("--layouts", default=None, help="compare engine layouts in one run, space-separated, each "
                   "uni, ray, tpN, ppN, spN, epN or a + join (e.g. 'uni ray' or 'tp1 tp2'); ratios vs the first")
    p.add_argument("--repeat", type=int, default=1, help="with --layouts: run the whole list this many times")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=False,
                   help="with --layouts: run each layout in a fresh process of this script, as a user runs one engine "
                        "per process (an engine run after another one in the same process measured up to 20%% slower)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-num-requests", type=int, default=None, help="HF runs only the first N requests (default all)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="time each step's phases; every N-th step also under torch.profiler (GPU kernel time)")
    p.add_argument("--step-times", action="store_true",
                   help="time each step at the driver only, the executors unprofiled (no rank profile and no "
                        "torch.profiler steps, which run whole)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="bench_results/bench_offline.json")
    args = p.parse_args()
    if args.step_times and args.profile_steps:
        p.error("--step-times times steps without the rank profiles --profile-steps installs: give one of them")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoConfig

    if args.shape:
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from model_shapes import write_model_folder

        args.model = write_model_folder(args.shape, os.path.join(tempfile.mkdtemp(), args.shape))
        args.load_format = "dummy"
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts, out_lens = synthetic_requests(args.num_requests, vocab, args.mean_input, args.mean_output,
                                           args.max_input, args.max_output, args.seed)
    n_in = sum(len(x) for x in prompts)
    if args.layouts:
        results = {}
        for run in range(1, args.repeat + 1):
            for spec in args.layouts.split():
                results[f"tandem[{spec}]#{run}"] = (run_isolated(spec) if args.isolate
                                                    else run_tandem(args, prompts, out_lens, parse_layout(spec)))
                print(f"tandem[{spec}]#{run}: {results[f'tandem[{spec}]#{run}']['seconds']:.2f} s", flush=True)
    else:
        results = {"tandem": run_tandem(args, prompts, out_lens)}
    if not args.skip_hf:
        k = args.hf_num_requests or len(prompts)
        results["hf"] = run_hf(args, prompts[:k], out_lens[:k])
        results["hf"]["num_requests"] = k
        results["hf"]["input_tokens"] = sum(len(x) for x in prompts[:k])
    for r in results.values():
        r["output_tok_per_s"] = r["output_tokens"] / r["seconds"]
        r["total_tok_per_s"] = (r["output_tokens"] + r.get("input_tokens", n_in)) / r["seconds"]
    report = {
        "benchmark": "offline",
        "model": os.path.basename(os.path.normpath(args.model)),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "input_tokens": n_in,
        "output_tokens": sum(out_lens),
        "args": vars(args),
        "results": results,
    }
    if "hf" in results and "tandem" in results:
        report["speedup_total_tok_per_s"] = results["tandem"]["total_tok_per_s"] / results["hf"]["total_tok_per_s"]
    if args.layouts:  # each layout's runs against the first layout's run of the same round
        first = args.layouts.split()[0]
        for name, r in results.items():
            if name.startswith("tandem["):
                base = results[f"tandem[{first}]#{name.rsplit('#', 1)[1]}"]
                r["vs_first_layout"] = r["total_tok_per_s"] / base["total_tok_per_s"]
    print(f"{'engine':20} {'seconds':>9} {'out tok/s':>10} {'total tok/s':>12} {'vs first':>9}")
    for name, r in results.items():
        print(f"{name:20} {r['seconds']:9.2f} {r['output_tok_per_s']:10.1f} {r['total_tok_per_s']:12.1f} "
              f"{r.get('vs_first_layout', float('nan')):9.3f}")
    if "speedup_total_tok_per_s" in report:
        print(f"speedup (total tok/s): {report['speedup_total_tok_per_s']:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
