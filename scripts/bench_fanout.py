"""n > 1 and prompt lists: one batched backend call vs the same number of separate requests (issue 19 item 1).

By default runs the colocated backend in this process (no Ray, no HTTP: the engine path only), on CPU:

    python scripts/bench_fanout.py --model models/tandem-tiny --n 16 --prompt-tokens 512 --max-tokens 16

With `--served pd` (or `colocated`) it starts the served app on a private local Ray (disaggregated: one
prefill and one decode replica, every prompt handed off) and sends the same cases over HTTP: one
/v1/completions request with `n` (or the prompt list) against that many concurrent single requests.

Cases, each run `--repeat` times after one warm-up (the best wall time is reported, with the prefix-cache
hits of the last run):
  batched  - one client request with n choices (or the prompt list): Fanout -> Backend.generate_batch
  separate - the same choices as n concurrent separate requests (one generate stream each, as the router
             did before), all started at once
Prompts are random token ids, distinct per repeat and case, so no case reuses another's cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _NoBatch:
    """The backend without generate_batch: Fanout then opens one generate stream per choice."""

    def __init__(self, inner):
        self._inner = inner

    def generate(self, req):
        return self._inner.generate(req)

    async def abort(self, request_id):
        await self._inner.abort(request_id)


async def _run(backend, reqs) -> float:
    from router.fanout import Fanout

    t0 = time.perf_counter()
    fanout = Fanout(backend, reqs)
    try:
        outs = await fanout.final_outputs()
    finally:
        await fanout.aclose()
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    return time.perf_counter() - t0


async def bench(args) -> dict:
    from router.config import AppConfig
    from router.local_backend import LocalBackend
    from router.protocol import GenerateRequest
    from workers.sampling_params import SamplingParams

    config = AppConfig(model=args.model, colocated=True, device=args.device, dtype="float32",
                       max_num_seqs=max(64, args.n * args.prompts), max_waiting_requests=None, max_queue_delay_s=None)
    backend = LocalBackend.from_config(config)
    rng = random.Random(0)
    vocab = min(backend.vocab_size, 30000)

    def requests(tag: str) -> list:
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        return [GenerateRequest(f"{tag}-{p}-{j}", ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                                                       temperature=1.0, seed=j))
                for p, ids in enumerate(prompts) for j in range(args.n)]

    results = {}
    try:
        for case, wrap in (("batched", lambda b: b), ("separate", _NoBatch)):
            await _run(wrap(backend), requests(f"warm-{case}"))
            times = []
            for k in range(args.repeat):
                before = await backend.stats()
                times.append(await _run(wrap(backend), requests(f"{case}-{k}")))
                after = await backend.stats()
            hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
            queried = after["prefix_queried_tokens"] - before["prefix_queried_tokens"]
            choices = args.n * args.prompts
            results[case] = {"best_s": round(min(times), 3), "all_s": [round(t, 3) for t in times],
                             "prefill_tokens_computed": queried - hits, "prefix_hit_tokens": hits,
                             "output_tok_per_s": round(choices * args.max_tokens / min(times), 1)}
            print(case, json.dumps(results[case]), flush=True)
    finally:
        await backend.close()
    results["speedup_batched_vs_separate"] = round(results["separate"]["best_s"] / results["batched"]["best_s"], 2)
    return results


def served(args) -> dict:
    import concurrent.futures
    import logging
    import os

    import httpx2
    import ray
    from ray import serve

    from parallel.net import free_port
    from router.app import build_app

    repo = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    results = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = {"model": args.model, "device": args.device, "dtype": "float32", "max_num_seqs": max(64, args.n * args.prompts),
               "max_waiting_requests": None, "max_queue_delay_s": None, "colocated": args.served == "colocated",
               "local_prefill_max_tokens": 0, "local_prefill_when_idle": False}
        serve.run(build_app(app), name="tandem", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/completions"
        rng = random.Random(0)
        pool = concurrent.futures.ThreadPoolExecutor(args.n * args.prompts)

        def post(body: dict) -> dict:
            r = httpx2.post(url, json={"model": Path(args.model).name, "max_tokens": args.max_tokens, "ignore_eos": True,
                                       "temperature": 1.0, **body}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        def prompts() -> list[list[int]]:
            return [[rng.randrange(10, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]

        def batched() -> float:
            ps = prompts()
            t0 = time.perf_counter()
            post({"prompt": ps if args.prompts > 1 else ps[0], "n": args.n, "seed": 1})
            return time.perf_counter() - t0

        def separate() -> float:
            ps = prompts()
            t0 = time.perf_counter()
            list(pool.map(lambda pj: post({"prompt": pj[0], "seed": 1 + pj[1]}),
                          [(p, j) for p in ps for j in range(args.n)]))
            return time.perf_counter() - t0

        for case, fn in (("batched", batched), ("separate", separate)):
            fn()  # warm-up
            times = [fn() for _ in range(args.repeat)]
            results[case] = {"best_s": round(min(times), 3), "all_s": [round(t, 3) for t in times],
                             "output_tok_per_s": round(args.n * args.prompts * args.max_tokens / min(times), 1)}
            print(case, json.dumps(results[case]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    results["speedup_batched_vs_separate"] = round(results["separate"]["best_s"] / results["batched"]["best_s"], 2)
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tandem-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, default=16, help="choices per prompt")
    p.add_argument("--prompts", type=int, default=1, help="prompts in the request's list")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--served", choices=("pd", "colocated"), help="through the served app over HTTP (see above)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    res = {"args": vars(args), **(served(args) if args.served else asyncio.run(bench(args)))}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
