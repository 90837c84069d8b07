"""scripts/bench_gemv.py --fp8 --sweep (scripts/bench_gemv_fp8.py) on CPU through Triton's interpreter, on small
shapes: every shape reports bf16 and FP8 rates, the sweep's tiles are run and checked against the first candidate
(a wrong tile is reported and never picked), and the printed FP8_TABLE lines are entries `gemv_quant.table_config`
takes back for those shapes. The GPU timing itself is the script's job on a GPU."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import argparse, ast, contextlib, io, json, os, sys, tempfile
import torch
sys.path.insert(0, os.getcwd())
from parallel.kernels import gemv as gv
from parallel.kernels import gemv_quant as gq
from scripts import bench_gemv_fp8 as b

b.DEVICE, b.HEAD_DIM, b.Q_HEADS, b.KV_HEADS = "cpu", 16, 2, 1
os.environ["TANDEM_QUANT_TUNE"] = "0"  # the engine's tiles without measuring them (CUDA events)
shapes = {"llama-3.1-8b qkv": (64, 512), "llama-3.1-8b o": (32, 512), "llama-3.1-8b gate_up": (64, 512),
          "llama-3.1-8b down": (32, 1024)}
real_gemv = gv.gemv
def bf16_gemv(x, w, bias=None, config=None, **fused):  # the interpreter has no libdevice for gemv's SiLU
    if fused.get("silu"):
        fused.pop("silu")
        y = real_gemv(x, w, bias, config, **fused)
        return torch.nn.functional.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2:]
    return real_gemv(x, w, bias, config, **fused)
gv.gemv = bf16_gemv
full = b.sweep_configs
b.sweep_configs = lambda k, paired, chunks=(8, 16): full(k, paired, chunks)[::5]  # every fifth: the interpreter is slow
calls = []
def bench(fn):
    calls.append(1)
    fn()
    return 1e-3 / len(calls)  # later tiles "faster": the last checked tile of each shape wins
out = os.path.join(tempfile.mkdtemp(), "fp8.json")
a = argparse.Namespace(shapes=",".join(shapes), sweep=True, out=out)
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    b.bench_fp8(a, shapes, 1, bench)
text = buf.getvalue()
rep = json.load(open(out))
assert [r["shape"] for r in rep["results"]] == list(shapes), text
lines = [l for l in text.splitlines() if l.startswith("    (")]
assert len(lines) == 8 and lines[:4] == lines[4:], text  # each shape's line when it is done, then all of them
lines = lines[4:]
for r, line in zip(rep["results"], lines):
    assert r["sweep"] and r["best_config"] == r["sweep"][-1]["config"], r
    assert len(r["sweep"]) == len(b.sweep_configs(r["k"], r["kind"] == "paired")), (r["shape"], text)
    entry = eval("{" + line.split("#")[0].strip().rstrip(",") + "}")
    gq.FP8_TABLE.update(entry)
    qw = b._fp8_weights(r["n"], r["k"], 1)[0]
    assert gq.table_config(qw, r["kind"]) == r["best_config"], (line, r["best_config"])
print("ok", len(lines), sum(len(r["sweep"]) for r in rep["results"]))
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_fp8_sweep_script_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok 4"), out
