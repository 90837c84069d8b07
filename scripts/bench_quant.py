#!/usr/bin/env python3
"""Quantized inference beside bf16 in one run: batch-1 decode latency and offline throughput.

Every variant loads the same model shapes with dummy weights (`load_format="dummy"`); quantized
variants quantize those weights at load, in the layouts the project's tool writes (parallel/quant/rtn.py,
shared with scripts/quantize.py):
    bf16      the plain model (batch-1 decode through the fused bf16 GEMVs)
    w4a16     quantization="gptq": 4-bit RTN GPTQ, group 128; on CUDA at 1-8 rows parallel/kernels/w4_mma.py's
              tensor-core GEMV (where it measures faster at load), then PyTorch's tinygemm int4 kernel
              (aten._weight_int4pack_mm; dequantize + cuBLAS from the row count measured at load); batch 1: the
              fused decoder through w4_mma's one-row fused kernel where w4_mma serves the layer
    w4a16-unfused / fp8-unfused  the same weights with the batch-1 graph on the unfused decoder
              (TANDEM_FUSED_QUANT=0: tinygemm / the W8A16 GEMV per linear), to compare
    w4a16-triton  the same weights on the Triton W4A16 GEMV / GEMM (TANDEM_W4A16_KERNEL=triton), to compare
    w4a16-tinygemm  w4a16 with tinygemm at 1-8 rows too, not parallel/kernels/w4_mma.py's tensor-core GEMV (which
              serves every 4-bit linear it fits and measures faster at load; TANDEM_W4_GEMV=0), to compare
    w4a16-awq quantization="awq": 4-bit AWQ GEMM packing, same kernels after repacking
    w4a16-head  w4a16 with the LM head quantized too: config.json says GPTQ 4-bit group 128 with `lm_head: true`
              (GPTQModel's option, what `scripts/quantize.py --lm-head` writes), weights dummy as above; the head
              then runs on the same 4-bit kernels (parallel/embedding.py QuantizedLMHead)
    fp8       quantization="fp8": online FP8, per-channel weight scales, dynamic per-token activations
              (W8A8 torch._scaled_mm above 4 rows; W8A16 Triton GEMV at 2-4 rows; batch 1: the fused
              decoder's quantized GEMV, W8A16: e4m3 weights widened in registers, bf16 activations)
    fp8-actq  fp8 with each W8A8 linear quantizing its own activations (TANDEM_FP8_FUSED_ACT=0), not the RMSNorm /
              SiLU-and-mul kernel before it (parallel/quant/fp8_act.py), to compare
    fp8-fastacc  fp8 with cuBLAS's fast FP8 accumulation in the W8A8 GEMMs (TANDEM_FP8_FAST_ACCUM=1)
    fp8-kv    bf16 weights, kv_cache_dtype="fp8" (KV blocks at the same memory, throughput)
    bf16-sync / w4a16-sync  bf16 / w4a16 with the in-process engine running one step at a time
              (TANDEM_RANK_LAUNCH_AHEAD=0: no step launched ahead), to compare
With --agreement-model (a real checkpoint, e.g. models/tandem-tiny) the greedy outputs of each variant
that can run on it are compared token by token with its bf16 run on prompts cut from real text.

    python scripts/bench_quant.py --shape llama-3.1-8b --device cuda            # the numbers in docs/benchmarks.md
    python scripts/bench_quant.py --shape llama-3.1-8b --device cuda --variants bf16,w4a16,fp8 --gen-len 128 \
        --num-requests 200 --mean-input 128 --mean-output 128 --max-input 512 --max-output 512   # short (~4 min)
    python scripts/bench_quant.py --shape llama-3.1-8b --device cuda --variants bf16,w4a16,fp8,w4a16-unfused,fp8-unfused \
        --num-requests 0 --gen-len 128 --max-num-seqs 8       # batch-1 ms/token only, each beside bf16 (~3 min)
    python scripts/bench_quant.py --model models/tandem-tiny --device cpu ...   # dry run (tests/test_bench_quant.py)
Prints a table with ratios against bf16; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import synthetic_requests  # noqa: E402
from tandem import LLM, SamplingParams  # noqa: E402

VARIANTS: dict[str, dict] = {
    "bf16": {},
    "w4a16": {"quantization": "gptq"},
    "w4a16-triton": {"quantization": "gptq"},
    "w4a16-tinygemm": {"quantization": "gptq"},
    "w4a16-awq": {"quantization": "awq"},
    "w4a16-head": {},  # the quantization comes from config.json (CHECKPOINT_QC)
    "fp8": {"quantization": "fp8"},
    "w4a16-unfused": {"quantization": "gptq"},
    "fp8-unfused": {"quantization": "fp8"},
    "fp8-actq": {"quantization": "fp8"},
    "fp8-fastacc": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "bf16-sync": {},
    "w4a16-sync": {"quantization": "gptq"},
}


# Environment a variant is built under (read at load).
VARIANT_ENV: dict[str, dict[str, str]] = {"w4a16-triton": {"TANDEM_W4A16_KERNEL": "triton"},
                                          "w4a16-tinygemm": {"TANDEM_W4_GEMV": "0"},
                                          "w4a16-unfused": {"TANDEM_FUSED_QUANT": "0"},
                                          "fp8-unfused": {"TANDEM_FUSED_QUANT": "0"},
                                          "fp8-actq": {"TANDEM_FP8_FUSED_ACT": "0"},
                                          "fp8-fastacc": {"TANDEM_FP8_FAST_ACCUM": "1"},
                                          "bf16-sync": {"TANDEM_RANK_LAUNCH_AHEAD": "0"},
                                          "w4a16-sync": {"TANDEM_RANK_LAUNCH_AHEAD": "0"}}


# Variants whose quantization_config is written into (a copy of) the model's config.json, as a quantized
# checkpoint carries it, with the weights still dummy (quantized at load in that layout).
CHECKPOINT_QC: dict[str, dict] = {"w4a16-head": {"method": "gptq", "lm_head": True}}


def checkpoint_qc_folder(model: str, variant: str) -> str:
    """`model` for most variants; for a CHECKPOINT_QC one, a copy of its folder (no weights: shapes only) whose
    config.json carries the quantization_config the project's tool would write (group 128, or 64 / 32 where the
    shapes need it)."""
    spec = CHECKPOINT_QC.get(variant)
    if spec is None:
        return model
    from parallel.quant.rtn import Options

    dst = os.path.join(tempfile.mkdtemp(), f"{Path(model).name}-{variant}")
    shutil.copytree(model, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    cfg = json.loads(Path(dst, "config.json").read_text())
    opts = Options(spec["method"], bits=4, group_size=_group_size(cfg, spec["method"]), lm_head=spec["lm_head"])
    cfg["quantization_config"] = opts.quantization_config("tandem RTN (dummy weights)")
    Path(dst, "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _group_size(cfg: dict, method: str) -> int:
    """The group size `quantization=method` picks for dummy weights of these shapes."""
    from parallel.quant.config import effective_quant_config

    heads = cfg["num_attention_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return effective_quant_config(None, method, "dummy", (cfg["hidden_size"], cfg["intermediate_size"], heads))["group_size"]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def make_llm(args, model: str, variant: str, load_format: str, max_model_len: int | None = -1) -> LLM:
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    extra = {}
    if args.device.startswith("cuda"):
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.num_blocks:
        extra["num_gpu_blocks_override"] = args.num_blocks
    return LLM(model=model, device=args.device, dtype=dtype, load_format=load_format, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len if max_model_len == -1 else max_model_len,
               enable_prefix_caching=False, show_progress=False, **VARIANTS[variant], **extra)


def decode(llm: LLM, args, vocab: int) -> dict:
    """One request: prompt_len tokens, then gen_len greedy tokens; per-step wall time after the first token."""
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(16, vocab, (args.prompt_len,), generator=g).tolist()
    llm.generate([prompt[:16]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    eng.add_request("bench-decode", prompt, SamplingParams(max_tokens=args.gen_len + 1, temperature=0.0, ignore_eos=True))
    sync(args.device)
    eng.step()  # prefill + first token
    sync(args.device)
    # No sync between steps: with asynchronous scheduling (on a GPU, in-process too) the next steps are already queued
    # on the device when step() returns, as in `LLM.generate`; a sync there would drain them every step.
    steps, n = [], 0
    t0 = t = time.perf_counter()
    while eng.has_unfinished_requests():
        n += len(eng.step())
        now = time.perf_counter()
        steps.append(now - t)
        t = now
    sync(args.device)
    total = time.perf_counter() - t0
    res = {"decode_tok_per_s": n / total, "median_step_ms": 1e3 * statistics.median(steps), "gen_tokens": n,
           "ms_per_token": 1e3 * total / max(n, 1), "async_scheduling": bool(eng.async_scheduling)}
    # Whether the batch-1 graph was captured through the fused decoder (workers/models/fused_decode.py).
    res["fused_decode"] = bool(getattr(eng.executor.runner.model, "_fused_decode_ok", False))
    graphs = getattr(getattr(eng.executor, "runner", None), "cuda_graphs", None)
    if graphs is not None and 1 in graphs.graphs:  # GPU time of the captured batch-1 step alone
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graphs.graphs[1].replay()
        start.record()
        for _ in range(20):
            graphs.graphs[1].replay()
        end.record()
        end.synchronize()
        res["graph_replay_ms"] = start.elapsed_time(end) / 20
    return res


def offline(llm: LLM, args, vocab: int) -> dict:
    prompts, out_lens = synthetic_requests(args.num_requests, vocab, args.mean_input, args.mean_output,
                                           args.max_input, args.max_output, args.seed)
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in out_lens]
    llm.generate(prompts[:2], params[:2])
    sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(args.device)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {"seconds": dt, "requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out,
            "output_tok_per_s": n_out / dt, "total_tok_per_s": (n_in + n_out) / dt,
            "preemptions": llm.llm_engine.scheduler.num_preemptions}


def engine_facts(llm: LLM) -> dict:
    runner = llm.llm_engine.executor.runner
    facts = {"num_kv_blocks": runner.num_blocks, "kv_bytes_per_block": runner.kv_bytes_per_block(),
             "kv_dtype": str(runner.kv_cache.dtype).replace("torch.", ""), "cuda_graphs": runner.cuda_graphs is not None}
    layer = runner.model.layers[next(iter(runner.model.layers))].mlp.down_proj
    packed = getattr(layer, "packed", None)
    # What process_weights chose for down_proj (parallel/quant/base.py; the loader logs every layer's).
    facts["linear_kernel"] = getattr(layer, "linear_kernel", "plain") if layer.quantized else "plain"
    head = runner.model.lm_head
    facts["lm_head_kernel"] = getattr(head, "linear_kernel", "plain") if getattr(head, "quantized", False) else "plain"
    if getattr(layer, "tinygemm_skipped", None):
        facts["tinygemm_skipped"] = layer.tinygemm_skipped
    if getattr(layer, "gemv_weight", None) is not None:  # the fused batch-1 GEMV's tiles (fused_gemv.tune)
        facts["down_proj_gemv_tile"] = layer.gemv_weight.config
    elif getattr(layer, "gemv_skipped", None):
        facts["gemv_skipped"] = layer.gemv_skipped
    from parallel.quant import fused_gemv

    if fused_gemv.MEASURED:  # each weight shape's tile times at load (weights out of L2), and 4-bit vs tinygemm
        facts["gemv_tuning"] = list(fused_gemv.MEASURED)
        fused_gemv.MEASURED.clear()
    from parallel.quant import tinygemm

    if tinygemm.W4_MEASURED:  # one row: w4_mma's tile against tinygemm per weight shape, at load
        facts["w4_gemv_tuning"] = list(tinygemm.W4_MEASURED)
        tinygemm.W4_MEASURED.clear()
    if packed is not None:
        facts["down_proj_plan"] = packed.plan
        if getattr(packed, "kernel", None) == "tinygemm":
            facts["down_proj_dequant_rows"] = packed.dequant_rows
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    for m in runner.model.modules():
        pw = getattr(m, "packed", None)
        if pw is not None and hasattr(pw, "nbytes"):  # tinygemm's int4pack weight and its scales_and_zeros
            weight_bytes += pw.nbytes()
        elif pw is not None and pw.bits is not None:
            weight_bytes += sum(t.numel() * t.element_size() for t in (pw.codes, pw.scales, pw.zeros) if t is not None)
    facts["weight_gib"] = weight_bytes / 2**30
    return facts


def agreement_checkpoint(model: str, variant: str) -> str:
    """GPTQ / AWQ variants need a quantized checkpoint: a 4-bit RTN copy written by the project's tool
    (group size 128, or the largest of 64 / 32 that the model's features allow)."""
    spec = CHECKPOINT_QC.get(variant, {"method": VARIANTS[variant].get("quantization"), "lm_head": False})
    method = spec["method"]
    if method not in ("gptq", "awq"):
        return model
    from parallel.quant.rtn import Options
    from quantize import quantize_folder

    cfg = json.loads(Path(model, "config.json").read_text())
    dst = os.path.join(tempfile.mkdtemp(), f"{Path(model).name}-{variant}")
    quantize_folder(model, dst, Options(method, bits=4, group_size=_group_size(cfg, method), lm_head=spec["lm_head"]))
    return dst


def agreement(args) -> dict:
    """Greedy tokens of each variant vs bf16 on a real checkpoint, prompts cut from real text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.agreement_model)
    text = Path(args.agreement_text).read_text(encoding="utf-8")
    ids = tok(text)["input_ids"]
    prompts = [ids[i:i + args.agreement_prompt_len] for i in range(0, len(ids) - args.agreement_prompt_len, 97)]
    prompts = prompts[:args.agreement_prompts]
    sp = SamplingParams(max_tokens=args.agreement_gen_len, temperature=0.0, ignore_eos=True)
    outs = {}
    for variant in ["bf16"] + [v for v in args.variants if v != "bf16"]:
        try:
            with variant_env(variant):
                llm = make_llm(args, agreement_checkpoint(args.agreement_model, variant), variant, "auto", None)
        except ValueError as e:  # e.g. group size 128 vs a tiny model's features
            outs[variant] = str(e)
            continue
        outs[variant] = [o.token_ids for o in llm.generate(prompts, sp)]
        llm.shutdown()
        del llm
        free(args.device)
    base, res = outs["bf16"], {}
    for variant, got in outs.items():
        if variant == "bf16":
            continue
        if isinstance(got, str):
            res[variant] = {"skipped": got}
            continue
        same = sum(a == b for x, y in zip(base, got) for a, b in zip(x, y))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(base, got)]
        res[variant] = {"token_agreement": same / sum(len(x) for x in base), "identical_requests": sum(x == y for x, y in zip(base, got)),
                        "requests": len(base), "mean_tokens_before_first_divergence": statistics.mean(prefix)}
    return res


@contextlib.contextmanager
def variant_env(variant: str):
    saved = {k: os.environ.get(k) for k in VARIANT_ENV.get(variant, {})}
    os.environ.update(VARIANT_ENV.get(variant, {}))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_variant(args, model: str, vocab: int, variant: str) -> dict:
    t0 = time.perf_counter()
    with variant_env(variant):
        llm = make_llm(args, checkpoint_qc_folder(model, variant), variant, "dummy")
    res = {"load_s": time.perf_counter() - t0, **engine_facts(llm)}
    res["decode"] = decode(llm, args, vocab)
    if args.num_requests:
        res["offline"] = offline(llm, args, vocab)
    llm.shutdown()
    del llm
    free(args.device)
    return res


def ratios(results: dict) -> dict:
    base = results.get("bf16")
    if not base:
        return {}
    out = {}
    for v, r in results.items():
        if v == "bf16" or "decode" not in r:
            continue
        out[v] = {"decode_tok_per_s_x": r["decode"]["decode_tok_per_s"] / base["decode"]["decode_tok_per_s"],
                  "kv_blocks_x": r["num_kv_blocks"] / base["num_kv_blocks"]}
        if "graph_replay_ms" in r["decode"] and "graph_replay_ms" in base["decode"]:
            out[v]["graph_step_x"] = base["decode"]["graph_replay_ms"] / r["decode"]["graph_replay_ms"]
        if "offline" in r and "offline" in base:
            out[v]["offline_tok_per_s_x"] = r["offline"]["output_tok_per_s"] / base["offline"]["output_tok_per_s"]
    return out


def print_table(report: dict) -> None:
    print(f"\n{'variant':<14} {'kernel (down_proj)':<40} {'weights GiB':>11} {'KV blocks':>9} {'decode tok/s':>12} {'ms/token':>8} "
          f"{'step ms':>8} {'graph ms':>8} {'fused':>5} {'offline tok/s':>13}")
    for v, r in report["results"].items():
        if "error" in r:
            print(f"{v:<14} ERROR {r['error']}")
            continue
        d, o = r["decode"], r.get("offline", {})
        print(f"{v:<14} {r['linear_kernel'][:40]:<40} {r['weight_gib']:>11.2f} {r['num_kv_blocks']:>9} {d['decode_tok_per_s']:>12.1f} "
              f"{d['ms_per_token']:>8.2f} {d['median_step_ms']:>8.2f} {d.get('graph_replay_ms', float('nan')):>8.2f} "
              f"{'yes' if d['fused_decode'] else 'no':>5} {o.get('output_tok_per_s', float('nan')):>13.1f}")
    for v, r in report["results"].items():
        for m in r.get("gemv_tuning", []):
            if "tinygemm_us" in m:
                print(f"{v}: fused 4-bit GEMV {m['n']}x{m['k']} ({m['kind']}): {m['ours_us']:.1f} us, tinygemm "
                      f"{m['tinygemm_us']:.1f} us")
                continue
            print(f"{v}: fused GEMV {m['format']} {m['n']}x{m['k']} ({m['kind']}): {m['best_us']:.1f} us, "
                  f"{m['best_gb_per_s']:.0f} GB/s; tiles " + ", ".join(
                      f"{t['BLOCK_N']}/{t['KS']}/{t['num_warps']}w {t['us']:.1f}" for t in m["tiles"]))
    for v, r in report["ratios"].items():
        print(f"{v} vs bf16: " + ", ".join(f"{k} {x:.2f}" for k, x in r.items()))
    if report.get("agreement"):
        print("greedy agreement vs bf16:", json.dumps(report["agreement"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="a name in scripts/model_shapes.py (real shapes, dummy weights)")
    p.add_argument("--model", default=None, help="a model folder instead of --shape (its weights are not read)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="bf16,w4a16,fp8,fp8-kv", help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=1000, help="offline run (0: skip)")
    p.add_argument("--mean-input", type=int, default=256)
    p.add_argument("--mean-output", type=int, default=256)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks override (CPU dry runs)")
    p.add_argument("--agreement-model", default=None, help="a real checkpoint for greedy agreement vs bf16")
    p.add_argument("--agreement-text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    p.add_argument("--agreement-prompts", type=int, default=32)
    p.add_argument("--agreement-prompt-len", type=int, default=64)
    p.add_argument("--agreement-gen-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/bench_quant.json")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoConfig

    model = args.model
    if args.shape:
        from model_shapes import write_model_folder

        model = write_model_folder(args.shape, os.path.join(tempfile.mkdtemp(), args.shape))
    if model is None:
        raise SystemExit("give --shape or --model")
    vocab = AutoConfig.from_pretrained(model).vocab_size
    report = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
              "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()}, "results": {}}
    for variant in args.variants:
        print(f"--- {variant}", flush=True)
        try:
            report["results"][variant] = run_variant(args, model, vocab, variant)
        except Exception as e:  # one variant failing must not lose the others' numbers
            if args.device == "cpu":
                raise
            report["results"][variant] = {"error": f"{type(e).__name__}: {e}"}
            free(args.device)
        print(json.dumps(report["results"][variant]), flush=True)
        report["ratios"] = ratios(report["results"])
        write(report, args.out)  # after each variant: a run cut short keeps what it measured
    if args.agreement_model:
        report["agreement"] = agreement(args)
    print_table(report)
    write(report, args.out)
    return report


def write(report: dict, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
