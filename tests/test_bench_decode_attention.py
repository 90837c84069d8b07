"""scripts/bench_decode_attention.py on CPU: a batched step's contexts spread around the asked one (so a split count
is timed over uneven sequences, as in a real decode step), and without CUDA it stops with a message."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_decode_attention", ROOT / "scripts" / "bench_decode_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_sequence_has_the_context_and_a_batch_spreads_around_it():
    bench = _load()
    assert bench.seq_lens_for(512, 1) == [512]
    lens = bench.seq_lens_for(512, 250)
    assert len(lens) == 250 and min(lens) == 256 and max(lens) < 768 and abs(sum(lens) / 250 - 512) < 4
    assert lens != sorted(lens) and lens == bench.seq_lens_for(512, 250)  # shuffled, the same every run
    assert bench.seq_lens_for(1, 8) == [1] * 8  # never an empty sequence


def test_without_cuda_it_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode_attention.py"), "--batch", "64", "--tp", "2"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_a_tp_size_that_does_not_split_the_kv_heads_is_refused():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode_attention.py"), "--tp", "1,3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "must divide the 8 KV heads" in r.stderr and "Traceback" not in r.stderr


def test_tiles_parse_and_bad_ones_are_refused_by_name():
    bench = _load()
    assert bench.parse_tiles("") == [] and bench.parse_tiles("64/4/3,128/8/2") == [(64, 4, 3), (128, 8, 2)]
    for bad in ("64/4", "48/4/2", "64/3/2", "64/4/0", "x/4/2"):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode_attention.py"), "--tiles", bad],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and bad in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
