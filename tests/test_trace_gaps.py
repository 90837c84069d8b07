"""scripts/trace_gaps.py on a hand-made trace: GPU busy time is the union of overlapping kernels, gaps
are what lies between, communication counts NCCL's and the P2P all-reduce's kernels, host self time
subtracts nested events."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_busy_gaps_comm_and_host_self_time(tmp_path):
    from trace_gaps import analyze

    ev = [
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 100, "dur": 300, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 200, "dur": 200, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 300, "dur": 200, "tid": 8},  # overlaps
        {"ph": "X", "cat": "kernel", "name": "one_shot_all_reduce_kernel", "ts": 800, "dur": 100, "tid": 7},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    r = analyze(str(path))
    assert r["span_ms"] == 1.0 and r["gpu_busy_ms"] == 0.4 and r["comm_ms"] == 0.3
    assert r["gaps_over_50us_ms"] == 0.3 and r["largest_gaps"][0]["before"] == "one_shot_all_reduce_kernel"
    assert r["host_self_ms"] == {"step": 0.7, "aten::mm": 0.3}
    assert r["categories"] == {"cpu_op": {"events": 1, "first_at_ms": 0.1}, "kernel": {"events": 3, "first_at_ms": 0.2},
                               "python_function": {"events": 1, "first_at_ms": 0.0}}


def test_untimed_device_events_are_counted_and_left_out(tmp_path):
    """A rank's CUDA-graph trace whose kernels came back at time zero with no duration (kineto's thread error):
    they must not stretch the span from zero nor count as GPU work."""
    from trace_gaps import analyze

    ev = [
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 5_000_000, "dur": 900, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 0, "dur": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "gemv", "ts": 0, "dur": 0, "tid": 7},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 0, "tid": 1},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    r = analyze(str(path))
    assert r["span_ms"] == 0.9 and r["gpu_busy_ms"] == 0.0
    assert r["untimed"] == {"kernel": 2, "cuda_runtime": 1}
