"""parallel/row_reduce.py: a row-parallel linear's GEMM and all-reduce for prefill-sized inputs (TANDEM_TP_ROW_REDUCE).
On CPU ranks (gloo) `overlap:N` runs its chunks in turn: the row ranges, the in-place sums of row slices and the
wiring into RowParallelLinear and the engine are checked here; the side stream and `direct` need GPUs
(tests/gpu/test_two_gpu_bf16.py -k row_reduce)."""
from __future__ import annotations

import pytest
import torch

from parallel.row_reduce import ROW_REDUCE_ENV, ROW_REDUCE_MIN_ROWS, chunk_bounds, row_reduce_mode, takes
from parallel.state import Group
from tests.multiprocess import run_ranks


def test_the_mode_is_read_and_a_bad_one_refused(monkeypatch):
    monkeypatch.delenv(ROW_REDUCE_ENV, raising=False)
    assert row_reduce_mode() == ("direct", 1)
    for raw, want in ((" Staged", ("staged", 1)), (" Direct", ("direct", 1)), ("overlap:2", ("overlap", 2)), ("OVERLAP:8", ("overlap", 8))):
        monkeypatch.setenv(ROW_REDUCE_ENV, raw)
        assert row_reduce_mode() == want
    for bad in ("overlap", "overlap:1", "overlap:9", "overlap:x", "chunked"):
        monkeypatch.setenv(ROW_REDUCE_ENV, bad)
        with pytest.raises(ValueError, match=ROW_REDUCE_ENV):
            row_reduce_mode()


@pytest.mark.parametrize("rows,chunks,want", [
    (776, 2, [(0, 448), (448, 776)]),
    (1024, 4, [(0, 256), (256, 512), (512, 768), (768, 1024)]),
    (520, 4, [(0, 192), (192, 384), (384, 520)]),  # 64-row boundaries: three chunks fill 520 rows
    (64, 3, [(0, 64)]),
])
def test_chunks_cover_the_rows_on_tile_boundaries(rows, chunks, want):
    got = chunk_bounds(rows, chunks)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == rows and all(a == p[1] for p, (a, _) in zip(got, got[1:]))


def test_which_calls_it_takes(monkeypatch):
    two, one = Group(ranks=[0, 1], rank=0), Group()
    w = torch.zeros(16, 8)
    big, small = torch.zeros(ROW_REDUCE_MIN_ROWS, 8), torch.zeros(ROW_REDUCE_MIN_ROWS - 1, 8)
    monkeypatch.setenv(ROW_REDUCE_ENV, "staged")
    assert not takes(big, w, two)  # the usual path
    monkeypatch.delenv(ROW_REDUCE_ENV, raising=False)
    assert not takes(big, w, two)  # direct, the default: no mapped buffer on CPU ranks, so the usual path
    monkeypatch.setenv(ROW_REDUCE_ENV, "overlap:2")
    assert takes(big, w, two) and not takes(small, w, two) and not takes(big, w, one)
    assert not takes(big, w.half(), two)  # a weight of another dtype (a quantized layer's) is not its to take
    monkeypatch.setenv(ROW_REDUCE_ENV, "direct")
    assert not takes(big, w, two)  # no mapped buffer on CPU ranks


def _row_parallel_check(rank: int, mode: str) -> None:
    import os

    from parallel.linear import RowParallelLinear

    from parallel import row_reduce

    os.environ[ROW_REDUCE_ENV] = mode
    chunked = []  # the row ranges the overlapped path summed: it must be the one that ran
    real = row_reduce._overlapped
    row_reduce._overlapped = lambda x, w, g, chunks: chunked.append(row_reduce.chunk_bounds(x.shape[0], chunks)) or real(
        x, w, g, chunks)
    torch.manual_seed(0)
    k, n, rows = 64, 48, ROW_REDUCE_MIN_ROWS + 40
    full_w, x, bias = torch.randn(n, k), torch.randn(rows, k), torch.randn(n)
    row = RowParallelLinear(k, n, bias=True)
    half = k // 2
    row.weight.data.copy_(full_w[:, rank * half:(rank + 1) * half])
    row.bias.data.copy_(bias)
    got = row(x[:, rank * half:(rank + 1) * half].contiguous())
    want = x @ full_w.t() + bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert chunked == ([[(0, 192), (192, 384), (384, 552)]] if mode == "overlap:3" else []), chunked
    small = torch.randn(ROW_REDUCE_MIN_ROWS - 1, half)  # a decode-sized call keeps the usual path
    row(small)
    assert len(chunked) == (1 if mode == "overlap:3" else 0)


@pytest.mark.parametrize("mode", ["overlap:3", "staged"])
def test_row_parallel_linear_sums_its_chunks(mode):
    run_ranks(_row_parallel_check, 2, mode, parallel={"tensor_parallel_size": 2})


@pytest.mark.slow
def test_tp2_engine_with_overlapped_chunks_matches_hf(monkeypatch, shared_ray):
    """A TP=2 engine whose prefill steps are over ROW_REDUCE_MIN_ROWS tokens, with TANDEM_TP_ROW_REDUCE=overlap:3 given
    to its rank actors (cluster/ray_runtime.py): greedy tokens equal to Hugging Face's."""
    from engine.llm import LLM
    from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
    from workers.sampling_params import SamplingParams

    path = tiny_model("llama", num_hidden_layers=2, vocab_size=301, max_position_embeddings=2048)
    prompts = prompts_of_lengths([700, 9, 560], vocab_size=290, seed=3)
    monkeypatch.setenv(ROW_REDUCE_ENV, "overlap:3")
    llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=1024, max_num_seqs=4, show_progress=False)
    try:
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in got] == hf_greedy_argmax(path, prompts, 5)


@pytest.mark.slow
def test_the_benchmark_runs_on_cpu_and_checks_each_mode(tmp_path, capsys):
    """scripts/bench_row_reduce.py with two gloo ranks: a cell per shape, row count and mode (each mode's output
    checked against the staged one's before it is timed); `direct` needs the GPUs' mapped buffer, so it has none."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_row_reduce import main

    out = tmp_path / "rr.json"
    assert main(["--world-size", "2", "--device", "cpu", "--rows", "520", "--hidden", "32", "--iters", "2",
                 "--modes", "direct,overlap:2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["shape"], r["mode"]) for r in rows} == {(s, m) for s in ("o", "down")
                                                      for m in ("gemm", "all_reduce", "staged", "overlap:2")}
    assert all(r["rows"] == 520 and r["us"] > 0 for r in rows)
    assert "overlap:2" in capsys.readouterr().out
