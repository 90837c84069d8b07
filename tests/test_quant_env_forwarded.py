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


def test_tp_step_switches_are_forwarded() -> None:
    """The TP step's switches (the batch-1 pushed partials' waits and tiles, the embedding's form, the prefill-sized
    row-parallel reduce) are read inside the rank actors, so they too must reach them."""
    from parallel.embedding import TP_EMBED_ENV
    from parallel.kernels.gemv import TAKE_TILE_ENV, TAKE_WAIT_ENV, TAKE_X_ENV
    from parallel.p2p_allreduce import GREEDY_GATHER_ENV, PUSHED_ENV
    from parallel.row_reduce import ROW_REDUCE_ENV

    read_in_ranks = {TP_EMBED_ENV, TAKE_WAIT_ENV, TAKE_TILE_ENV, TAKE_X_ENV, ROW_REDUCE_ENV, GREEDY_GATHER_ENV,
                     PUSHED_ENV, "TANDEM_P2P_TWO_SHOT", "TANDEM_TP_PUSH_PARTIALS",
                     "TANDEM_TP_GREEDY_KERNELS"}
    assert read_in_ranks <= set(_FORWARDED_ENV), sorted(read_in_ranks - set(_FORWARDED_ENV))
