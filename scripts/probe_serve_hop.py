"""What one call between two processes of a served app costs: a Serve deployment handle, a plain Ray actor call
and a local TCP socket (what router/prefill_lane.py uses), each into an empty method and back, measured from a
Serve replica (as the Router calls the prefill pool).

    python scripts/probe_serve_hop.py --calls 30 --gaps 0,0.5 --out /tmp/hop.json

Prints and writes, per path and gap between calls, the p50 / p90 ms into the method and back to the caller.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import struct
import time

import ray
from ray import serve

LEN_FORMAT = "!I"  # a 4-byte length before each pickled frame (a format string: a Struct does not pickle)


async def _echo_time(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            (size,) = struct.unpack(LEN_FORMAT, await reader.readexactly(4))
            await reader.readexactly(size)
        except asyncio.IncompleteReadError:
            return
        body = pickle.dumps(time.time())
        writer.write(struct.pack(LEN_FORMAT, len(body)) + body)


@serve.deployment(max_ongoing_requests=64)
class Target:
    async def call(self, sent: float) -> float:
        return time.time()

    async def listen(self) -> int:
        self.server = await asyncio.start_server(_echo_time, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


@ray.remote
class PlainActor:
    async def call(self, sent: float) -> float:
        return time.time()


@serve.deployment
class Caller:
    def __init__(self, target):
        self.target = target
        self.actor = PlainActor.remote()

    async def run(self, path: str, calls: int, gap: float) -> dict:
        if path == "tcp":
            reader, writer = await asyncio.open_connection("127.0.0.1", await self.target.listen.remote())
        into, back = [], []
        for _ in range(calls):
            await asyncio.sleep(gap)
            sent = time.time()
            if path == "serve":
                entered = await self.target.call.remote(sent)
            elif path == "actor":
                entered = await self.actor.call.remote(sent)
            else:
                body = pickle.dumps(sent)
                writer.write(struct.pack(LEN_FORMAT, len(body)) + body)
                (size,) = struct.unpack(LEN_FORMAT, await reader.readexactly(4))
                entered = pickle.loads(await reader.readexactly(size))
            done = time.time()
            into.append((entered - sent) * 1e3)
            back.append((done - entered) * 1e3)
        if path == "tcp":
            writer.close()

        def q(values: list[float], p: float) -> float:
            return round(sorted(values)[min(len(values) - 1, int(p * len(values)))], 3)

        return {"path": path, "gap_s": gap, "calls": calls, "into_p50_ms": round(statistics.median(into), 3),
                "into_p90_ms": q(into, 0.9), "back_p50_ms": round(statistics.median(back), 3), "back_p90_ms": q(back, 0.9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--gaps", default="0,0.5", help="seconds between calls, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ray.init(include_dashboard=False, logging_level="ERROR")
    caller = serve.run(Caller.bind(Target.bind()), name="hop-probe")
    rows = []
    for path in ("serve", "actor", "tcp"):
        for gap in (float(g) for g in args.gaps.split(",")):
            rows.append(caller.run.remote(path, args.calls, gap).result())
            print(json.dumps(rows[-1]))
    serve.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
