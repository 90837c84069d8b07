"""scripts/bench_offline.py --isolate: each layout's run in its own process, merged into one report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_offline.py"


def test_isolated_layouts_run_in_child_processes_and_merge(tmp_path):
    out = tmp_path / "offline.json"
    subprocess.run([sys.executable, str(SCRIPT), "--num-requests", "4", "--mean-output", "4", "--max-output", "8",
                    "--layouts", "uni", "--repeat", "2", "--isolate", "--skip-hf", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    runs = report["results"]
    assert set(runs) == {"tandem[uni]#1", "tandem[uni]#2"}
    for r in runs.values():  # each child generated every requested token and reported its own timing
        assert r["output_tokens"] == report["output_tokens"]
        assert r["seconds"] > 0 and r["vs_first_layout"] == 1.0
    assert report["args"]["isolate"] is True


def test_layout_names_map_to_engine_arguments():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_offline import parse_layout

    assert parse_layout("tp2+g0+nop2p") == {"tensor_parallel_size": 2, "cuda_graph_max_tokens": 0,
                                            "disable_p2p_all_reduce": True}
    assert parse_layout("uni+g512") == {"distributed_executor_backend": "uni", "cuda_graph_max_tokens": 512}
    assert parse_layout("sp2+ulysses") == {"sequence_parallel_size": 2, "sequence_parallel_attention": "ulysses"}
    assert parse_layout("sp2+ring") == {"sequence_parallel_size": 2, "sequence_parallel_attention": "ring"}
    assert parse_layout("tp2+sync") == {"tensor_parallel_size": 2, "async_scheduling": False}
    assert parse_layout("ray+async") == {"distributed_executor_backend": "ray", "async_scheduling": True}
    assert parse_layout("pp2+nooverlap") == {"pipeline_parallel_size": 2, "pipeline_step_overlap": False}
