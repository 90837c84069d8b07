#!/usr/bin/env python3
"""Kernel-time breakdown of one decode step (CUDA graph replays under torch.profiler).

    python scripts/profile_decode.py --shape llama-3.1-8b                       # batch 1
    python scripts/profile_decode.py --shape llama-3.1-8b --batch 128 --context 400
    python scripts/profile_decode.py --shape llama-3.1-8b --verify-k 4 --context 1024   # a verification step (k + 1 tokens)
    python scripts/profile_decode.py --quantization gptq --lm-head --timeline 40   # 4-bit, the LM head too; the step's
                                                                                   # last 40 kernels in order, with gaps
    python scripts/profile_decode.py --quantization gptq --lm-head --engine-steps 30 --timeline 40
        # also the engine's own decode loop (LLMEngine.step, steps launched ahead): its step period against the
        # graph replay, and what the GPU runs between two replays
Prints the kernels that take the most GPU time per step, grouped by name.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tandem import LLM, SamplingParams  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=18, help="kernel names listed")
    p.add_argument("--batch", type=int, default=1, help="decoding sequences (a captured graph size)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--verify-k", type=int, default=0,
                   help="profile the speculative verification graph of k drafts per sequence instead")
    p.add_argument("--quantization", default=None, help="e.g. gptq (W4A16) or fp8: the dummy weights in that layout")
    p.add_argument("--lm-head", action="store_true",
                   help="with --quantization gptq: config.json says lm_head: true, so the LM head is 4-bit too")
    p.add_argument("--timeline", type=int, default=0,
                   help="also list the last N kernels of the final replay in order: start, duration, gap before")
    p.add_argument("--engine-steps", type=int, default=0,
                   help="also profile this many batch-1 steps of the engine's own decode loop (with --timeline: the "
                        "loop's last kernels and copies, what runs between two replays)")
    p.add_argument("--out", default="bench_results/profile_decode.txt")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode needs a CUDA GPU: it profiles the replays of a decode CUDA graph")
    from model_shapes import write_model_folder

    path = write_model_folder(a.shape, os.path.join(tempfile.mkdtemp(), a.shape))
    quantization = a.quantization
    if a.lm_head:
        if a.quantization != "gptq":
            sys.exit("--lm-head goes with --quantization gptq")
        from bench_quant import checkpoint_qc_folder

        quantization = None  # from config.json, as a GPTQModel checkpoint with lm_head: true says it
        path = checkpoint_qc_folder(path, "w4a16-head")
    per_seq = -(-(a.context + 64) // 16)
    llm = LLM(model=path, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=max(1024, a.context + 64),
              num_gpu_blocks_override=a.batch * per_seq + 64, max_num_seqs=max(4, a.batch), show_progress=False,
              quantization=quantization)
    eng = llm.llm_engine
    runner = getattr(eng, "runner", None) or eng.executor.runner
    prompts = [[100 + (i * 7 + j) % 1000 for j in range(a.context)] for i in range(a.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # fills the graph inputs
    g = runner.cuda_graphs.graphs[a.batch]
    what = "decode step"
    if a.verify_k:  # the graph workers/spec_decode/graphs.py replays, inputs as a k-draft step at this context
        from workers.scheduler_output import ScheduledSeq, SchedulerOutput
        from workers.spec_decode.graphs import VerifyGraphs

        k, nb = a.verify_k, -(-(a.context + a.verify_k + 1) // runner.block_size)
        verify = VerifyGraphs(runner, k + 1, [a.batch])
        seqs = [ScheduledSeq(f"v{i}", [11] * (k + 1), a.context, list(range(i * nb, (i + 1) * nb)), True,
                             SamplingParams(temperature=0.0, max_tokens=1 << 20), 5, spec_token_ids=[11] * k)
                for i in range(a.batch)]
        verify.run(SchedulerOutput(seqs))
        g, what = verify.graphs[a.batch], f"verification step (k = {k}, {k + 1} tokens a sequence)"
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows[ev.key] = (t / a.steps, ev.count / a.steps)
    total = sum(t for t, _ in rows.values())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.steps):
        g.replay()
    end.record()
    end.synchronize()
    wall = start.elapsed_time(end) / a.steps  # kernels plus the gaps between them
    lines = [f"GPU time per {what} (graph replay, batch {a.batch}, context {a.context}, {a.shape}, "
             f"{a.quantization or 'unquantized'}): {total / 1e3:.3f} ms in {sum(c for _, c in rows.values()):.0f} kernels, "
             f"{wall:.3f} ms replay wall"]
    for name, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:a.top]:
        lines.append(f"{t / 1e3:8.3f} ms {100 * t / total:5.1f}%  x{c:5.0f}  {name[:110]}")
    if a.timeline:
        lines += timeline(prof, a.timeline)
    if a.engine_steps:
        lines += engine_loop(eng, a.engine_steps, a.context, a.timeline, wall)
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text + "\n")


def engine_loop(eng, steps: int, context: int, n_timeline: int, replay_ms: float) -> list[str]:
    """`steps` decode steps of one request through LLMEngine.step under the profiler: the period between the ends
    of successive steps' greedy kernels (the last kernel of a step with the head in its graph) against the graph's
    replay wall, and (n_timeline) the loop's last GPU operations, copies included."""
    from torch.profiler import ProfilerActivity, profile

    eng.add_request("profiled-loop", [100 + j % 1000 for j in range(context)],
                    SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # the prefill, then steps in flight as in a steady loop
        eng.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    ends = sorted(ev.time_range.end for ev in prof.events() if "greedy" in ev.name and ev.time_range.elapsed_us() > 0
                  and str(getattr(ev, "device_type", "")).endswith("CUDA"))
    # a step's greedy decoding may be two kernels: keep the last end of each cluster
    step_ends = [t for i, t in enumerate(ends) if i + 1 == len(ends) or ends[i + 1] - t > 100]
    out = []
    if len(step_ends) > 2:
        period = (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1) / 1e3
        out.append(f"engine loop: {len(step_ends)} steps, {period:.4f} ms a step between greedy ends; graph replay "
                   f"wall {replay_ms:.4f} ms; the difference {1e3 * (period - replay_ms):.1f} us a step")
    if n_timeline:
        out += ["engine loop, " + line if i == 0 else line for i, line in enumerate(timeline(prof, n_timeline))]
    return out


def timeline(prof, n: int) -> list[str]:
    """The last n GPU kernels the profiler saw (the end of the final replay), in order: start (us from the first of
    them), duration, and the idle gap since the previous kernel ended."""
    kernels = sorted((ev for ev in prof.events() if getattr(ev, "device_type", None) is not None
                      and str(ev.device_type).endswith("CUDA") and ev.time_range.elapsed_us() > 0),
                     key=lambda ev: ev.time_range.start)[-n:]
    if not kernels:
        return ["(no kernel events)"]
    t0, prev_end, out = kernels[0].time_range.start, None, [f"last {len(kernels)} kernels (us): start  duration  gap"]
    for ev in kernels:
        gap = 0.0 if prev_end is None else ev.time_range.start - prev_end
        out.append(f"{ev.time_range.start - t0:9.1f} {ev.time_range.elapsed_us():8.1f} {gap:6.1f}  {ev.name[:90]}")
        prev_end = ev.time_range.end
    return out


if __name__ == "__main__":
    main()
