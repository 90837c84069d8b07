"""`gemv.gemv`'s argument checks, which run before any launch (so on CPU too)."""
import pytest
import torch

from parallel.kernels import gemv


def test_gemv_refuses_a_transposed_weight_or_input():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(64, 32, dtype=torch.bfloat16).t()  # [32, 64] whose rows are strided
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(x, w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(torch.randn(64, 2, dtype=torch.bfloat16)[:, :1].t(), w.contiguous())  # x [1, 64], stride 2


def test_narrow_tiles_are_opt_in_and_leave_one_gpu_shapes(monkeypatch):
    """TANDEM_GEMV_NARROW_TILES=1 gives a TP=2 rank's Llama-3.1-8B qkv (3,072 outputs) and SiLU gate/up (7,168) the
    tiles measured in the one-GPU chain; without it, and for the one-GPU shapes either way, the tuned tiles stay."""
    from parallel.kernels.gemv import NARROW_TILES_ENV, tile_config

    one_gpu = {(6144, 4096, False): tile_config(6144, 4096), (4096, 4096, False): tile_config(4096, 4096),
               (14336, 4096, True): tile_config(14336, 4096, True), (4096, 14336, False): tile_config(4096, 14336)}
    monkeypatch.delenv(NARROW_TILES_ENV, raising=False)
    assert tile_config(3072, 4096) == tile_config(7168, 4096, True) == dict(BLOCK_N=8, BLOCK_K=512, num_warps=4,
                                                                            num_stages=4)
    monkeypatch.setenv(NARROW_TILES_ENV, "1")
    assert tile_config(3072, 4096) == dict(BLOCK_N=8, BLOCK_K=1024, num_warps=8, num_stages=3)
    assert tile_config(7168, 4096, True) == dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=5)
    assert {key: tile_config(*key) for key in one_gpu} == one_gpu
