"""Which kernel a 4-bit layer runs at 1-8 rows (parallel/quant/tinygemm.py `choose_w4`, parallel/kernels/w4_mma.py),
the parts decided without a GPU: the TANDEM_W4_GEMV values (a bad one is refused by name), the tile per weight shape,
the shapes and row counts the kernel refuses and why, and that its CUDA source is generated per tile with the tile's
constants. The compiled kernel, the probe and the measured choice: tests/gpu/test_w4_mma.py."""
from __future__ import annotations

import pytest
import torch

from parallel.kernels import w4_mma
from parallel.quant import tinygemm as tg


def _weight(n: int, k: int, gs: int = 128, ikt: int = 8) -> tg.Int4PackWeight:
    """Only the fields choose_w4 reads before it compiles or measures anything."""
    return tg.Int4PackWeight(torch.zeros(1, dtype=torch.int32), torch.zeros(1), gs, ikt, n, k)


def test_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tg.W4_ENV, raising=False)
    assert tg.w4_choice() == "auto"
    for v in ("0", "1", "AUTO "):
        monkeypatch.setenv(tg.W4_ENV, v)
        assert tg.w4_choice() == v.strip().lower()
    monkeypatch.setenv(tg.W4_ENV, "yes")
    with pytest.raises(ValueError, match="TANDEM_W4_GEMV='yes'"):
        tg.w4_choice()
    with pytest.raises(ValueError, match="TANDEM_W4_GEMV"):
        tg.choose_w4(_weight(4096, 4096))
    monkeypatch.setenv(tg.W4_ENV, "0")
    assert tg.choose_w4(_weight(4096, 4096)) is None  # never, and nothing compiled


def test_unfit_shapes_keep_tinygemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tg.W4_ENV, "1")  # even when forced: no probe, no compile for a layout it cannot read
    assert tg.choose_w4(_weight(4096, 4096, ikt=4)) is None
    assert tg.choose_w4(_weight(4104, 4096)) is None
    assert tg.choose_w4(_weight(4096, 4096, gs=512)) is None


def test_tiles_and_fits() -> None:
    # gate_up (1,792 16-row tiles), qkv (384), o and down (256), a small layer (64): the measured fastest K splits
    for (n, k), ksplit in {(28672, 4096): 2, (6144, 4096): 8, (4096, 4096): 16, (4096, 14336): 16, (1024, 1024): 16}.items():
        assert w4_mma.tile_for(n, k) == dict(R=1, KSPLIT=ksplit, U=4, SUB=0)
    # an LM head (8,016 tiles): two tiles a CTA, 4 warps, 2 steps; one whose rows do not pair keeps one tile a CTA
    assert w4_mma.tile_for(128256, 4096) == dict(R=2, KSPLIT=4, U=2, SUB=0)
    assert w4_mma.tile_for(128016, 4096) == dict(R=1, KSPLIT=2, U=4, SUB=0)
    assert w4_mma.fits(128256, 4096, 128, 8, R=2) is None
    assert w4_mma.fits(4096, 4096, 128, 8) is None
    assert w4_mma.fits(16, 128, 32, 8, rows=8) is None
    assert "inner_k_tiles 4" in w4_mma.fits(4096, 4096, 128, 4)
    assert "multiple of 128" in w4_mma.fits(4096, 4160, 64, 8)
    assert "multiple of 32" in w4_mma.fits(4112, 4096, 128, 8, R=2)
    assert "group size 512" in w4_mma.fits(4096, 4096, 512, 8)
    assert "9 rows" in w4_mma.fits(4096, 4096, 128, 8, rows=9)
    # the kernel indexes codes and scales in 32 bits: a layer past that is refused, not read wrong
    assert w4_mma.fits(128256, 16384, 128, 8) is None  # an LM head's size fits
    assert "32-bit indices" in w4_mma.fits(1 << 20, 1 << 16, 128, 8)


def test_fused_tile_keeps_the_rows_kernels_k_split() -> None:
    """The one-row fused kernel splits K as the rows kernel does (the same fp32 sums, so the fused and unfused
    decoders agree bit for bit), takes FUSED_STEPS steps a round, and sizes MINB for one wave of its CTAs."""
    for n, k in ((28672, 4096), (6144, 4096), (4096, 4096), (4096, 14336)):
        tile = w4_mma.fused_tile(n, k, sms=132)
        assert tile["KSPLIT"] == w4_mma.tile_for(n, k)["KSPLIT"] and tile["U"] == w4_mma.FUSED_STEPS == 2
        assert tile["MINB"] * 132 >= n // 16 or tile["MINB"] * 32 * tile["KSPLIT"] * 64 == 65536
    assert w4_mma.fused_tile(28672, 4096)["MINB"] == 14  # 1,792 CTAs of 64 threads over 132 SMs
    # a bench override: MINB follows its KSPLIT (14 a wave, capped at 8 CTAs of 128 threads for 64 registers each)
    over = w4_mma.fused_tile(28672, 4096, override=dict(KSPLIT=4, U=4))
    assert (over["KSPLIT"], over["U"], over["MINB"]) == (4, 4, 8)
    assert w4_mma.fused_tile(4096, 4096, override=dict(MINB=1))["MINB"] == 1


def test_staged_kernels_group_tiles_where_an_sm_repeats_the_prologue() -> None:
    """Where the fused kernel stages the row (RMSNorm, act order) and an SM would hold STAGED_CTAS_MIN or more one-tile
    CTAs, a CTA takes several MMA tiles (TPC): the most that divide the launch, fit 1,024 threads and the shared
    memory, and leave no SM more tiles than before. Elsewhere one tile a CTA."""
    gate_up = w4_mma.fused_tile(28672, 4096, sms=132, staged=True)  # 1,792 tiles: 14 an SM -> one CTA of 14
    assert (gate_up["TPC"], gate_up["KSPLIT"], gate_up["MINB"]) == (14, 2, 1)
    assert w4_mma.fused_ctas(28672, 4096, staged=True) == 128 and w4_mma.fused_ctas(28672, 4096, staged=False) == 1792
    assert w4_mma.fused_tile(6144, 4096, sms=132, staged=True)["TPC"] == 1  # qkv: 3 CTAs an SM
    assert w4_mma.fused_tile(28672, 4096, sms=132)["TPC"] == 1  # not staged: nothing repeated
    for tiles, ksplit, sms, k in ((1792, 2, 132, 4096), (1792, 4, 132, 4096), (3584, 2, 108, 8192), (1000, 2, 10, 4096),
                                  (896, 16, 16, 16384), (1409, 2, 16, 4096)):
        t = w4_mma.tiles_per_cta(tiles, ksplit, sms, k)
        assert tiles % t == 0 and 32 * ksplit * t <= 1024
        assert -(-(tiles // t) // sms) * t <= -(-tiles // sms)
        assert w4_mma.fused_smem(k, {"R": 1, "KSPLIT": ksplit, "TPC": t}) <= w4_mma.SMEM_LIMIT
    assert w4_mma.tiles_per_cta(1409, 2, 16, 4096) == 1  # a prime count of tiles: nothing divides it
    assert w4_mma.tiles_per_cta(1792, 4, 132, 4096) == 7  # 8 warps a tile group: at most 8 groups, 7 divides
    # the staged row and the groups' partial sums bound it too: a 44 KB row leaves room for 7 groups, not 16
    assert w4_mma.tiles_per_cta(1792, 2, 16, 22528) == 7 and w4_mma.tiles_per_cta(1792, 2, 16, 4096) == 16


def test_source_carries_the_tile() -> None:
    src = w4_mma.source(2, 16, 8, 256, 1)
    for line in ("#define R 2", "#define KSPLIT 16", "#define U 8", "#define GS 256", "#define CHUNK 128", "#define SUB 1"):
        assert line in src
    assert "#define CHUNK 32" in w4_mma.source(1, 8, 2, 32)
    assert 'extern "C" __global__' in src and "mma.sync.aligned.m16n8k16" in src


def test_bad_calls_are_refused_before_any_launch() -> None:
    """Shapes and dtypes the kernel cannot take raise a ValueError naming why (here on CPU tensors: nothing launches)."""
    packed = torch.zeros(512 // 8, 1024 // 128, 32, 4, dtype=torch.int32)
    sz = torch.zeros(1024 // 128, 512, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="9 rows"):
        w4_mma.gemv_w4_mma(torch.zeros(9, 1024, dtype=torch.bfloat16), packed, sz, 128, 512)
    with pytest.raises(ValueError, match="float32"):
        w4_mma.gemv_w4_mma(torch.zeros(1, 1024), packed, sz, 128, 512)
    with pytest.raises(ValueError, match="K=1000"):
        w4_mma.gemv_w4_mma(torch.zeros(1, 1000, dtype=torch.bfloat16), packed, sz, 128, 512)
    with pytest.raises(ValueError, match="one bf16 row"):
        w4_mma.gemv_w4_mma_fused(torch.zeros(2, 1024, dtype=torch.bfloat16), packed, sz, 128, 512)
    with pytest.raises(ValueError, match="head_dim 40"):
        w4_mma.gemv_w4_mma_fused(torch.zeros(1, 1024, dtype=torch.bfloat16), packed, sz, 128, 480,
                                 rope=type("Rope", (), dict(head_dim=40))())
    with pytest.raises(ValueError, match="SiLU pairs"):
        w4_mma.gemv_w4_mma_fused(torch.zeros(1, 1024, dtype=torch.bfloat16), packed, sz, 128, 48, silu=True)


def test_probe_runs_once_per_device_and_names_what_failed(caplog: pytest.LogCaptureFixture) -> None:
    """The probes' shared mechanism (tinygemm's and w4_mma's): the check runs once per device index, an exception
    counts as a reason, and a reason is logged once as a warning naming the path and what serves instead."""
    calls = []

    def failing(device):
        calls.append(device)
        raise RuntimeError("nvrtc: no such library")

    cache: dict = {}
    dev = torch.device("cuda", 3)
    with caplog.at_level("WARNING"):
        why = tg._probe_once(cache, dev, failing, "the w4_mma GEMV", "tinygemm serves 1-8 rows")
        assert tg._probe_once(cache, dev, failing, "the w4_mma GEMV", "tinygemm serves 1-8 rows") == why
    assert why == "RuntimeError: nvrtc: no such library" and calls == [dev] and cache == {3: why}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the w4_mma GEMV is off on cuda:3" in warnings[0] and "tinygemm serves" in warnings[0]
    ok: dict = {}
    assert tg._probe_once(ok, torch.device("cuda", 0), lambda d: None, "x", "y") is None and ok == {0: None}
