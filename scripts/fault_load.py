"""Fault-and-load test of the served app: open-loop load at a fixed rate while replicas and rank actors
are killed on a schedule, with oversized and malformed requests and clients that hang up mid-stream.

    python scripts/fault_load.py --model models/tandem-tiny --rate 4 --duration 60 \\
        --schedule "kill-prefill@10,kill-decode@25,kill-rank@40" --out fault_load.json

By default the script starts the app itself, in this process (Serve on a private local Ray, HTTP on a free
loopback port): `tandem serve` gives its Ray a private token, so no other process could reach its actors
to kill them. Disaggregated with every prompt handed off by default (`--serve-args`), so the prefill pool
and the KV handoff are on every request's path. With --base-url it loads an app that is already running
and kills nothing (the schedule is reported as skipped); KV blocks are then read from its GET /metrics.

Every request ends in exactly one bucket:
    succeeded       200 and a complete answer (a stream ends with [DONE] and no error event)
    clear_error     a 4xx/5xx with an OpenAI error body, or a stream's in-band error event then [DONE]
    disconnected    the client hung up mid-stream on purpose ("disconnect" requests)
    lost            no answer within --deadline, a connection dropped without a status, a stream cut
                    without [DONE], or an error without an OpenAI body: must be 0
Oversized and malformed requests must be clear errors (413 / 400); one that succeeds is counted in
`wrongly_accepted`. After the load, the pools' KV blocks in use are polled until 0 (or --settle seconds):
`blocks_at_rest` must be 0. Writes the whole report as JSON (--out) and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

APP = "tandem"
DEFAULT_SERVE_ARGS = ("--disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle "
                      "--max-request-body-bytes 65536 --request-timeout-s 30")
# One request kind per slot of this cycle: mostly ordinary traffic, some abuse.
MIX = ("completion", "stream", "chat", "completion", "stream", "disconnect", "completion", "oversized", "stream",
       "malformed")
MALFORMED = (b'{"prompt": ', b'{"prompt": "x", "max_tokens": "many"}', b'{"prompt": "x", "model": "no-such-model"}',
             b'{"messages": [{"role": "robot", "content": "hi"}]}', b'[1, 2, 3]')
PROMPTS = ("def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land far away,",
           "import numpy as np\n", "Q: What is the capital of France?\nA:")
FAULTS = ("kill-prefill", "kill-decode", "kill-rank", "kill-prefill-rank", "kill-decode-rank", "kill-router")


@dataclass
class Outcome:
    kind: str
    result: str  # succeeded | clear_error | disconnected | lost
    status: int | None
    seconds: float
    detail: str = ""


@dataclass
class Report:
    command: str
    base_url: str
    rate: float
    duration_s: float
    faults: list[dict] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    blocks_at_rest: int | None = None
    blocks_settle_s: float | None = None

    def summary(self) -> dict[str, Any]:
        buckets = {b: 0 for b in ("succeeded", "clear_error", "disconnected", "lost")}
        by_kind: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            buckets[o.result] += 1
            by_kind.setdefault(o.kind, {}).setdefault(o.result, 0)
            by_kind[o.kind][o.result] += 1
        wrong = sum(1 for o in self.outcomes if o.kind in ("oversized", "malformed") and o.result == "succeeded")
        statuses: dict[str, int] = {}
        for o in self.outcomes:
            if o.result == "clear_error":
                statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        return {"sent": len(self.outcomes), **buckets, "wrongly_accepted": wrong, "error_statuses": statuses,
                "by_kind": by_kind, "blocks_at_rest": self.blocks_at_rest, "blocks_settle_s": self.blocks_settle_s,
                "lost_examples": [asdict(o) for o in self.outcomes if o.result == "lost"][:10]}


# ---- one request of each kind

def _is_openai_error(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and bool(body["error"].get("message"))


async def _read_error(resp: aiohttp.ClientResponse) -> tuple[str, str]:
    text = await resp.text()
    try:
        ok = _is_openai_error(json.loads(text))
    except ValueError:
        ok = False
    return ("clear_error" if ok else "lost"), text[:200]


async def _unary(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[str, int, str]:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            result, text = await _read_error(resp)
            return result, resp.status, text
        data = await resp.json()
        complete = isinstance(data, dict) and bool(data.get("choices"))
        return ("succeeded" if complete else "lost"), 200, "" if complete else json.dumps(data)[:200]


async def _stream(session: aiohttp.ClientSession, url: str, body: bytes, hang_up: bool) -> tuple[str, int, str]:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            result, text = await _read_error(resp)
            return result, resp.status, text
        errored = False
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return ("clear_error" if errored else "succeeded"), 200, "in-band error" if errored else ""
            event = json.loads(payload)
            if "error" in event:
                errored = _is_openai_error(event) or errored
                if not _is_openai_error(event):
                    return "lost", 200, payload[:200]
            elif hang_up:
                resp.close()  # the client goes away mid-stream: the server must abort and free its KV
                return "disconnected", 200, ""
        return "lost", 200, "stream ended without [DONE]"


def _request(kind: str, i: int, model: str, max_tokens: int, oversize: int) -> tuple[str, bytes]:
    prompt = PROMPTS[i % len(PROMPTS)]
    if kind == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        return "/v1/chat/completions", json.dumps(body).encode()
    if kind == "oversized":
        return "/v1/completions", json.dumps({"model": model, "prompt": "x" * oversize, "max_tokens": 1}).encode()
    if kind == "malformed":
        return "/v1/completions", MALFORMED[(i // len(MIX)) % len(MALFORMED)]  # i // len(MIX): each kind in turn
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "ignore_eos": True, "stream": kind in ("stream", "disconnect")}
    return "/v1/completions", json.dumps(body).encode()


async def one_request(session: aiohttp.ClientSession, base: str, kind: str, i: int, args: argparse.Namespace) -> Outcome:
    path, body = _request(kind, i, args.model_name, args.max_tokens, args.oversize_bytes)
    t0 = time.monotonic()
    try:
        if kind in ("stream", "disconnect"):
            coro = _stream(session, base + path, body, hang_up=kind == "disconnect")
        else:
            coro = _unary(session, base + path, body)
        result, status, detail = await asyncio.wait_for(coro, args.deadline)
    except asyncio.TimeoutError:
        result, status, detail = "lost", None, f"no answer within {args.deadline}s"
    except (aiohttp.ClientError, ValueError) as e:
        result, status, detail = "lost", None, f"{type(e).__name__}: {e}"[:200]
    return Outcome(kind, result, status, round(time.monotonic() - t0, 3), detail)


# ---- faults (the app runs in this process's Ray)

def _replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def _wait_for(find: Callable[[], list], timeout_s: float = 20.0) -> list:
    """`find()` until it finds something (a replacement replica may still be starting), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (found := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def kill_replica(deployment: str) -> str:
    """Kill one replica actor of `deployment` as a crash would (no restart: Serve must replace it)."""
    import ray

    names = _wait_for(lambda: _replica_names(deployment))
    if not names:
        return f"no live {deployment} replica"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return f"killed {names[0].split('#')[-1]} of {deployment}"


def live_ranks(actors: list[dict], pool: str | None = None) -> list[dict]:
    """The live `RankWorker` entries of a GCS actor table, in table order; with `pool` ("PrefillPool",
    "DecodePool"), only those a replica of that deployment started: a rank actor's owner is the Serve
    replica actor that created it, whose address equals the rank's `OwnerAddress`."""
    def where(addr: dict | None) -> tuple:
        return ((addr or {}).get("IPAddress"), (addr or {}).get("Port"))

    alive = [a for a in actors if a.get("State") == "ALIVE"]
    owners = {where(a.get("Address")): a.get("ActorClassName", "") for a in alive}
    ranks = [a for a in alive if a.get("ActorClassName") == "RankWorker"]
    if pool is None:
        return ranks
    return [a for a in ranks if owners.get(where(a.get("OwnerAddress")), "").endswith(f":{pool}")]


def kill_rank(pool: str | None = None) -> str:
    """SIGKILL one live rank actor's process (pool ranks are Ray actors): any pool's (`kill-rank`, the first
    in the GCS table, so either pool's), or one of the prefill or decode pool's. The actor table comes from
    the GCS, which needs no dashboard; the process is one this script's own Ray started."""
    from ray._private import state

    live = _wait_for(lambda: live_ranks(list(state.actors().values()), pool))
    of = f" of {pool}" if pool else ""
    if not live:
        return f"no live RankWorker{of}"
    pid = int(live[0]["Pid"])
    os.kill(pid, signal.SIGKILL)
    return f"killed RankWorker pid {pid}{of}"


FAULT_ACTIONS: dict[str, Callable[[], str]] = {
    "kill-prefill": lambda: kill_replica("PrefillPool"),
    "kill-decode": lambda: kill_replica("DecodePool"),
    "kill-rank": kill_rank,
    "kill-prefill-rank": lambda: kill_rank("PrefillPool"),
    "kill-decode-rank": lambda: kill_rank("DecodePool"),
    # The ingress: its in-flight streams end with it (the clients see the connection drop); the other Router
    # replicas (--router-replicas 2 and up) take the new requests while Serve replaces it.
    "kill-router": lambda: kill_replica("Router"),
}


def parse_schedule(spec: str) -> list[tuple[float, str]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        what, sep, at = part.partition("@")
        if not sep or what not in FAULTS:
            raise SystemExit(f"--schedule: {part!r} is not FAULT@SECONDS with FAULT in {FAULTS}")
        out.append((float(at), what))
    return sorted(out)


async def run_faults(schedule: list[tuple[float, str]], start: float, can_kill: bool) -> list[dict]:
    events = []
    for at, what in schedule:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        if not can_kill:
            events.append({"at_s": at, "fault": what, "result": "skipped (--base-url: the app's Ray is not ours)"})
            continue
        try:
            result = await asyncio.to_thread(FAULT_ACTIONS[what])
        except Exception as e:  # noqa: BLE001 - reported, the load goes on
            result = f"failed: {type(e).__name__}: {e}"
        events.append({"at_s": round(time.monotonic() - start, 2), "fault": what, "result": result})
        print(f"[{time.monotonic() - start:6.1f}s] {what}: {result}", flush=True)
    return events


# ---- load

async def run_load(base: str, args: argparse.Namespace, schedule: list[tuple[float, str]],
                   can_kill: bool) -> tuple[list[Outcome], list[dict]]:
    """Open loop: request i is sent at i / rate whatever the answers so far; then every answer is awaited."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request, as clients do
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        faults = asyncio.create_task(run_faults(schedule, start, can_kill))
        tasks, i = [], 0
        while time.monotonic() - start < args.duration:
            tasks.append(asyncio.create_task(one_request(session, base, MIX[i % len(MIX)], i, args)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
        outcomes = await asyncio.gather(*tasks)
        events = await faults
    return list(outcomes), events


# ---- KV blocks at rest

def _blocks_from_pools() -> int:
    """Blocks in use summed over the pools (each pool's replicas asked several times: a handle call goes to one)."""
    from ray import serve

    total = 0
    for deployment in ("PrefillPool", "DecodePool"):
        handle = serve.get_deployment_handle(deployment, app_name=APP)
        seen = [handle.stats.remote().result(timeout_s=30)["blocks_used"] for _ in range(3 * max(1, len(_replica_names(deployment))))]
        total += max(seen)
    return total


def _blocks_from_metrics(base: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    values = re.findall(r"^tandem_kv_blocks_used\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    if not values:
        raise RuntimeError(f"{base}/metrics has no tandem_kv_blocks_used (no engine has reported yet)")
    return int(sum(float(v) for v in values))


def blocks_at_rest(read: Callable[[], int], settle_s: float) -> tuple[int, float]:
    """Poll until no KV block is in use (aborted requests free theirs asynchronously), at most `settle_s`."""
    t0, blocks = time.monotonic(), -1
    while True:
        try:
            blocks = read()
        except Exception as e:  # noqa: BLE001 - a replica restarting: ask again
            print(f"blocks: {type(e).__name__}: {e}", flush=True)
        if blocks == 0 or time.monotonic() - t0 > settle_s:
            return blocks, round(time.monotonic() - t0, 2)
        time.sleep(1.0)


# ---- the app, in this process

def start_app(model: str, serve_args: list[str], ready_timeout: float) -> tuple[str, str]:
    """`tandem serve MODEL --host 127.0.0.1` on free ports, as the CLI would start it, but in this process.
    Returns (base URL, served model name)."""
    from parallel.net import free_port
    from tandem import cli
    from tandem.serving import start, wait_ready

    argv = ["serve", model, "--host", "127.0.0.1", "--port", str(free_port()), "--grpc-port", str(free_port()),
            "--device", "cpu", *serve_args]
    spec, config = cli.serve_spec(cli.build_parser().parse_args(argv))
    start(spec)
    seconds = wait_ready(spec.local_url(), config.served_model_name, ready_timeout)
    print(f"app ready at {spec.local_url()} in {seconds:.1f}s", flush=True)
    return spec.local_url(), config.served_model_name


def stop_app() -> None:
    import ray

    from tandem.serving import stop

    stop()  # the app deleted first: its replicas stop together rather than one deployment after another
    ray.shutdown()


def served_model(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def print_table(summary: dict[str, Any]) -> None:
    rows = [("requests sent", summary["sent"]), ("succeeded", summary["succeeded"]),
            ("failed with a clear error (4xx/5xx, OpenAI body)", summary["clear_error"]),
            ("disconnected by the client (on purpose)", summary["disconnected"]),
            ("lost (no answer / hang past the deadline)", summary["lost"]),
            ("oversized/malformed wrongly accepted", summary["wrongly_accepted"]),
            ("KV blocks at rest after the load", summary["blocks_at_rest"])]
    print("| outcome | count |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"clear-error statuses: {summary['error_statuses']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tandem-tiny", help="Model folder the started app serves.")
    p.add_argument("--base-url", help="Load this running app instead of starting one (no kills then).")
    p.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help=f"Flags of the started app (default: {DEFAULT_SERVE_ARGS!r}).")
    p.add_argument("--rate", type=float, default=4.0, help="Requests per second, open loop (default: 4).")
    p.add_argument("--duration", type=float, default=60.0, help="Seconds of load (default: 60).")
    p.add_argument("--schedule", default="kill-prefill@10,kill-decode@25,kill-rank@40",
                   help="Faults as FAULT@SECONDS, comma-separated; FAULT: kill-prefill, kill-decode (a replica), kill-rank "
                        "(any pool's rank actor), kill-prefill-rank, kill-decode-rank (one of that pool's), kill-router.")
    p.add_argument("--deadline", type=float, default=60.0, help="Seconds a request may take before it counts as lost.")
    p.add_argument("--max-tokens", type=int, default=16, help="Tokens per ordinary request (default: 16).")
    p.add_argument("--oversize-bytes", type=int, default=200_000, help="Prompt size of oversized requests.")
    p.add_argument("--settle", type=float, default=90.0, help="Seconds to wait for KV blocks to reach 0 after the load.")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="Seconds the started app may take to answer.")
    p.add_argument("--out", default="fault_load.json", help="JSON report path.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    schedule = parse_schedule(args.schedule)
    own_app = args.base_url is None
    if own_app:
        base, args.model_name = start_app(args.model, shlex.split(args.serve_args), args.ready_timeout)
    else:
        base, args.model_name = args.base_url.rstrip("/"), served_model(args.base_url.rstrip("/"))
    try:
        report = Report(" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]), base,
                        args.rate, args.duration)
        report.outcomes, report.faults = asyncio.run(run_load(base, args, schedule, own_app))
        read = _blocks_from_pools if own_app else (lambda: _blocks_from_metrics(base))
        report.blocks_at_rest, report.blocks_settle_s = blocks_at_rest(read, args.settle)
    finally:
        if own_app:
            stop_app()
    summary = report.summary()
    result = {**summary, "command": report.command, "base_url": base, "rate": args.rate, "duration_s": args.duration,
              "faults": report.faults, "outcomes": [asdict(o) for o in report.outcomes]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(summary)
    print(f"faults: {json.dumps(report.faults)}\nwrote {args.out}")
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["lost"] == 0 and res["blocks_at_rest"] == 0 else 1)
