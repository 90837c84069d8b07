#!/usr/bin/env python3
"""What a multi-rank step pays to reach its rank actors, on any machine (no GPU needed).

1. Dispatch alone: a decode step of --seqs sequences (tables of 38-39 blocks, as the scheduler makes
   them) sent to N idle rank actors and answered, the way the engine does it (step deltas over the step channel, cluster/step_channel.py)
   beside the old way (one Ray task per rank, the whole SchedulerOutput pickled by Ray), same run.
2. The engine: median decode-step time of a tiny model in-process (`uni`) and through the rank
   actors (`ray`) at world size 1, then TP=N on the CPU over gloo; at world size 1 the difference
   is what the rank-actor path costs per step.

    python scripts/bench_step_dispatch.py --ranks 1,2,4
    python scripts/bench_step_dispatch.py --ranks 1 --device cuda      # on a GPU host
    python scripts/bench_step_dispatch.py --stages                     # each stage, in one process
Prints a table; writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class DecodeSteps:
    """Steps as the engine's scheduler makes them (engine/scheduler.py, with its plain-decode columns), made
    one at a time as they are used, so no backlog of steps sits in memory for the garbage collector to walk:
    a first step prefills `seqs` sequences (prompts of 600-615 tokens: tables of 38-39 blocks of 16, each
    growing by one every 16 steps, at staggered steps), then every step decodes all of them, each one's token
    sampled in between (`done`). `schedule_s`: the scheduler's own time for the decode steps."""

    def __init__(self, seqs: int, count: int):
        from engine.block_manager import BlockManager
        from engine.scheduler import Scheduler
        from engine.sequence import Sequence
        from workers.config import SchedulerConfig
        from workers.sampling_params import SamplingParams

        self.seqs, self.schedule_s, self.num_steps = seqs, 0.0, 0
        blocks = seqs * ((616 + count) // 16 + 2)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=616 * seqs),
                               BlockManager(blocks, 16, enable_prefix_caching=False))
        for i in range(seqs):
            self.sched.add(Sequence(f"req-{i}", [7] * (600 + i % 16),
                                    SamplingParams(max_tokens=count + 10, temperature=0.7, top_p=0.9, seed=i)))

    def next(self, ahead_of=None):
        """The next step; `ahead_of`: planned while that step is still out (asynchronous scheduling), with
        placeholders for the tokens it samples, as the engine sends it."""
        t = time.perf_counter()
        out = self.sched.schedule() if ahead_of is None else self.sched.schedule(ahead_of=ahead_of, will_finish=lambda s: False)
        if self.num_steps:
            self.schedule_s += time.perf_counter() - t
        self.num_steps += 1
        if len(out.seqs) != self.seqs:
            raise RuntimeError(f"a step has {len(out.seqs)} sequences, not {self.seqs}")
        return out

    def done(self, out) -> None:
        from workers.scheduler_output import ModelRunnerOutput

        ids = [s.seq_id for s in out.seqs if s.sample]
        self.sched.update(out, ModelRunnerOutput.from_columns(ids, [self.num_steps % 50] * len(ids), [-0.5] * len(ids)))


class _IdleRank:
    """A rank actor that does everything but run the model: decodes the step, answers like the engine's."""

    def __init__(self, rank: int):
        self.rank = rank

    def start_step_loop(self, address: str, port: int, spin_s: float = 0.0, local_path: str | None = None) -> None:
        from cluster.step_channel import run_rank_loop
        from workers.step_delta import StepDecoder

        decoder = StepDecoder()
        from workers.step_delta import pack_output

        def handle(message):
            out = decoder.decode(message[1])
            return pack_output(self._answer(out), out)

        run_rank_loop((address, port), self.rank, handle, spin_s, local_path)

    def execute(self, out):
        return self._answer(out)

    def _answer(self, out):
        """What the model runner answers for a decode step: its sampler's columns (token ids, logprobs)."""
        from workers.scheduler_output import ModelRunnerOutput

        if self.rank != 0:
            return None
        n = len(out.seqs)
        return ModelRunnerOutput.from_columns([s.seq_id for s in out.seqs], [1] * n, [-0.5] * n)


def dispatch_us(ranks: int, seqs: int, iters: int) -> dict:
    """Per-step microseconds: the step channel with deltas (blocking waits, and spinning ones as GPU ranks
    use), and a Ray task per rank."""
    import ray

    from cluster.ray_executor import DRIVER_SPIN_S, RANK_SPIN_S
    from cluster.rendezvous import node_address
    from cluster.step_channel import StepChannel
    from workers.step_delta import StepEncoder, unpack_output

    actor = ray.remote(num_cpus=0, max_concurrency=16)(_IdleRank)

    def timed(fn) -> float:
        """µs per step of `fn(step)` alone, over `iters` decode steps after the prefill and 20 decode steps."""
        steps, spent = DecodeSteps(seqs, iters + 20), 0.0
        for i in range(iters + 21):
            out = steps.next()
            t0 = time.perf_counter()
            fn(out)
            spent += (time.perf_counter() - t0) if i > 20 else 0.0
            steps.done(out)
        return spent / iters * 1e6

    result = {}
    for name, spin in (("step channel + deltas", False), ("step channel, spinning waits", True)):
        actors = [actor.remote(r) for r in range(ranks)]
        channel = StepChannel(node_address(), ranks, spin_s=DRIVER_SPIN_S if spin else 0.0)
        refs = [a.start_step_loop.remote(*channel.address, RANK_SPIN_S if spin else 0.0, channel.local_path) for a in actors]
        channel.accept(60)
        ray.get(refs)
        encoder = StepEncoder()

        def channel_step(out):
            channel.broadcast(("step", encoder.encode(out)))
            return unpack_output(channel.gather(60)[0], out)

        result[name] = timed(channel_step)
        channel.close()
        if not spin:
            result["Ray task per rank"] = timed(lambda out: ray.get([a.execute.remote(out) for a in actors])[0])
        for a in actors:
            ray.kill(a)
    return result


def stage_us(seqs: int, iters: int, schedule: dict | None = None) -> dict:
    """One process, no Ray: each stage of a decode step's round trip, µs per step (the channel's two hops
    are not in it). "answer" is the runner's own making of its output (in-process pays it too), and so is
    the scheduler's making of the step, put in `schedule["schedule"]` where given (not a stage here)."""
    import pickle

    from workers.scheduler_output import ModelRunnerOutput
    from workers.step_delta import StepDecoder, StepEncoder, pack_output, unpack_output

    steps = DecodeSteps(seqs, iters + 200)
    encoder, decoder = StepEncoder(), StepDecoder()
    totals = dict.fromkeys(("encode", "decode", "answer", "pack", "pickle", "unpack"), 0.0)
    for i in range(iters + 201):
        if i == 201:  # warm (step 0 is the prefill): the scheduler's time from here on
            steps.schedule_s = 0.0
        out = steps.next()
        t0 = time.perf_counter()
        payload = encoder.encode(out)
        t1 = time.perf_counter()
        ranks_out = decoder.decode(payload)
        t2 = time.perf_counter()
        answer = ModelRunnerOutput.from_columns([s.seq_id for s in ranks_out.seqs], [1] * seqs, [-0.5] * seqs)
        t3 = time.perf_counter()
        packed = pack_output(answer, ranks_out)
        t4 = time.perf_counter()
        frame = pickle.loads(pickle.dumps(("ok", packed), protocol=pickle.HIGHEST_PROTOCOL))
        t5 = time.perf_counter()
        unpack_output(frame[1], out)
        t6 = time.perf_counter()
        steps.done(out)
        if i > 200:
            for key, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                totals[key] += dt
    if schedule is not None:
        schedule["schedule"] = steps.schedule_s / iters * 1e6
    return {key: total / iters * 1e6 for key, total in totals.items()}


def ahead_fill_us(seqs: int, iters: int) -> float:
    """µs per step that a replica of one rank spends on a decode step sent ahead before it can run it:
    decoding it and filling its placeholders from its own answer to the step before (cluster/rank_worker.py,
    `decode_own`). The engine sends every decode step this way with asynchronous scheduling (the default)."""
    from workers.scheduler_output import ModelRunnerOutput, num_placeholders
    from workers.step_delta import StepDecoder, StepEncoder, decode_own, tokens_by_row

    steps, encoder, decoder = DecodeSteps(seqs, iters + 200), StepEncoder(), StepDecoder()
    prev = steps.next()
    ranks_prev = decoder.decode(encoder.encode(prev))
    spent = 0.0
    for i in range(iters + 200):
        ids = [s.seq_id for s in ranks_prev.seqs if s.sample]
        answer = ModelRunnerOutput.from_columns(ids, [1000 + (i + j) % 999 for j in range(len(ids))], [-0.5] * len(ids))
        last_tokens = tokens_by_row(answer, ranks_prev)
        out = steps.next(ahead_of=prev)
        if not num_placeholders(out):
            raise RuntimeError("a step planned ahead has no placeholders")
        payload = encoder.encode(out)
        steps.done(prev)
        t = time.perf_counter()
        ranks_out = decode_own(decoder, payload, answer, last_tokens)
        spent += (time.perf_counter() - t) if i >= 200 else 0.0
        prev, ranks_prev = out, ranks_out
    return spent / iters * 1e6


def engine_step_ms(backend: str, ranks: int, device: str, tokens: int) -> float:
    from tandem import LLM, SamplingParams
    from tests.models import tiny_model

    llm = LLM(tiny_model("llama", num_hidden_layers=2), tensor_parallel_size=ranks, distributed_executor_backend=backend,
              device=device, max_model_len=256, num_gpu_blocks_override=64, block_size=16, show_progress=False)
    try:
        eng = llm.llm_engine
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        eng.add_request("bench", [5, 6, 7, 8], SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
        eng.step()  # prefill
        times = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)
    finally:
        llm.shutdown()


def run(ranks_list: list[int], seqs: int, iters: int, tokens: int, device: str, engine: bool = True) -> dict:
    rows = []
    for n in ranks_list:
        row = {"ranks": n, "dispatch_us": dispatch_us(n, seqs, iters)}
        if not engine:
            pass
        elif n == 1:
            row["engine_step_ms"] = {b: engine_step_ms(b, 1, device, tokens) for b in ("uni", "ray")}
        elif device == "cpu":
            row["engine_step_ms"] = {"ray": engine_step_ms("ray", n, device, tokens)}
        rows.append(row)
        d = row["dispatch_us"]
        line = (f"world size {n}: dispatch {d['step channel + deltas']:7.1f} us, spinning {d['step channel, spinning waits']:7.1f} us "
                f"(Ray task per rank {d['Ray task per rank']:7.1f} us)")
        if "engine_step_ms" in row:
            line += "; tiny-model decode step " + ", ".join(f"{b} {ms:.3f} ms" for b, ms in row["engine_step_ms"].items())
        print(line, flush=True)
    return {"benchmark": "step_dispatch", "date": time.strftime("%Y-%m-%d"), "device": device,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "seqs_per_step": seqs,
            "iters": iters, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="world sizes, comma-separated (default: 1,2)")
    p.add_argument("--seqs", type=int, default=64, help="sequences in the dispatched decode step (default: 64)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--tokens", type=int, default=200, help="decode steps timed in the engine (default: 200)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--no-engine", action="store_true", help="only the dispatch part (skip the tiny-model engine steps)")
    p.add_argument("--stages", action="store_true", help="only each stage of the round trip, in one process (no Ray)")
    p.add_argument("--out", default="bench_results/bench_step_dispatch.json")
    a = p.parse_args()
    import ray

    from cluster.ray_runtime import use_private_ray_token

    if a.stages:
        scheduler: dict = {}
        stages = stage_us(a.seqs, a.iters, scheduler)
        print(", ".join(f"{k} {v:.1f} us" for k, v in stages.items()) + f"; total {sum(stages.values()):.1f} us "
              f"(the scheduler's own step, not in the total: {scheduler['schedule']:.1f} us)")
        print(f"a step sent ahead to a replica of one rank: decode and fill from its own answer "
              f"{ahead_fill_us(a.seqs, a.iters):.1f} us")
        return
    ranks_list = [int(x) for x in a.ranks.split(",")]
    use_private_ray_token()  # a private local Ray that leaves no ~/.ray/auth_token behind
    ray.init(address="local", num_cpus=max(max(ranks_list), os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        report = run(ranks_list, a.seqs, a.iters, a.tokens, a.device, engine=not a.no_engine)
    finally:
        ray.shutdown()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
