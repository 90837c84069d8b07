"""Dequantize a weight in PyTorch's tinygemm int4 layout (`torch.ops.aten._convert_weight_to_int4pack`)
back to a dense [N, K] matrix, for the row counts where dequantize + cuBLAS beats the tinygemm kernel
(parallel/quant/tinygemm.py).

The layout (aten/src/ATen/native/cuda/int4mm.cu, CUDA, `matrix_to_m16n8k16_Bint4_layout`):
    packed int32 [N / 8, K / (IKT * 16), 32, IKT / 2]        IKT = inner_k_tiles (2, 4 or 8), J = IKT / 2
word [nt, ko, t, j], nibble b (bits 4b .. 4b+3) with b = 4 lo + 2 i1 + i0 holds the code of
    n = 8 nt + t // 4
    k = ko * IKT * 16 + 32 j + 16 i1 + 8 i0 + 2 (t % 4) + lo
and w[n, k] = (code - 8) * scale[k // GS, n] + zero[k // GS, n] (scales_and_zeros [K / GS, N, 2], bf16).
`parallel/quant/tinygemm.py` models the same layout in plain torch (`int4pack_reference`), which the
interpreter test checks this kernel against and the GPU test checks against the real op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_int4pack_kernel(w_ptr, sz_ptr, out_ptr, N, K, KO, GS: tl.constexpr, J: tl.constexpr,
                             BLOCK_KO: tl.constexpr):
    E: tl.constexpr = 32 * J * 8  # codes of one (nt, ko) super-tile
    nt = tl.program_id(0)
    e = tl.arange(0, E)
    word = e // 8
    b = e % 8
    t = word // J
    j = word % J
    lo = b // 4
    i1 = (b // 2) % 2
    i0 = b % 2
    n = nt * 8 + t // 4
    k_in = j * 32 + i1 * 16 + i0 * 8 + (t % 4) * 2 + lo
    out_row = out_ptr + n.to(tl.int64) * K
    for d in range(BLOCK_KO):
        ko = tl.program_id(1) * BLOCK_KO + d
        k = ko * (J * 32) + k_in
        ok = k < K  # ko < KO, as a tensor
        words = tl.load(w_ptr + (nt.to(tl.int64) * KO + ko) * (32 * J) + word, mask=ok, other=0)
        q = ((words >> (b * 4)) & 15).to(tl.float32)
        g = k // GS
        s = tl.load(sz_ptr + (g.to(tl.int64) * N + n) * 2, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + (g.to(tl.int64) * N + n) * 2 + 1, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + k, ((q - 8.0) * s + z).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_int4pack(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, n: int, k: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed (the int4pack layout above), scales_and_zeros bf16 [K / group_size, N, 2] -> w [N, K] in dtype."""
    j = packed.shape[3]
    ko = packed.shape[1]
    assert packed.is_contiguous() and scales_and_zeros.is_contiguous() and n % 8 == 0 and ko * j * 32 == k
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    block_ko = 4
    _dequant_int4pack_kernel[(n // 8, triton.cdiv(ko, block_ko))](packed, scales_and_zeros, out, n, k, ko, GS=group_size,
                                                                  J=j, BLOCK_KO=block_ko, num_warps=4)
    return out
