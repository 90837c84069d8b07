"""Speculative decoding on one device: verification-step cost for k = 1..K vs a plain decode step, n-gram
speculation at batch 1 on a code-editing workload, emulated acceptance rates, and batch 32 / 128 with the
batch-size policy on and off. One engine, speculation switched per measurement (same weights, same cache).

    python scripts/model_shapes.py llama-3.1-8b /tmp/m8b
    python scripts/bench_spec_decode.py --model /tmp/m8b --load-format dummy --device cuda --out /tmp/spec
    python scripts/bench_spec_decode.py --model models/tandem-tiny --device cpu --dry-run --out /tmp/spec   # CPU

Sections of OUT.json:
  step_cost: milliseconds of one step at batch B: a plain decode (k = 0, as served: CUDA graphs where
      captured) and a verification of k drafts (k + 1 tokens per sequence), with the speedup each k implies
      at acceptance rate a: E[tokens per step] * t(decode) / t(k), E = (1 - a^(k+1)) / (1 - a). At k = --eager-k
      also the same step eagerly (`K_eager`) and graphed with the prefill kernel's attention (`K_prefill_attention`,
      what verification ran before parallel/kernels/verify_attention.py).
  ngram_batch1: the code-editing prompt (a file, an instruction, the file's start again: the answer repeats
      the file with small edits): tokens/s plain vs n-gram speculation, and the measured acceptance. With
      dummy weights the model does not copy; `emulated` replaces the proposer by one that knows the plain
      greedy output and proposes each of its tokens right with probability a (wrong tokens are rejected as
      any would), so tokens/s at a controlled acceptance is measured end to end. Each run also gives its engine
      steps, tokens per step and ms per step (plain: `plain`), and on GPUs `ngram_prefill_attention` repeats
      the n-gram runs with the prefill kernel's attention in the verification graph (the old path).
  batch: tokens/s at batch 32 and 128 (as `--batch-sizes`), plain vs speculation under the default policy
      (off at disable_by_batch_size or more running sequences) vs forced on.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem import LLM, SamplingParams  # noqa: E402
from engine.spec_decode import SpecDecoder  # noqa: E402
from workers.scheduler_output import ScheduledSeq, SchedulerOutput  # noqa: E402
from workers.spec_decode.config import SpeculativeConfig  # noqa: E402
from workers.spec_decode.graphs import VerifyGraphs  # noqa: E402

try:
    from parallel.kernels import verify_attention
except ImportError:  # no Triton (CPU): verification attention is the torch backend's
    verify_attention = None

NEVER = 1 << 30


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def code_editing_prompt(tokenizer, vocab: int, n_file: int, seed: int = 0) -> list[int]:
    """[file] [instruction] [file's first lines]: a real tokenizer gets source text; a synthetic one (dummy
    shapes) gets n_file random ids as the "file"."""
    file_text = "\n".join(
        f"def handler_{i}(request, retries={i % 4}):\n    value = request.get('field_{i}')\n"
        f"    if value is None:\n        return default_{i % 7}(request)\n    return transform(value, {i})\n"
        for i in range(400))
    ids = tokenizer.encode(file_text)
    if len(set(ids)) < 50:  # a synthetic word tokenizer: no real text
        g = random.Random(seed)
        ids = [g.randrange(10, vocab) for _ in range(n_file)]
        return ids + ids[:8] + ids[:n_file // 8]
    ids = ids[:n_file]
    instruction = tokenizer.encode("\n# Rewrite the module above, renaming `request` to `req`:\n")
    return ids + instruction + ids[: n_file // 8]


def verification_graphs(eng) -> dict | None:
    graphs = getattr(getattr(eng.executor, "runner", None), "verify_graphs", None)
    return None if graphs is None else {"tokens_per_sequence": graphs.q, "batch_sizes": graphs.batch_sizes}


def set_spec(llm: LLM, spec: SpecDecoder | None, batch_limit: int | None = None) -> None:
    """Swap the engine's speculation: None = plain decoding."""
    llm.llm_engine.spec_decoder = spec
    if spec is not None and batch_limit is not None:
        spec.batch_limit = batch_limit


def ngram_decoder(llm: LLM, k: int) -> SpecDecoder:
    eng = llm.llm_engine
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4)
    return SpecDecoder(eng.config, cfg, eng.block_manager.num_blocks, eng.max_model_len, eng.eos_token_ids)


class StepCounter:
    """Counts the steps the engine sends (wraps its executor's submit): with the tokens, a run's tokens per
    step and milliseconds per step, which separate a change of step cost from a change of acceptance (on
    random weights any change of kernel numerics changes the greedy text, hence what n-gram finds)."""

    def __init__(self, llm: LLM):
        self.executor = llm.llm_engine.executor
        self.steps = 0
        inner = self.executor.submit

        def counted(*args, **kwargs):
            self.steps += 1
            return inner(*args, **kwargs)

        self.executor.submit = counted

    def take(self) -> int:
        n, self.steps = self.steps, 0
        return n


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def per_step(seconds: float, tokens: int, steps: int) -> dict:
    return {"steps": steps, "tokens_per_step": round(tokens / max(1, steps), 3),
            "ms_per_step": round(1e3 * seconds / max(1, steps), 3)}


def spec_counts(spec: SpecDecoder | None) -> dict:
    if spec is None:
        return {}
    m = spec.metrics()
    return {"acceptance": round(m["spec_decode_acceptance_rate"], 4),
            "mean_accepted_length": round(m["spec_decode_mean_accepted_length"], 3),
            "accepted_per_pos": m["spec_decode_num_accepted_tokens_per_pos"],
            "drafts": m["spec_decode_num_drafts"], "steps_without_speculation": m["spec_decode_num_steps_disabled"]}


@contextlib.contextmanager
def prefill_attention_for_verification() -> Iterator[None]:
    """Graphs captured inside run verification's attention on the prefill kernel, as before the split-context
    kernel (parallel/kernels/verify_attention.py): that change's baseline, in the same run."""
    saved = verify_attention.applies
    verify_attention.applies = lambda *args: False
    try:
        yield
    finally:
        verify_attention.applies = saved


# ---- step cost ----
def time_step(runner, step: SchedulerOutput, args) -> float:
    """Median milliseconds of runner.execute(step)."""
    for _ in range(args.warmup):
        runner.execute(step)
    sync(args.device)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        runner.execute(step)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def step_cost(llm: LLM, args) -> dict:
    """Per k, verification graphs for exactly k + 1 tokens per sequence (as an engine with
    num_speculative_tokens = k captures them), at each batch size; k = 0 is the plain decode step."""
    runner = llm.llm_engine.executor.runner
    bs = llm.llm_engine.block_manager.block_size
    ctx = args.context
    nb = -(-(ctx + args.max_k + 1) // bs)
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    sizes = [b for b in args.step_batch_sizes if b * nb <= runner.num_blocks]
    ms: dict[str, dict[str, float]] = {str(b): {} for b in sizes}
    engine_graphs = runner.verify_graphs
    try:
        for k in range(0, args.max_k + 1):
            runner.verify_graphs = VerifyGraphs(runner, k + 1, sizes) if k and runner.cuda_graphs is not None else None
            baseline = None
            if k == args.eager_k and runner.cuda_graphs is not None:
                with prefill_attention_for_verification():
                    baseline = VerifyGraphs(runner, k + 1, sizes)
            for b in sizes:
                seqs = [ScheduledSeq(f"b{i}", [11] * (k + 1), ctx, list(range(i * nb, (i + 1) * nb)), True, greedy, 5,
                                     spec_token_ids=[11] * k) for i in range(b)]
                ms[str(b)][str(k)] = time_step(runner, SchedulerOutput(seqs), args)
                if k == args.eager_k and runner.cuda_graphs is not None:  # the same step without graphs
                    saved, runner.verify_graphs = runner.verify_graphs, None
                    ms[str(b)][f"{k}_eager"] = time_step(runner, SchedulerOutput(seqs), args)
                    runner.verify_graphs = baseline
                    ms[str(b)][f"{k}_prefill_attention"] = time_step(runner, SchedulerOutput(seqs), args)
                    runner.verify_graphs = saved
    finally:
        runner.verify_graphs = engine_graphs
    out: dict = {}
    for b in sizes:
        row = ms[str(b)]
        t0_ms = row["0"]
        implied = {}
        for a in (0.5, 0.6, 0.7, 0.8, 0.9):
            best = max(range(1, args.max_k + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) * t0_ms / row[str(k)])
            implied[str(a)] = {"best_k": best,
                               "speedup": round((1 - a ** (best + 1)) / (1 - a) * t0_ms / row[str(best)], 3)}
        out[str(b)] = {"ms": row, "ratio_to_decode": {k: round(v / t0_ms, 3) for k, v in row.items()},
                       "implied_speedup": implied}
        print(f"step cost batch {b}: " + ", ".join(f"k={k} {v} ms" for k, v in row.items()), flush=True)
    for b in args.step_batch_sizes:
        if b not in sizes:
            out[str(b)] = {"error": f"needs {b * nb} KV blocks, the cache has {runner.num_blocks}"}
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two runs' greedy outputs agree: identical sequences, and the mean share of tokens before
    the first difference (bf16 kernels of another shape can flip a near-tie; fp32 CPU runs are exact)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / max(1, len(x)) for x, y in zip(a, b)]
    return {"identical": f"{same}/{len(a)}", "mean_common_prefix": round(sum(prefix) / len(prefix), 3)}


# ---- batch 1 ----
class OracleProposer:
    """Proposes the plain greedy continuation, each token right with probability `a` (else a wrong id)."""

    def __init__(self, spec: SpecDecoder, reference: dict[str, list[int]], prompts: dict[str, int], a: float, vocab: int):
        self.spec, self.reference, self.a, self.vocab = spec, reference, a, vocab
        self.rng = random.Random(0)

    def __call__(self, out: SchedulerOutput, seqs) -> None:
        for s in out.seqs:
            if s.num_lookahead <= 0:
                continue
            seq = seqs[s.seq_id]
            ref = self.reference[s.seq_id]
            n = seq.num_output_tokens
            drafts = []
            for tok in ref[n:n + s.num_lookahead]:
                drafts.append(tok if self.rng.random() < self.a else (tok + 1) % self.vocab)
            s.spec_token_ids = drafts
            s.token_ids = s.token_ids + drafts


def run_ids(llm: LLM, prompts: list[list[int]], max_tokens: int, device: str, ids: list[str]) -> tuple[float, dict]:
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    done: dict[str, list[int]] = {}
    sync(device)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    sync(device)
    eng.drain()
    return time.perf_counter() - t0, done


def batch1(llm: LLM, prompt: list[int], args) -> dict:
    n = args.new_tokens
    set_spec(llm, None)
    counter = StepCounter(llm)
    generate(llm, [prompt], 8, args.device)  # warm-up (and the prompt's blocks into the prefix cache)
    counter.take()
    t_plain, ref = generate(llm, [prompt], n, args.device)
    plain_steps = per_step(t_plain, n, counter.take())
    res = {"prompt_tokens": len(prompt), "new_tokens": n, "plain_tok_s": round(n / t_plain, 2), "plain": plain_steps,
           "ngram": {}, "emulated": {}}
    for k in args.ngram_k:
        spec = ngram_decoder(llm, k)
        set_spec(llm, spec, NEVER)
        t, outs = generate(llm, [prompt], n, args.device)
        steps = per_step(t, n, counter.take())
        res["ngram"][str(k)] = {"tok_s": round(n / t, 2), "speedup": round(t_plain / t, 3), **spec_counts(spec),
                                **steps, "agreement": agreement(ref, outs)}
        print(f"batch 1 n-gram k={k}: {n / t:.1f} tok/s vs {n / t_plain:.1f} plain ({t_plain / t:.2f}x), "
              f"acceptance {res['ngram'][str(k)]['acceptance']}, {steps['tokens_per_step']} tokens per step, "
              f"{steps['ms_per_step']} ms per step vs {plain_steps['ms_per_step']} plain", flush=True)
    runner = getattr(llm.llm_engine.executor, "runner", None)
    if runner is not None and runner.verify_graphs is not None:  # the same runs with the old verification attention
        res["ngram_prefill_attention"] = {}
        engine_graphs = runner.verify_graphs
        with prefill_attention_for_verification():
            runner.verify_graphs = VerifyGraphs(runner, engine_graphs.q, [1])
        try:
            for k in args.ngram_k:
                spec = ngram_decoder(llm, k)
                set_spec(llm, spec, NEVER)
                t, outs = generate(llm, [prompt], n, args.device)
                steps = per_step(t, n, counter.take())
                res["ngram_prefill_attention"][str(k)] = {"tok_s": round(n / t, 2), "speedup": round(t_plain / t, 3),
                                                          **spec_counts(spec), **steps, "agreement": agreement(ref, outs)}
                print(f"batch 1 n-gram k={k}, prefill-kernel attention: {n / t:.1f} tok/s ({t_plain / t:.2f}x), "
                      f"{steps['tokens_per_step']} tokens per step, {steps['ms_per_step']} ms per step", flush=True)
        finally:
            runner.verify_graphs = engine_graphs
    k = args.emulate_k
    for a in args.acceptance:
        spec = ngram_decoder(llm, k)
        set_spec(llm, spec, NEVER)
        rid = f"emu-{a}"
        spec.propose = OracleProposer(spec, {rid: ref[0]}, {}, a, llm.llm_engine.vocab_size)
        t, outs = run_ids(llm, [prompt], n, args.device, [rid])
        res["emulated"][str(a)] = {"k": k, "tok_s": round(n / t, 2), "speedup": round(t_plain / t, 3), **spec_counts(spec),
                                   "agreement": agreement(ref, [outs[rid]])}
        print(f"batch 1 emulated a={a} k={k}: {n / t:.1f} tok/s ({t_plain / t:.2f}x), measured acceptance "
              f"{res['emulated'][str(a)]['acceptance']}", flush=True)
    set_spec(llm, None)
    return res


def draft_batch1(llm: LLM, prompt: list[int], args) -> dict:
    """Batch 1 with a draft model (`--draft`), against this engine's plain decoding: tokens/s, acceptance."""
    n = args.new_tokens
    set_spec(llm, None)
    t_plain, ref = generate(llm, [prompt], n, args.device)
    res = {"draft": args.draft, "plain_tok_s": round(n / t_plain, 2)}
    for k in args.ngram_k:
        spec_llm = LLM(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                       max_num_seqs=4, max_model_len=llm.llm_engine.max_model_len, show_progress=False,
                       speculative_config={"model": args.draft, "num_speculative_tokens": k})
        generate(spec_llm, [prompt], 8, args.device)
        t, outs = generate(spec_llm, [prompt], n, args.device)
        spec = spec_llm.llm_engine.spec_decoder
        res[str(k)] = {"tok_s": round(n / t, 2), "speedup": round(t_plain / t, 3), **spec_counts(spec),
                       "agreement": agreement(ref, outs)}
        print(f"batch 1 draft k={k}: {n / t:.1f} tok/s ({t_plain / t:.2f}x), acceptance {res[str(k)]['acceptance']}",
              flush=True)
        spec_llm.shutdown()
    return res


NATURAL_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "class LRUCache:\n    def __init__(self, capacity):",
                   "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(", "# Read a CSV file and sum a column\nimport csv\n",
                   "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"", "with open(path) as f:\n    for line in f:",
                   "class Stack:\n    \"\"\"A LIFO stack.\"\"\"\n"]


def draft_natural(llm: LLM, args) -> dict:
    """Plain vs draft model vs n-gram on ordinary code-completion prompts (no repeated context), one at a
    time (batch 1) and all together: what a real draft's acceptance buys."""
    n = args.new_tokens
    prompts = [llm.llm_engine.tokenizer.encode(p) for p in NATURAL_PROMPTS]

    def timed(engine: LLM) -> tuple[float, float, list[list[int]]]:
        generate(engine, prompts[:1], 4, args.device)  # warm-up
        t1 = sum(generate(engine, [p], n, args.device)[0] for p in prompts)
        tb, outs = generate(engine, prompts, n, args.device)
        return t1, tb, outs

    set_spec(llm, None)
    t1_plain, tb_plain, ref = timed(llm)
    total = n * len(prompts)
    res = {"prompts": len(prompts), "new_tokens": n, "plain": {"batch1_tok_s": round(total / t1_plain, 1),
                                                             "batched_tok_s": round(total / tb_plain, 1)}}
    for k in args.ngram_k:
        candidates = [("ngram", None, ngram_decoder(llm, k))]
        if args.draft:
            candidates.append(("draft", LLM(model=args.model, device=args.device, dtype=args.dtype, show_progress=False,
                                            load_format=args.load_format, max_num_seqs=len(prompts),
                                            max_model_len=llm.llm_engine.max_model_len,
                                            speculative_config={"model": args.draft, "num_speculative_tokens": k}), None))
        for name, engine, spec in candidates:
            if engine is None:
                set_spec(llm, spec)  # the default batch-size policy, as the draft engine has it
                engine = llm
            spec = engine.llm_engine.spec_decoder
            t1, tb, outs = timed(engine)
            res[f"{name}_k{k}"] = {"batch1_tok_s": round(total / t1, 1), "batch1_speedup": round(t1_plain / t1, 3),
                                   "batched_tok_s": round(total / tb, 1), "batched_speedup": round(tb_plain / tb, 3),
                                   **spec_counts(spec), "agreement": agreement(ref, outs)}
            print(f"natural prompts {name} k={k}: batch 1 {t1_plain / t1:.2f}x, batched {tb_plain / tb:.2f}x, "
                  f"acceptance {res[f'{name}_k{k}']['acceptance']}", flush=True)
            if engine is not llm:
                engine.shutdown()
        set_spec(llm, None)
    return res


def batches(llm: LLM, prompt: list[int], args) -> dict:
    out = {}
    n = args.batch_new_tokens
    k = args.batch_k
    for b in args.batch_sizes:
        # each sequence its own copy of the workload (distinct first token: no shared prefix beyond it)
        prompts = [[10 + i % 50] + prompt[1:] for i in range(b)]
        set_spec(llm, None)
        # every prompt in the prefix cache first, so no timed run pays prefill the others skip
        generate(llm, prompts, 2, args.device)
        t_plain, ref = generate(llm, prompts, n, args.device)
        row = {"plain_tok_s": round(b * n / t_plain, 1)}
        for name, limit in (("policy", None), ("forced_on", NEVER)):
            spec = ngram_decoder(llm, k)
            set_spec(llm, spec, limit)
            t, outs = generate(llm, prompts, n, args.device)
            row[name] = {"k": k, "batch_size_limit": spec.batch_limit, "tok_s": round(b * n / t, 1),
                         "vs_plain": round(t_plain / t, 3), **spec_counts(spec), "agreement": agreement(ref, outs)}
        set_spec(llm, None)
        out[str(b)] = row
        print(f"batch {b}: plain {row['plain_tok_s']} tok/s, policy {row['policy']['tok_s']} "
              f"({row['policy']['vs_plain']}x), forced on {row['forced_on']['tok_s']} ({row['forced_on']['vs_plain']}x)",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "tandem-tiny"))
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--eager-k", type=int, default=4, help="also time this k's verification without CUDA graphs")
    ap.add_argument("--context", type=int, default=1024, help="KV context of the step-cost sequences")
    ap.add_argument("--step-batch-sizes", default="1,32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--file-tokens", type=int, default=1500, help="the code-editing prompt's file length")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--ngram-k", default="3,5")
    ap.add_argument("--emulate-k", type=int, default=5)
    ap.add_argument("--acceptance", default="0.6,0.8,0.9")
    ap.add_argument("--batch-sizes", default="32,128")
    ap.add_argument("--batch-k", type=int, default=4)
    ap.add_argument("--batch-new-tokens", type=int, default=64)
    ap.add_argument("--sections", default="step_cost,ngram_batch1,batch",
                    help="any of step_cost, ngram_batch1, batch, draft_batch1 (needs --draft), draft_natural")
    ap.add_argument("--draft", default=None, help="draft model folder for draft_batch1")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes (CPU tests)")
    ap.add_argument("--out", default="spec_decode")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.max_k, args.context, args.iters, args.warmup, args.eager_k = 2, 32, 2, 1, 1
        args.step_batch_sizes, args.file_tokens, args.new_tokens = "1,2", 120, 12
        args.ngram_k, args.acceptance, args.emulate_k, args.batch_sizes, args.batch_new_tokens = "2", "0.8", 2, "3", 6
    args.step_batch_sizes = [int(x) for x in args.step_batch_sizes.split(",")]
    args.ngram_k = [int(x) for x in args.ngram_k.split(",")]
    args.acceptance = [float(x) for x in args.acceptance.split(",")]
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    sections = args.sections.split(",")

    max_batch = max(args.batch_sizes + args.step_batch_sizes + [len(NATURAL_PROMPTS)])
    from workers.loader import load_hf_config

    limit = getattr(load_hf_config(args.model), "max_position_embeddings", 1 << 20)
    # the code-editing prompt is about 1.12 x the file; keep prompt + output inside the model's positions
    args.file_tokens = max(32, min(args.file_tokens, int((limit - args.new_tokens - 64) / 1.2)))
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * (args.max_k + 1)),
              max_model_len=min(limit, args.file_tokens * 2 + args.new_tokens + 256), show_progress=False,
              # The engine's own verification graphs: q = the largest k the runs below use, at every batch size
              # (the SpecDecoders swapped in per run carry their own policies).
              speculative_config={"method": "ngram", "disable_by_batch_size": max_batch + 1,
                                  "num_speculative_tokens": max(args.ngram_k + [args.emulate_k, args.batch_k])})
    eng = llm.llm_engine
    prompt = code_editing_prompt(eng.tokenizer, eng.vocab_size, args.file_tokens)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"model": args.model, "load_format": args.load_format, "device": device_name,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:] if argv is None else argv,
              "dtype": str(eng.executor.runner.dtype) if hasattr(eng.executor, "runner") else args.dtype,
              # whether the engine's verification steps replay CUDA graphs (None: they run eagerly, about 3x a
              # decode step on an H100; the start-up log says why), and the rows GEMV's setting
              "verification_graphs": verification_graphs(eng), "gemv_rows": os.environ.get("TANDEM_GEMV_ROWS", "1")}
    print(f"{device_name}: verification graphs {report['verification_graphs']}, TANDEM_GEMV_ROWS={report['gemv_rows']}",
          flush=True)
    path = Path(args.out).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = {"step_cost": lambda: step_cost(llm, args), "ngram_batch1": lambda: batch1(llm, prompt, args),
            "batch": lambda: batches(llm, prompt[: min(len(prompt), 512)], args),
            "draft_batch1": lambda: draft_batch1(llm, prompt, args), "draft_natural": lambda: draft_natural(llm, args)}
    failed = False
    for name in sections:
        try:
            report[name] = runs[name]()
        except Exception as e:  # noqa: BLE001 - recorded, and the other sections still run
            if args.dry_run:
                raise
            failed = True
            report[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(f"{name} failed: {report[name]['error']}", flush=True)
            set_spec(llm, None)
        path.write_text(json.dumps(report, indent=1))  # after every section: a later failure keeps the rest
    print(f"wrote {path}")
    llm.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
