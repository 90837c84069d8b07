"""Host (Python) time of an engine's mixed steps (decodes plus prefill chunks), and where it goes.

Issue 26: on 2 x H100 (Llama-3.1-8B shapes) a mixed step of ~250 sequences and ~900 tokens takes ~35 ms of
host wall time in `ModelRunner.execute` against 15-21 ms of GPU kernels, so the host's per-step Python
bounds it. This drives an in-process engine (one rank) through steps of that shape: many requests with
prompts of 100-400 tokens and outputs of 100-200, `max_num_seqs` 256 and `max_num_batched_tokens` 1024, so
that once the batch is full each step carries ~250 decodes and prefill chunks. Every step with a prefill
chunk and at least `--min-seqs` sequences is a "mixed" step: its `schedule` and `execute` are timed, and
cProfile runs over its `execute` (and, with --profile-schedule, its `schedule`).

    python scripts/profile_mixed_step_host.py --device cpu                          # shipped tiny model
    python scripts/profile_mixed_step_host.py --device cuda --shape llama-3.1-8b --dtype bfloat16 --top 40
        # real shapes, dummy weights (scripts/model_shapes.py); one rank in this process (TP=1)

On CPU the model's own math (matmuls, attention) shows up in the profile as torch calls, and attention runs the
torch backend (a per-sequence loop the GPU never runs); on a GPU those rows are kernel launches (Triton's
JITFunction.run, CUDAGraph.replay) and the wait for the step's tokens (the tensor's tolist). Look at the
pure-Python rows (per-sequence loops, list building, tensor creation). cProfile inflates the absolute times:
compare runs of this script with each other, not with scripts/bench_offline.py. A TP>1 engine runs its ranks
in Ray actors, out of this process's profiler: its host cost per step is close to TP=1's (issue 26).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_shapes

from engine.llm import LLM  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402


def is_mixed(out, min_seqs: int) -> bool:
    """A step with at least one prefill chunk (a sequence given more than one token) and enough sequences."""
    return len(out.seqs) >= min_seqs and any(s.num_tokens > 1 for s in out.seqs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict:
    """Drive the engine until `--steps` mixed steps have run; profile their execute (and schedule)."""
    extra = {"max_model_len": args.max_model_len}
    if args.device.startswith("cuda"):
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              show_progress=False, **extra)
    engine = llm.llm_engine
    runner = engine.executor.runner
    rng = random.Random(args.seed)
    vocab = 200  # token ids every model here knows
    for i in range(args.num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        params = SamplingParams(max_tokens=rng.randint(args.min_output, args.max_output), temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    prof_exec, prof_sched = cProfile.Profile(), cProfile.Profile()
    exec_ms: list[float] = []
    sched_ms: list[float] = []
    shapes: list[tuple[int, int]] = []
    execute, schedule = runner.execute, engine.scheduler.schedule
    last_sched = [0.0]
    warmup_left = [args.warmup]  # mixed steps still to run before profiling

    def timed_schedule(*a, **k):
        t = time.perf_counter()
        if args.profile_schedule and not args.no_profile:
            prof_sched.enable()
        out = schedule(*a, **k)
        if args.profile_schedule and not args.no_profile:
            prof_sched.disable()
        last_sched[0] = time.perf_counter() - t
        return out

    def timed_execute(out):
        if not is_mixed(out, args.min_seqs) or len(exec_ms) >= args.steps or warmup_left[0] > 0:
            if is_mixed(out, args.min_seqs):
                warmup_left[0] -= 1
            return execute(out)
        _sync(args.device)
        t = time.perf_counter()
        if not args.no_profile:
            prof_exec.enable()
        res = execute(out)
        _sync(args.device)  # the step's own output waits for the GPU anyway (sampled tokens)
        if not args.no_profile:
            prof_exec.disable()
        exec_ms.append(1e3 * (time.perf_counter() - t))
        sched_ms.append(1e3 * last_sched[0])
        shapes.append((len(out.seqs), out.num_tokens))
        return res

    runner.execute, engine.scheduler.schedule = timed_execute, timed_schedule
    t0 = time.perf_counter()
    while engine.has_unfinished_requests() and len(exec_ms) < args.steps:
        engine.step()
    wall = time.perf_counter() - t0
    for rid in [f"r{i}" for i in range(args.num_requests)]:
        engine.abort(rid)
    llm.shutdown()
    if not exec_ms:
        raise SystemExit("no mixed step ran: lower --min-seqs or raise --num-requests")
    return {"steps": len(exec_ms), "wall_s": wall, "exec_ms": exec_ms, "sched_ms": sched_ms, "shapes": shapes,
            "prof_exec": prof_exec, "prof_sched": prof_sched}


def report(res: dict, top: int, profile_schedule: bool, profiled: bool) -> str:
    n = res["steps"]
    seqs = statistics.mean(s for s, _ in res["shapes"])
    toks = statistics.mean(t for _, t in res["shapes"])
    lines = [f"mixed steps: {n} (mean {seqs:.0f} seqs, {toks:.0f} tokens)",
             f"execute ms/step: mean {statistics.mean(res['exec_ms']):.2f}  median {statistics.median(res['exec_ms']):.2f}"
             + ("  (cProfile on: inflated; --no-profile for plain host wall time)" if profiled else "  (no profiler)"),
             f"schedule ms/step: mean {statistics.mean(res['sched_ms']):.2f}"]
    if not profiled:
        return "\n".join(lines)
    for name, prof in [("execute", res["prof_exec"])] + ([("schedule", res["prof_sched"])] if profile_schedule else []):
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(top)
        lines.append(f"---- {name}: top {top} by tottime (totals over {n} steps; divide by {n} for per step)")
        lines.append(buf.getvalue())
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "models" / "tandem-tiny"))
    p.add_argument("--shape", default=None, help="a name in scripts/model_shapes.py: real shapes, dummy weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=200)
    p.add_argument("--min-seqs", type=int, default=200, help="a mixed step counts once it has this many sequences")
    p.add_argument("--warmup", type=int, default=3, help="mixed steps run before the profiled ones")
    p.add_argument("--steps", type=int, default=30, help="mixed steps profiled")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--profile-schedule", action="store_true", help="cProfile the scheduler's schedule too")
    p.add_argument("--no-profile", action="store_true", help="time the mixed steps without cProfile")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.shape:
        import os
        import tempfile

        from model_shapes import write_model_folder

        args.model = write_model_folder(args.shape, os.path.join(tempfile.mkdtemp(), args.shape))
        args.load_format = "dummy"
    print(report(run(args), args.top, args.profile_schedule, not args.no_profile))


if __name__ == "__main__":
    main()
