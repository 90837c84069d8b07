"""scripts/trace_stages.py: stages from `tandem.trace` lines, in a server log or as JSONL, per site."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import trace_stages  # noqa: E402

REMOTE = {"request_id": "a", "site": "remote", "ms": {"arrival": 0.0, "replica_received": 2.0, "reserved": 3.0,
                                                      "queued": 5.0, "scheduled": 6.0, "first_token": 16.0,
                                                      "prefill_answered": 18.0, "kv_push_start": 20.0,
                                                      "kv_push_end": 50.0, "decode_started": 51.0,
                                                      "first_decode_step": 55.0, "first_byte": 21.0}}


def test_stages_of_a_server_log_and_of_jsonl_agree(tmp_path: Path):
    log = tmp_path / "pd.log"
    other = dict(REMOTE, request_id="b", ms=dict(REMOTE["ms"], kv_push_end=30.0))
    log.write_text("(ServeReplica pid=1) 2026-11-26 22:05:45,358 tandem.trace " + json.dumps(REMOTE) + "\n"
                   "unrelated line\n(ServeReplica pid=1) 2026-11-26 22:05:46,000 tandem.trace " + json.dumps(other) + "\n")
    jsonl = tmp_path / "pd.jsonl"
    jsonl.write_text(json.dumps(REMOTE) + "\n" + json.dumps(other) + "\n")
    from_log = trace_stages.summary(trace_stages.read_timelines(log))
    assert from_log == trace_stages.summary(trace_stages.read_timelines(jsonl))
    remote = from_log["remote"]
    assert remote["kv_push"] == {"n": 2, "p50": 20.0, "p90": 30.0}
    assert remote["prefill"]["p50"] == 10.0 and remote["kv_wait"]["p50"] == 2.0 and remote["dispatch"]["p50"] == 2.0


def test_a_file_without_traces_is_a_clear_error(tmp_path: Path):
    empty = tmp_path / "server.log"
    empty.write_text("no traces here\n")
    done = subprocess.run([sys.executable, "scripts/trace_stages.py", str(empty)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and "no tandem.trace records" in done.stderr and "Traceback" not in done.stderr
