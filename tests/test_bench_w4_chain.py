"""scripts/bench_w4_chain.py on CPU: its layer shapes are Llama-3.1-8B's (scripts/model_shapes.py), every tile it
sweeps is one the fused W4 kernel takes for that shape (so a sweep on a GPU times no refused launch), and without
CUDA it (and scripts/profile_decode.py) stops with a message instead of a traceback."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chain_shapes_are_llama_3_1_8b():
    chain, shapes = _load("bench_w4_chain"), _load("model_shapes")
    cfg = shapes.SHAPES["llama-3.1-8b"]
    d, ffn, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // heads
    assert chain.SHAPES == {"qkv": (d + 2 * kv * hd, d), "o": (d, d), "gate_up": (2 * ffn, d), "down": (d, ffn)}
    assert (chain.HEADS, chain.KV_HEADS, chain.HEAD_DIM, chain.HIDDEN) == (heads, kv, hd, d)


def test_swept_tiles_fit_the_fused_kernel():
    from parallel.kernels import w4_mma

    chain = _load("bench_w4_chain")
    for shape, (n, k) in chain.SHAPES.items():
        tiles = chain.sweep_tiles(shape)
        assert len(tiles) == len({tuple(sorted(t.items())) for t in tiles}) >= 4, shape
        for tile in tiles:
            kw = dict(silu=True) if shape == "gate_up" else dict(head_dim=chain.HEAD_DIM) if shape == "qkv" else {}
            assert w4_mma.fused_fits(n, k, chain.GROUP, 8, tile=tile, **kw) is None, (shape, tile)
            full = w4_mma.fused_tile(n, k, override=tile)
            assert full["KSPLIT"] == tile["KSPLIT"] and full["MINB"] >= 1


def test_trace_phases_from_stamps():
    """`--trace`'s reading of the CTA stamps: each kernel's lag after the one before (the last layer's down for qkv),
    its phases' median and slowest CTA, medians over the middle layers."""
    import torch

    chain = _load("bench_w4_chain")
    order = list(chain.SHAPES)
    stamps, clock = [], 0.0
    for layer in range(6):
        kernels = {}
        for s in order:
            ctas = 4
            start = clock + 100  # each kernel's CTAs pass the wait 100 after the one before ends
            t = torch.zeros(ctas, 5, dtype=torch.float64)
            t[:, 0] = start - 50
            t[:, 1] = start + torch.arange(ctas, dtype=torch.float64)  # 0-3 later
            t[:, 2] = t[:, 1] + (30 if s in chain.NORMED else 0)
            t[:, 3] = t[:, 2] + 1000 + 10 * torch.arange(ctas, dtype=torch.float64)  # slowest CTA 30 over the first
            t[:, 4] = t[:, 3] + 7
            kernels[s] = t
            clock = float(t[:, 4].max())
        stamps.append(kernels)
    got = chain.phases(stamps)
    assert list(got) == order
    for s in order:
        row = got[s]
        assert row["lag"] == 100
        assert row["stage"] == row["stage_max"] == (30 if s in chain.NORMED else 0)
        assert row["product"] == 1010 and row["product_max"] == 1030  # torch's median: the lower middle value
        assert row["epilogue"] == row["epilogue_max"] == 7
    with pytest.raises(ValueError, match="two layers"):
        chain.phases(stamps[:1])


@pytest.mark.parametrize("script", ["bench_w4_chain.py", "profile_decode.py"])
def test_without_cuda_it_says_so(script):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--out", os.devnull],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_rank_dims_split_the_layer_over_tp_ranks():
    """`--tp N`: one rank's heads, KV heads and FFN rows, and the GEMV shapes its fused decoder runs."""
    chain = _load("bench_w4_chain")
    assert chain.rank_dims(1)["shapes"] == chain.SHAPES
    two = chain.rank_dims(2)
    assert (two["heads"], two["kv_heads"]) == (16, 4)
    assert two["shapes"] == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)}
    with pytest.raises(ValueError, match="evenly"):
        chain.rank_dims(3)


def test_profile_decode_timeline_lists_the_last_kernels_in_order():
    """`profile_decode.py --timeline N`: the last N device events by start, with durations and the idle gap since the
    previous one ended (negative where a PDL launch overlaps); host events are left out."""
    from types import SimpleNamespace

    prof_mod = _load("profile_decode")

    def ev(name, start, end, device="DeviceType.CUDA"):
        rng = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=rng, device_type=device)

    events = [ev("host_op", 0, 500, "DeviceType.CPU"), ev("gemv", 10, 20), ev("norm", 22, 24), ev("head", 23, 100),
              ev("greedy", 101, 104)]
    lines = prof_mod.timeline(SimpleNamespace(events=lambda: events), 3)
    assert len(lines) == 4 and "host_op" not in "".join(lines)
    rows = [line.split() for line in lines[1:]]
    assert [r[-1] for r in rows] == ["norm", "head", "greedy"]
    assert [float(r[0]) for r in rows] == [0.0, 1.0, 79.0]  # starts from the first listed
    assert [float(r[2]) for r in rows] == [0.0, -1.0, 1.0]  # gaps: a PDL overlap shows negative


PUSHED_CHAIN_SCRIPT = r'''
import importlib.util, sys
import torch
sys.path.insert(0, "scripts")
spec = importlib.util.spec_from_file_location("bench_w4_chain", "scripts/bench_w4_chain.py")
chain_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chain_mod)
import triton
import triton.language as tl
from parallel.kernels import gemv as G
from parallel.p2p_allreduce import EMPTY_BITS


@triton.jit
def _exp(x):
    return tl.exp(x)


class _Libdevice:  # the interpreter has no libdevice.exp (SiLU's epilogue): its own exp stands in
    exp = _exp


G.libdevice = _Libdevice
# a small Llama layer shape, so the interpreter gets through two layers
chain_mod.HIDDEN, chain_mod.HEADS, chain_mod.KV_HEADS, chain_mod.HEAD_DIM, chain_mod.FFN = 64, 4, 2, 16, 96
torch.manual_seed(0)
chain = chain_mod.Chain(2, 20, quant=False, tp=2, device="cpu", dtype=torch.float16)
chain.use_pushed_partials()
slots = chain.pushed_slots
sites = slots.shape[0]
import os
for step in range(3):  # later steps take the sites the first left behind: the cycle's resets
    os.environ["TANDEM_GEMV_TAKE_X"] = "l1" if step == 2 else "l2"  # the last: the K loops' parts through L1
    out = chain.run({})
    empty = (slots.view(torch.int16) == EMPTY_BITS).flatten(1).all(1).tolist()
    assert empty == [True] * (sites - 1) + [False], (step, empty)  # only the last site, `sum_pushed`'s, holds values
    last = slots[sites - 1]
    assert torch.equal(last[0], last[1])  # this GPU pushed both ranks' rows
    assert torch.equal(out[0], (last[0].float() + last[1].float()).half()) and bool(out.isfinite().all())
print("ok", sites)
'''


@pytest.mark.interpreted(PUSHED_CHAIN_SCRIPT, timeout=900)
def test_the_pushed_partials_chain_runs_its_sites_in_turn():
    """`--take`: the chain as a TP rank's batch-1 step runs it (embedding pushed, row-parallel GEMVs pushing, qkv
    and gate/up taking, `sum_pushed` last), two steps in Triton's interpreter on small shapes: every site is taken
    and emptied in turn, and the result is the last site's rows summed."""
    from tests.interpreter import run_interpreted

    out = run_interpreted(PUSHED_CHAIN_SCRIPT).strip()
    assert out == "ok 5", out
