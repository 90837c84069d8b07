"""The quantization kernels' switches reach the rank actors: every env var parallel/quant reads at load (the 4-bit
kernel choices, the fused-GEMV switches, load-time tuning) is in cluster/ray_runtime.py's forwarded list, so a TP
rank or a PD pool's engine picks the same kernels as the process the user set them in."""
from __future__ import annotations

from cluster.ray_runtime import _FORWARDED_ENV
from parallel.quant import fused_gemv, tinygemm


def test_quant_switches_are_forwarded() -> None:
    read_at_load = {tinygemm.KERNEL_ENV, tinygemm.IKT_ENV, tinygemm.W4_ENV, fused_gemv.ENV, fused_gemv.INT4_ENV,
                    "TANDEM_QUANT_TUNE", "TANDEM_FP8_TABLE", "TANDEM_FP8_FUSED_ACT", "TANDEM_FP8_FAST_ACCUM"}
    assert read_at_load <= set(_FORWARDED_ENV), sorted(read_at_load - set(_FORWARDED_ENV))
