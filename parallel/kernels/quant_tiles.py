"""Tile-size rules of the quantized GEMMs (quant_gemm.py), in plain Python so that CPU code (which
has no Triton) decides the same way whether a layer's shape fits the kernels."""
from __future__ import annotations

GEMV_MAX_ROWS = 4  # up to here each row streams the codes (from L2 after the first); above, tensor cores


def fp8_padded_rows(m: int) -> int:
    """Rows of the W8A8 GEMM's FP8 activations for m tokens: up to a multiple of 16 (cuBLAS's FP8 GEMM)."""
    return -(-m // 16) * 16


def gemv_block_k(k: int, gs: int, bits: int | None, preferred: int = 512) -> int | None:
    """The GEMV's K tile: a power of two dividing K that is a multiple or a divisor of the group size."""
    bk = preferred
    while bk >= 16:
        if k % bk == 0 and (gs % bk == 0 or bk % gs == 0) and bk >= (4 if bits is None else 32 // bits):
            return bk
        bk //= 2
    return None


def gemm_block_k(k: int, gs: int) -> int | None:
    """The GEMM's K tile: divides both K and the group size (one group per tile), at least 16."""
    for bk in (64, 32, 16):
        if k % bk == 0 and gs % bk == 0:
            return bk
    return None


def supported(k: int, gs: int, bits: int | None) -> bool:
    """The GEMV applies one scale per packed word (FP8: per 4 codes), so a group holds whole words."""
    pack = 4 if bits is None else 32 // bits
    return gs % pack == 0 and gemv_block_k(k, gs, bits) is not None and gemm_block_k(k, gs) is not None


def gemv_config(n: int, k: int, gs: int, bits: int | None) -> dict:
    block_k = gemv_block_k(k, gs, bits, 1024 if bits == 4 else 512)
    return dict(BLOCK_N=8 if n <= 8192 else 16, BLOCK_K=block_k, num_warps=4, num_stages=4)


def gemm_config(m: int, k: int, gs: int) -> dict:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128 if block_m >= 64 else 64, BLOCK_K=gemm_block_k(k, gs),
                num_warps=8 if block_m >= 128 else 4, num_stages=3)


def cuda_time(fn, iters: int = 10) -> float:
    """Milliseconds per call of `fn` on the current CUDA stream, after one warm-up call: how the kernel
    choices made at load (quant_gemm.py, parallel/quant/tinygemm.py) compare their candidates."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
