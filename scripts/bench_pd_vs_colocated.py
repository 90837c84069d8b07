"""Disaggregated against colocated serving in one command: each deployment is started with `tandem serve`,
measured with the same `scripts/bench_serving.py` sweep, and stopped before the next one starts.

    python scripts/bench_pd_vs_colocated.py --model models/tandem-tiny --device cpu \\
        --bench-args "--length-dist fixed --input-len 128 --output-len 32 --concurrencies 1,8 --num-prompts 40"

Deployments (`--deployments`, `name=flags` separated by ';'; default: colocated, pd, pd-handoff):
    colocated   tandem serve MODEL                       one engine does prefill and decode
    pd          tandem serve MODEL --disaggregated        prefill + decode pools, conditional disaggregation on
    pd-handoff  ... --local-prefill-max-tokens 0 --no-local-prefill-when-idle: every prompt's KV is handed over
Writes OUT.json (every deployment's sweep, and each point's ratios to the first deployment's) and, with
matplotlib, OUT.png (TTFT and TPOT p50 against request throughput, one line per deployment).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parallel.net import free_port  # noqa: E402
from scripts.bench_serving import main as bench_serving  # noqa: E402

DEFAULT_DEPLOYMENTS = ("colocated=;pd=--disaggregated;"
                       "pd-handoff=--disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle")


def parse_deployments(spec: str) -> list[tuple[str, list[str]]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, flags = part.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--deployments: {part!r} is not name=flags")
        out.append((name.strip(), shlex.split(flags)))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit("--deployments: names must differ")
    return out


def start_server(model: str, flags: list[str], common: list[str], log_path: Path, ready_timeout: float) -> tuple[subprocess.Popen, int]:
    """`tandem serve` on free loopback ports; returns once it printed "Tandem ready" (a real request succeeded)."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), "--ready-timeout", str(ready_timeout), *common, *flags]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + ready_timeout + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if "Tandem ready" in log_path.read_text():
            return proc, port
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"tandem serve was not ready within {ready_timeout:.0f}s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # tandem serve shuts Serve down on SIGINT
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def ratios(points: list[dict], base: list[dict]) -> list[dict]:
    """Per sweep point: throughput, goodput, TTFT p50 and TPOT p50 over the first deployment's at the same point (the
    same label)."""
    by_label = {b["label"]: b for b in base}
    out = []
    for p in points:
        s, t = p["summary"], by_label.get(p["label"], {}).get("summary")

        def r(a, c):
            return a / c if a is not None and c else None

        if t is None:
            out.append({"label": p["label"], "request_throughput": None, "goodput": None, "ttft_p50": None, "tpot_p50": None})
            continue
        out.append({"label": p["label"], "request_throughput": r(s["request_throughput"], t["request_throughput"]),
                    "goodput": r(s.get("goodput"), t.get("goodput")),
                    "ttft_p50": r(s["ttft_s"]["p50"], t["ttft_s"]["p50"]), "tpot_p50": r(s["tpot_s"]["p50"], t["tpot_s"]["p50"])})
    return out


def table(results: dict[str, dict]) -> str:
    lines = [f"{'deployment':12} {'point':>8} {'req/s':>7} {'goodput':>8} {'TTFT p50':>9} {'TPOT p50':>9} {'x req/s':>8} "
             f"{'x good':>7} {'x TTFT':>7} {'x TPOT':>7}"]
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for name, res in results.items():
        for p, r in zip(res["points"], res["vs_first"]):
            s = p["summary"]
            lines.append(f"{name:12} {p['label']:>8} {s['request_throughput']:7.2f} {fmt(s.get('goodput'), '8.2f')} "
                         f"{fmt(s['ttft_s']['p50'] and 1e3 * s['ttft_s']['p50'], '8.1f')}m "
                         f"{fmt(s['tpot_s']['p50'] and 1e3 * s['tpot_s']['p50'], '8.2f')}m {fmt(r['request_throughput'], '8.2f')} "
                         f"{fmt(r.get('goodput'), '7.2f')} {fmt(r['ttft_p50'], '7.2f')} {fmt(r['tpot_p50'], '7.2f')}")
    return "\n".join(lines)


def merge_runs(saved: list[dict]) -> dict[str, dict]:
    """Several saved runs (this script's JSONs) as one sweep: each deployment's points from every run, in rate order,
    and the ratios against the first deployment's point of the same label. Runs of one sweep split over calls (rates
    2-8 in one, 16-24 in the next) plot as one curve; each point is still compared within its own run."""
    results: dict[str, dict] = {}
    for run in saved:
        for name, res in run["deployments"].items():
            results.setdefault(name, {"flags": res["flags"], "points": []})["points"] += res["points"]
    for res in results.values():
        res["points"].sort(key=lambda p: (p.get("rate") is None, p.get("rate") or 0))
    base = next(iter(results.values()))["points"]
    for res in results.values():
        res["vs_first"] = ratios(res["points"], base)
    return results


def plot(results: dict[str, dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, res in results.items():
        x = [p["summary"]["request_throughput"] for p in res["points"]]
        for ax, key in zip(axes, ("ttft_s", "tpot_s")):
            ax.plot(x, [p["summary"][key]["p50"] for p in res["points"]], "o-", label=name)
        rated = [p for p in res["points"] if p.get("rate") not in (None, float("inf"))]  # Poisson sweep points only
        line, = axes[2].plot([p["rate"] for p in rated], [p["summary"]["goodput"] for p in rated], "o-", label=name)
        for limit in sorted({k for p in rated for k in p["summary"].get("goodput_by_tpot_ms", {})}, key=float):
            # the same requests counted under each tighter TPOT limit (--extra-tpot-slos), dashed in the same colour
            axes[2].plot([p["rate"] for p in rated], [p["summary"]["goodput_by_tpot_ms"].get(limit) for p in rated],
                         "s--", color=line.get_color(), alpha=0.7, label=f"{name}, TPOT <= {limit} ms")
    for ax, title in zip(axes, ("TTFT p50", "TPOT p50")):
        ax.set_title(title)
        ax.set_xlabel("requests/s")
        ax.set_ylabel("seconds")
    axes[2].set_title("goodput (requests within both SLOs)")
    axes[2].set_xlabel("offered requests/s")
    axes[2].set_ylabel("requests/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def output_path(out: str | Path, suffix: str) -> Path:
    """OUT with `suffix`: `Path.with_suffix` would take a dot inside the name for one ("gil_0.005" -> "gil_0.json")."""
    out = Path(out)
    if out.suffix in (".json", ".png"):
        out = out.with_suffix("")
    return out.with_name(out.name + suffix)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tandem-tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--serve-args", default="", help="more `tandem serve` flags for every deployment")
    p.add_argument("--deployments", default=DEFAULT_DEPLOYMENTS, help="name=flags;name=flags... (the first is the baseline)")
    p.add_argument("--bench-args", default="--length-dist fixed --input-len 128 --output-len 32 --concurrencies 1,8 --num-prompts 40",
                   help="scripts/bench_serving.py flags, the same for every deployment")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", help="keep each deployment's `tandem serve` log here (default: deleted with the run)")
    p.add_argument("--out", default="bench_results/pd_vs_colocated",
                   help="writes OUT.json and OUT.png (a trailing .json or .png on OUT is dropped first; other dots stay)")
    p.add_argument("--replot", metavar="JSON", nargs="+",
                   help="only redraw OUT.png (and print the table) from JSONs this script wrote; several runs' points "
                        "are drawn as one sweep (`merge_runs`)")
    args = p.parse_args(argv)
    if args.replot:
        results = merge_runs([json.loads(Path(f).read_text()) for f in args.replot])
        print(table(results))
        return 0 if plot(results, output_path(args.out, ".png")) else 1
    deployments = parse_deployments(args.deployments)
    common = ["--device", args.device, *shlex.split(args.serve_args)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-pd-bench-") as tmp:
        for name, flags in deployments:
            print(f"== {name}: tandem serve {args.model} {' '.join(common + flags)}", flush=True)
            log_dir = Path(args.log_dir or tmp)
            log_dir.mkdir(parents=True, exist_ok=True)
            proc, port = start_server(args.model, flags, common, log_dir / f"{name}.log", args.ready_timeout)
            try:
                part = Path(tmp) / name
                bench_serving(["--base-url", f"http://127.0.0.1:{port}", "--out", str(part), *shlex.split(args.bench_args)])
                report = json.loads(part.with_suffix(".json").read_text())
            finally:
                stop_server(proc)
            results[name] = {"flags": flags, "points": report["points"]}
    base = next(iter(results.values()))["points"]
    for res in results.values():
        res["vs_first"] = ratios(res["points"], base)
    meta = {"model": args.model, "device": args.device, "serve_args": common, "bench_args": args.bench_args,
            "date": time.strftime("%Y-%m-%d")}
    output_path(out, ".json").write_text(json.dumps({"meta": meta, "deployments": results}, indent=2))
    print(table(results))
    plotted = plot(results, output_path(out, ".png"))
    print(f"wrote {output_path(out, '.json')}" + (f" and {output_path(out, '.png')}" if plotted else
                                                 "; skipped the PNG: matplotlib is not installed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
