#!/usr/bin/env python3
"""Online serving benchmark against Tandem's OpenAI endpoint: latency vs throughput.

For each point of a sweep (request rates with Poisson arrivals at offsets drawn from --seed, the same schedule
for every deployment it is run against; or fixed concurrencies) it sends
synthetic streamed /v1/completions requests (token-id prompts, `ignore_eos`, so every request has
exactly its drawn input and output length) and measures per request TTFT, TPOT, inter-token latency
(gaps between streamed chunks) and end-to-end latency; it reports p50/p90/p99, request and token
throughput, and goodput (completed requests per second within --ttft-slo and --tpot-slo, and within
each --extra-tpot-slos limit). Each point is bounded by --num-prompts requests and --max-duration
seconds; with --arrival-seconds S a rate point sends rate x S requests (at most --num-prompts), so
every rate runs long enough to reach its steady state: with a fixed count, a high rate's arrivals end
before any queue forms. Requests go only to --base-url (default localhost). Writes JSON and a
latency-vs-throughput PNG.

    tandem serve &                                   # or any Tandem deployment
    python scripts/bench_serving.py --request-rates 1,2,4,inf --num-prompts 100
    python scripts/bench_serving.py --request-rates 2,4,8,16 --arrival-seconds 15 --num-prompts 400 --extra-tpot-slos 0.02
    python scripts/bench_serving.py --concurrencies 1,8,32 --input-len 512 --output-len 128 --length-dist fixed
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import numpy as np
from tqdm.auto import tqdm


@dataclass
class Result:
    input_len: int
    output_len: int  # requested
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # generated, from the usage chunk
    sent_s: float = math.nan  # when it was sent, seconds after its point started

    @property
    def tpot(self) -> float:
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------- workload


def synthetic_workload(n: int, args: argparse.Namespace, max_model_len: int, rng: np.random.Generator):
    """(prompt token ids, output length) pairs; input + output always fit max_model_len."""
    def draw(mean: int, cap: int) -> np.ndarray:
        if args.length_dist == "fixed":
            v = np.full(n, mean)
        elif args.length_dist == "uniform":
            v = rng.integers(max(1, mean // 2), mean * 3 // 2 + 1, size=n)
        else:  # log-normal with ShareGPT's long tail; the median is set so the mean is as asked
            v = rng.lognormal(np.log(mean) - 0.5 * 0.8 ** 2, 0.8, size=n)
        return np.clip(v, 1, cap).astype(int)

    ins = draw(args.input_len, min(args.max_input_len, max_model_len - 2))
    outs = draw(args.output_len, args.max_output_len)
    outs = np.minimum(outs, max_model_len - ins)  # leave room for the prompt
    prompts = [rng.integers(args.min_token_id, args.max_token_id, size=k).tolist() for k in ins]
    return list(zip(prompts, outs.tolist()))


# ---------------------------------------------------------------- one request


async def send(session: aiohttp.ClientSession, args: argparse.Namespace, prompt: list[int], max_tokens: int) -> Result:
    res = Result(len(prompt), max_tokens)
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{args.base_url}/v1/completions", json=body, allow_redirects=False) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"].get("message", "error")
                    return res
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                choice = (event.get("choices") or [{}])[0]
                # A chunk carries text, or ends the request (whose tokens may all have been text-less).
                if choice.get("text") or choice.get("finish_reason"):
                    now = time.perf_counter()
                    if math.isnan(res.ttft):
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.ok = res.ok or bool(choice.get("finish_reason"))
        res.e2e = time.perf_counter() - start
        if not res.ok:
            res.error = "the stream ended without a finish_reason"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------- one sweep point


async def run_point(args, workload, rate: float | None, concurrency: int | None, rng) -> tuple[list[Result], float]:
    """Rate (Poisson) or concurrency (closed loop) arrivals, until the workload or --max-duration ends."""
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    label = f"rate {rate:g}/s" if rate is not None else f"concurrency {concurrency}"
    results: list[Result] = []
    bar = tqdm(total=len(workload), desc=label, unit="req", leave=False)
    deadline = time.perf_counter() + args.max_duration

    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as session:
        async def one(item):
            sent = time.perf_counter() - start
            r = await send(session, args, *item)
            r.sent_s = sent
            results.append(r)
            bar.update(1)

        start = time.perf_counter()
        tasks: list[asyncio.Task] = []
        if rate is not None:
            # Arrivals at fixed offsets from the start (their gaps drawn up front), not one sleep after another: a
            # sleep ends late by however long the event loop was busy with the streams, so with chained sleeps a
            # deployment that streams more events would be offered a lower rate than another one with the same seed.
            due = 0.0
            for item in workload:
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(one(item)))
                if math.isfinite(rate):
                    due += rng.exponential(1.0 / rate)
                    await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        else:
            queue = list(workload)

            async def worker():
                while queue and time.perf_counter() < deadline:
                    await one(queue.pop(0))

            tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        remaining = max(0.0, deadline - time.perf_counter())
        done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for t in pending:  # past --max-duration: the requests still running are cancelled, not counted
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def pct(values, ps=(50, 90, 99)) -> dict:
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=float)
    if v.size == 0:
        return {"mean": None, **{f"p{p}": None for p in ps}}
    return {"mean": float(v.mean()), **{f"p{p}": float(np.percentile(v, p)) for p in ps}}


def summarize(results: list[Result], elapsed: float, args) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    def within(r: Result, tpot_slo: float) -> bool:
        return r.ttft <= args.ttft_slo and (math.isnan(r.tpot) or r.tpot <= tpot_slo)

    good = [r for r in ok if within(r, args.tpot_slo)]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_token_throughput": out_tokens / elapsed if elapsed else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed if elapsed else 0.0,
        "goodput": len(good) / elapsed if elapsed else 0.0,
        "goodput_fraction": len(good) / len(results) if results else 0.0,
        # goodput under each --extra-tpot-slos limit (the same TTFT limit), keyed by the limit in ms
        "goodput_by_tpot_ms": {f"{1e3 * slo:g}": (sum(within(r, slo) for r in ok) / elapsed if elapsed else 0.0)
                               for slo in args.extra_tpot_slos},
        "ttft_s": pct([r.ttft for r in ok]), "tpot_s": pct([r.tpot for r in ok]),
        "itl_s": pct([g for r in ok for g in r.itl]), "e2e_s": pct([r.e2e for r in ok]),
        "mean_input_len": in_tokens / len(ok) if ok else 0, "mean_output_len": out_tokens / len(ok) if ok else 0,
    }


# ---------------------------------------------------------------- output


def plot(points: list[dict], path: Path) -> bool:
    """Writes the latency-vs-throughput PNG; False (and nothing written) when matplotlib is not installed,
    which is optional: the JSON and the table hold every number."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["summary"]["output_token_throughput"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT", "TPOT", "End-to-end latency")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            y = [p["summary"][key][q] if p["summary"][key][q] is not None else math.nan for p in points]
            ax.plot(x, y, style, label=q)
        for xi, p in zip(x, points):
            ax.annotate(p["label"], (xi, p["summary"][key]["p50"] or 0), fontsize=7, textcoords="offset points",
                        xytext=(3, 3))
        ax.set_title(title)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Tandem serving: latency vs throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _json_safe(d: dict) -> dict:
    """NaN (no first token, one token) as null: strict JSON has no NaN."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}


def table(points: list[dict]) -> str:
    rows = [f"{'point':>16} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'goodput':>7} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8} {'E2E p99':>8}"]
    f = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
    for p in points:
        s = p["summary"]
        rows.append(f"{p['label']:>16} {s['completed']:>5} {s['failed']:>4} {s['request_throughput']:>7.2f} "
                    f"{s['output_token_throughput']:>9.1f} {s['goodput']:>7.2f} {f(s['ttft_s']['p50']):>9} "
                    f"{f(s['ttft_s']['p99']):>9} {f(s['tpot_s']['p50']):>9} {f(s['itl_s']['p99']):>8} {f(s['e2e_s']['p99']):>8}")
    return "\n".join(rows)


# ---------------------------------------------------------------- main


async def model_card(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=headers) as s:
        async with s.get(f"{args.base_url}/v1/models", allow_redirects=False) as r:
            r.raise_for_status()
            data = (await r.json())["data"]
    card = next((m for m in data if m["id"] == args.model), None) if args.model else data[0]
    if card is None:
        raise SystemExit(f"model {args.model!r} is not served at {args.base_url} (served: {[m['id'] for m in data]})")
    return card


def point_prompts(args, kind: str, value: float) -> int:
    """Requests in one sweep point: --num-prompts, or, with --arrival-seconds at a finite rate, as many as
    arrive in that many seconds (at most --num-prompts), so every rate runs about as long and reaches its
    steady state rather than ending while the queue still builds."""
    if kind == "rate" and args.arrival_seconds and math.isfinite(value):
        return max(1, min(args.num_prompts, math.ceil(value * args.arrival_seconds)))
    return args.num_prompts


async def amain(args) -> dict:
    card = await model_card(args)
    args.model = card["id"]
    max_model_len = args.max_model_len or card.get("max_model_len") or 2048
    rng = np.random.default_rng(args.seed)
    if args.warmup:
        await run_point(args, synthetic_workload(args.warmup, args, max_model_len, rng), None, 1, rng)
    sweep = ([("rate", float(r)) for r in args.request_rates.split(",")] if args.request_rates
             else [("concurrency", int(c)) for c in args.concurrencies.split(",")])
    points = []
    for kind, value in sweep:
        workload = synthetic_workload(point_prompts(args, kind, value), args, max_model_len, rng)
        results, elapsed = await run_point(args, workload, value if kind == "rate" else None,
                                           value if kind == "concurrency" else None, rng)
        label = f"{value:g} req/s" if kind == "rate" else f"{value} conc"
        points.append({"label": label, kind: value if math.isfinite(value) else "inf",
                       "summary": summarize(results, elapsed, args),
                       **({"requests": [_json_safe(asdict(r) | {"tpot": r.tpot}) for r in results]}
                          if args.save_requests else {})})
        print(table(points[-1:]).splitlines()[-1], file=sys.stderr)
    return {"config": {k: v for k, v in vars(args).items() if k != "api_key"}, "model": card,
            "host": platform.node(), "points": points}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (no path); nothing else is contacted")
    p.add_argument("--model", default=None, help="served model name (default: the first the server lists)")
    p.add_argument("--api-key", default=None)
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--request-rates", default=None, help="comma-separated req/s with Poisson arrivals; inf = all at once")
    sweep.add_argument("--concurrencies", default=None, help="comma-separated numbers of closed-loop clients")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per sweep point (at most)")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per sweep point (at most)")
    p.add_argument("--arrival-seconds", type=float, default=None,
                   help="with --request-rates: each rate point sends rate x this many requests (at most --num-prompts)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before the sweep")
    p.add_argument("--length-dist", choices=["lognormal", "uniform", "fixed"], default="lognormal")
    p.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="mean output tokens")
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the server's (from /v1/models)")
    p.add_argument("--min-token-id", type=int, default=10, help="synthetic prompts draw ids in [min, max)")
    p.add_argument("--max-token-id", type=int, default=1000, help="keep below the model's vocabulary size")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="goodput: TTFT limit in seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="goodput: TPOT limit in seconds")
    p.add_argument("--extra-tpot-slos", type=lambda v: [float(x) for x in v.split(",") if x], default=[],
                   help="comma-separated further TPOT limits (s): goodput under each, with the same TTFT limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/serving", help="writes OUT.json and, with matplotlib, OUT.png")
    p.add_argument("--save-requests", action="store_true", help="keep every request's timings in the JSON")
    args = p.parse_args(argv)
    if not args.request_rates and not args.concurrencies:
        args.request_rates = "1,4,16,inf"
    if urlparse(args.base_url).scheme not in ("http", "https") or urlparse(args.base_url).path not in ("", "/"):
        p.error("--base-url must be http(s)://host:port without a path")
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(amain(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    plotted = plot(report["points"], out.with_suffix(".png"))
    print(table(report["points"]))
    if plotted:
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    else:
        print(f"wrote {out.with_suffix('.json')}; skipped {out.with_suffix('.png')}: matplotlib is not installed")
    return 0 if any(p["summary"]["completed"] for p in report["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
