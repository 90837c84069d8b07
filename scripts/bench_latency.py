#!/usr/bin/env python3
"""Batch-1 decode latency against the HBM roofline, HF `generate` on the same GPU in the same run,
and prefill MFU at given prompt lengths.

Roofline: a decode step must read every weight once plus the KV cache of the context, so
    roofline tok/s = copy bandwidth / (weight bytes + KV bytes per step),
with the bandwidth of a large device-to-device copy (bytes read + written) measured in this run.
Two weight counts are reported: all parameters (as the usual 8B-model figures count them) and
the bytes a step really reads (the input embedding table is only gathered from, one row a token).

    python scripts/bench_latency.py --shape llama-3.1-8b                  # dummy weights, real shapes
    python scripts/bench_latency.py --model FOLDER --load-format auto     # a real checkpoint
Prints a table; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tandem import LLM, SamplingParams  # noqa: E402

H100_BF16_DENSE_TFLOPS = 989.4  # datasheet, SXM


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 30) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a.random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def free_cuda():
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- HF

def hf_decode(model_dir: str, prompt: list[int], gen: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt], device="cuda")

    def run(n):
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    run(4)  # warm-up
    t1 = min(run(1) for _ in range(2))
    tn = run(gen)
    del model
    free_cuda()
    return {"decode_tok_per_s": (gen - 1) / (tn - t1), "ttft_s": t1, "gen_tokens": gen}


# ---------------------------------------------------------------- Tandem

def make_llm(model_dir: str, mode: str, args, max_model_len: int, num_blocks: int, max_batched: int) -> LLM:
    """`mode` is a variant, optionally @executor: graphs, eager, torch, eager-loop-moe; graphs@ray runs the
    same engine through the Ray rank actors (the path of every multi-GPU layout), graphs@uni in-process;
    graphs@ray-async / graphs@ray-sync the rank actors with async_scheduling on / off (on is the default)."""
    mode, _, executor = mode.partition("@")
    asynchronous = not executor.endswith("-sync")
    executor = executor.removesuffix("-sync").removesuffix("-async")
    backend = "torch" if mode == "torch" else "triton"
    llm = LLM(model=model_dir, device="cuda", dtype="bfloat16", load_format=args.load_format, attention_backend=backend,
              enforce_eager=mode != "graphs", tensor_parallel_size=args.tensor_parallel_size,
              distributed_executor_backend=executor or "auto", max_model_len=max_model_len,
              num_gpu_blocks_override=num_blocks, block_size=16, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max_batched, enable_prefix_caching=False, show_progress=False,
              disable_p2p_all_reduce=args.disable_p2p_all_reduce, async_scheduling=asynchronous)
    if mode == "eager-loop-moe":
        from workers.models.moe import Experts

        for m in llm.llm_engine.executor.runner.model.modules():
            if isinstance(m, Experts):
                m.use_fused = False
    return llm


def tandem_decode(llm: LLM, prompt: list[int], gen: int, profile_every: int = 0) -> dict:
    eng = llm.llm_engine
    llm.generate([prompt[:32]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    profile = None
    if profile_every:
        from step_profile import StepProfile

        profile = StepProfile(eng, gpu_every=profile_every)
    eng.add_request("bench", prompt, SamplingParams(max_tokens=gen + 1, temperature=0.0, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    eng.step()  # prefill + first token
    ttft = time.perf_counter() - t0
    steps = []
    n = 0
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        n += len(eng.step())
        steps.append(time.perf_counter() - t)
    total = sum(steps)
    res = {"decode_tok_per_s": n / total, "median_step_ms": 1e3 * statistics.median(steps), "ttft_s": ttft, "gen_tokens": n}
    if profile is not None:
        res["step_profile"] = profile.summary()
        print(profile.table(), flush=True)
    runner = getattr(eng.executor, "runner", None)  # None under TP (the ranks are Ray actors)
    graphs = runner.cuda_graphs if runner is not None else None
    if graphs is not None:  # GPU time of the captured step (forward, LM head, greedy) alone: the rest of a step is host overhead
        g = graphs.graphs[1]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        end.synchronize()
        res["graph_replay_ms"] = start.elapsed_time(end) / 20
    elif hasattr(eng.executor, "workers"):  # Ray rank actors: do they replay decode graphs?
        import ray

        res["rank_cuda_graph_sizes"] = ray.get([w.cuda_graph_sizes.remote() for w in eng.executor.workers])
    return res


def tandem_prefill(llm: LLM, lengths: list[int], vocab: int, flops_fn, peak: float, matmul: float,
                   profile: bool = False) -> list[dict]:
    """Best of the last two of three prefills per length; with `profile`, a fourth under every rank's
    torch.profiler (workers/rank_profile.py), whose top kernels and ops go into the result."""
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        times = []
        for rep in range(3):  # the first compiles kernels for this size
            prompt = torch.randint(100, vocab, (n,), generator=g).tolist()
            eng.add_request(f"p{n}-{rep}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            sync()
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            sync()
            times.append(time.perf_counter() - t0)
        t = min(times[1:])
        fl = flops_fn(n)
        out.append({"tokens": n, "seconds": t, "tflops": fl / t / 1e12, "mfu_vs_datasheet": fl / t / (peak * 1e12),
                    "mfu_vs_measured_matmul": fl / t / (matmul * 1e12)})
    for n, r in zip(lengths, out) if profile else ():  # after every timed run: a profile stays on until replaced
        from step_profile import top_lines

        eng.executor.profile("start", 1)
        prompt = torch.randint(100, vocab, (n,), generator=g).tolist()
        eng.add_request(f"p{n}-profiled", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        r["rank_profile"] = ranks = eng.executor.profile("report")
        print(f"prefill {n} tokens, profiled:", *top_lines(ranks), sep="\n", flush=True)
    return out


def hf_meta_params(cfg) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters (HF names) on the meta device: sizes without memory, any layout."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return dict(model.named_parameters())


def model_bytes(params: dict[str, torch.Tensor], cfg) -> tuple[int, int]:
    """(all weight bytes, bytes a batch-1 decode step reads). For MoE both count only the k of E experts
    a token is routed to (the other experts' weights are not read)."""
    total = sum(p.numel() * p.element_size() for p in params.values())
    k = getattr(cfg, "num_experts_per_tok", None)
    if k:
        e = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        experts = sum(p.numel() * p.element_size() for n, p in params.items() if ".experts." in n)
        total = total - experts + experts * k // e
    emb = params["model.embed_tokens.weight"]
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    read = total - (0 if tied else emb.numel() * emb.element_size())
    return total, read


def linear_params(params: dict[str, torch.Tensor], cfg) -> int:
    """Parameters a prefill token multiplies through (not embedding, head, norms, router; k of E experts)."""
    n_lin = sum(p.numel() for name, p in params.items()
                if "embed_tokens" not in name and "lm_head" not in name and "norm" not in name and ".gate." not in name)
    moe_k = getattr(cfg, "num_experts_per_tok", None)
    if moe_k:
        n_exp = sum(p.numel() for name, p in params.items() if "experts" in name)
        n_lin = n_lin - n_exp + n_exp * moe_k // (getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    return n_lin


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", help="a name in scripts/model_shapes.py (dummy weights)")
    p.add_argument("--model", default=None, help="a model folder instead of --shape")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--modes", default="graphs,eager,torch", help="Tandem variants: graphs, eager, torch, eager-loop-moe; "
                   "append @uni, @ray, @ray-async or @ray-sync (async_scheduling on / off) for the executor (graphs@uni,graphs@ray compares them in one run)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="also the largest captured decode batch")
    p.add_argument("--no-fused-decode", action="store_true",
                   help="batch-1 graphs without the norm/SiLU/residual folded into the GEMVs (ablation); "
                        "TANDEM_PDL=0 likewise turns off programmatic dependent launch")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs Tandem shards over; the roofline then counts that many GPUs' bandwidth")
    p.add_argument("--prefill-lens", default="2048,8192")
    p.add_argument("--disable-p2p-all-reduce", action="store_true", help="TP: NCCL only, no one-shot P2P all-reduce")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N", help="per-rank step profile of the decode "
                   "run (scripts/step_profile.py), every N-th step under torch.profiler; slows that run")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=False,
                   help="run each --modes variant in a fresh process of this script (one engine per process, as users "
                        "run it); the JSON merges them")
    p.add_argument("--out", default="bench_results/bench_latency.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_latency needs a CUDA GPU")

    from model_shapes import write_model_folder
    from transformers import AutoConfig

    model_dir = args.model or write_model_folder(args.shape, os.path.join(tempfile.mkdtemp(), args.shape))
    cfg = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x]

    report = {"benchmark": "latency", "model": args.model or args.shape, "gpu": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "args": vars(args)}
    bw = copy_bandwidth()
    mm = matmul_tflops()
    report["copy_bandwidth_TBps"] = bw / 1e12
    report["matmul_bf16_tflops"] = mm
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s", flush=True)

    if not args.skip_hf:
        report["hf"] = hf_decode(model_dir, prompt, args.gen_len)
        print(f"HF generate: {report['hf']['decode_tok_per_s']:.1f} tok/s", flush=True)

    bench_tandem(args, model_dir, cfg, prompt, prefill_lens, report, bw, mm)
    print_summary(report, bw)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


def bench_tandem(args: argparse.Namespace, model_dir: str, cfg, prompt: list[int], prefill_lens: list[int], report: dict,
                 bw: float, mm: float) -> None:
    """Decode (and, for graphs, prefill) of each --modes variant into report["tandem"], with the roofline."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    max_len = max([args.prompt_len + args.gen_len + 64] + [n + 64 for n in prefill_lens])
    num_blocks = 2 * (-(-max_len // 16)) + 64
    if args.no_fused_decode:
        from workers.models.transformer import CausalLM

        CausalLM.fuse_decode = False
    report["pdl"] = os.environ.get("TANDEM_PDL", "1") != "0"
    report["tandem"] = {}
    params = hf_meta_params(cfg)
    tp = args.tensor_parallel_size
    for mode in [m for m in args.modes.split(",") if m]:
        if args.isolate:
            report["tandem"][mode] = run_isolated(mode, report)
            continue
        llm = make_llm(model_dir, mode, args, max_len, num_blocks, max(max(prefill_lens, default=0), 2048))
        if "weight_bytes" not in report:
            total, read = model_bytes(params, cfg)
            avg_ctx = args.prompt_len + args.gen_len / 2
            kv = kv_per_token * avg_ctx
            # Under TP each GPU streams its 1/tp of the bytes: the bandwidth that counts is tp GPUs'.
            report.update(weight_bytes=total, weight_bytes_read=read, kv_bytes_per_step=kv, tensor_parallel_size=tp,
                          roofline_tok_per_s=tp * bw / (total + kv), roofline_read_tok_per_s=tp * bw / (read + kv))
        r = tandem_decode(llm, prompt, args.gen_len, args.profile_steps)
        r["fraction_of_roofline"] = r["decode_tok_per_s"] / report["roofline_tok_per_s"]
        r["fraction_of_roofline_read"] = r["decode_tok_per_s"] / report["roofline_read_tok_per_s"]
        if mode.split("@")[0] == "graphs" and prefill_lens:
            n_lin = linear_params(params, cfg)
            attn = lambda n: 2 * n * n * head_dim * cfg.num_attention_heads * cfg.num_hidden_layers  # noqa: E731 causal QK^T + PV
            flops = lambda n: 2 * n_lin * n + attn(n) + 2 * cfg.vocab_size * cfg.hidden_size  # noqa: E731
            r["prefill"] = tandem_prefill(llm, prefill_lens, cfg.vocab_size, flops, tp * H100_BF16_DENSE_TFLOPS, tp * mm,
                                          profile=args.profile_steps > 0)
        report["tandem"][mode] = r
        print(f"tandem {mode}: {r['decode_tok_per_s']:.1f} tok/s ({100 * r['fraction_of_roofline']:.0f}% of roofline)", flush=True)
        llm.llm_engine.shutdown()
        del llm
        free_cuda()


def run_isolated(mode: str, report: dict) -> dict:
    """One --modes variant in a child process with the same arguments; copies its roofline facts into `report`."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--no-isolate", "--modes", mode, "--skip-hf",
               "--out", out]
        code = subprocess.run(cmd).returncode
        if not os.path.exists(out):  # a child that wrote its JSON and then failed to exit cleanly still counts
            raise RuntimeError(f"the isolated run {mode!r} failed (exit code {code})")
        if code:
            print(f"warning: the isolated run exited with code {code} after writing its result", file=sys.stderr)
        with open(out) as f:
            child = json.load(f)
    for key in ("weight_bytes", "weight_bytes_read", "kv_bytes_per_step", "tensor_parallel_size", "roofline_tok_per_s",
                "roofline_read_tok_per_s"):
        report.setdefault(key, child[key])
    return child["tandem"][mode]


def print_summary(report: dict, bw: float) -> None:
    print(f"\n{report['gpu']}  copy {bw / 1e12:.2f} TB/s  weights {report['weight_bytes'] / 1e9:.2f} GB "
          f"(read per step {report['weight_bytes_read'] / 1e9:.2f} GB)  KV/step {report['kv_bytes_per_step'] / 1e6:.1f} MB")
    print(f"roofline: {report['roofline_tok_per_s']:.1f} tok/s (all weights), {report['roofline_read_tok_per_s']:.1f} (bytes read)")
    print(f"{'engine':16} {'tok/s':>8} {'% roofline':>11} {'% (read)':>9} {'step ms':>8} {'graph ms':>9}")
    if "hf" in report:
        h = report["hf"]
        print(f"{'HF generate':16} {h['decode_tok_per_s']:8.1f} {100 * h['decode_tok_per_s'] / report['roofline_tok_per_s']:10.1f}% "
              f"{100 * h['decode_tok_per_s'] / report['roofline_read_tok_per_s']:8.1f}%")
    for mode, r in report["tandem"].items():
        print(f"{'tandem ' + mode:16} {r['decode_tok_per_s']:8.1f} {100 * r['fraction_of_roofline']:10.1f}% "
              f"{100 * r['fraction_of_roofline_read']:8.1f}% {r['median_step_ms']:8.2f} {r.get('graph_replay_ms', float('nan')):9.2f}")
        for pr in r.get("prefill", []):
            print(f"  prefill {pr['tokens']:5d} tok: {1e3 * pr['seconds']:.1f} ms, {pr['tflops']:.0f} TFLOP/s, "
                  f"MFU {100 * pr['mfu_vs_datasheet']:.1f}% of {H100_BF16_DENSE_TFLOPS:.0f} ({100 * pr['mfu_vs_measured_matmul']:.1f}% of measured matmul)")


if __name__ == "__main__":
    main()
