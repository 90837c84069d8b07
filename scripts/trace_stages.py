#!/usr/bin/env python3
"""Each stage of the served requests' timelines, p50 and p90 per site (colocated, local, remote), from the
`tandem.trace` lines a server writes with `--trace-requests` (docs/architecture.md, "Request timeline").

    python scripts/trace_stages.py SERVER.log [...]        # or the lines alone, one JSON object each (.jsonl)
    python scripts/trace_stages.py RES/pd_trace.jsonl                             # two_gpu_suite.sh pd_trace
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.metrics import STAGES, stage_seconds  # noqa: E402


def read_timelines(path: Path) -> list[dict]:
    """The trace records of a server log or a JSONL file: {"request_id", "site", "ms": {stamp: ms after arrival}}."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if "tandem.trace" in line:
            line = line.split("tandem.trace", 1)[1]
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record.get("ms"), dict):
                records.append(record)
    return records


def summary(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """site -> stage -> {"n", "p50", "p90"} in ms."""
    by_site: dict[str, dict[str, list[float]]] = {}
    for record in records:
        for name, ms in stage_seconds(record["ms"]).items():  # stamps in ms: the differences are ms too
            by_site.setdefault(record.get("site", "?"), {}).setdefault(name, []).append(ms)
    return {site: {name: {"n": len(v), "p50": statistics.median(v), "p90": _nearest_rank(v, 0.9)}
                   for name, v in stages.items()} for site, stages in by_site.items()}


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args()
    result = {}
    for path in a.files:
        records = read_timelines(path)
        if not records:
            sys.exit(f"{path}: no tandem.trace records (was the server started with --trace-requests?)")
        result[str(path)] = summary(records)
    if a.json:
        print(json.dumps(result, indent=1))
        return
    for path, sites in result.items():
        for site, stages in sites.items():
            print(f"{path} [{site}]")
            for name, _, _ in STAGES:
                if name in stages:
                    s = stages[name]
                    print(f"  {name:18s} n={s['n']:4d}  p50 {s['p50']:8.2f} ms  p90 {s['p90']:8.2f} ms")


if __name__ == "__main__":
    main()
