"""Triton GEMMs on quantized weights (issue 15): W4A16 / W8A16 with the dequantization in registers,
and dynamic per-token FP8 activation quantization for the W8A8 `torch._scaled_mm` path.

One weight layout serves GPTQ and AWQ (and FP8 weight-only): `parallel/quant/packed.py` repacks
every checkpoint format into it at load,
    codes   int32 [N, K / PACK]   row n's codes along K, PACK = 32 / BITS per word, low bits first
            (or float8_e4m3fn [N, K] for FP8 weights)
    scales  [N, G]                one per output row and group of GS consecutive input features
    zeros   [N, G] float          (integer codes; none for FP8)
    w[n, k] = scales[n, k // GS] * (code[n, k] - zeros[n, k // GS])
so each output row's codes are contiguous in K, as the bf16 GEMV of `gemv.py` streams its rows.

* `gemv_q`: 1-4 rows (decode). Grid (N / BLOCK_N, M): each program streams BLOCK_N rows' codes over
  the whole K once, summing code * x per packed word in fp32 and applying the word's group scale and
  zero per word: scale * (sum code*x - zero * sum x). No tensor cores: at one row a step is pure
  weight streaming, and 4-bit codes are a quarter of bf16's bytes.
* `gemm_q`: more rows (prefill, big decode batches). Tensor-core tiles: each K tile of codes is
  dequantized to the activation dtype exactly as the reference path rounds it, then `tl.dot`.
* `dequantize` + cuBLAS: for row counts where that measured faster than `gemm_q` (`tune`, at load).
* `quant_fp8_rows`: x [M, K] -> (e4m3 codes, float32 scale per row), scale = amax / 448.

Nothing here syncs with the host, so the kernels run inside CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parallel.kernels.quant_tiles import GEMV_MAX_ROWS, gemm_block_k, gemm_config, gemv_config, supported  # noqa: F401
from parallel.kernels.quant_tiles import fp8_padded_rows
from parallel.kernels.quant_tiles import cuda_time as _time

FP8_MAX = 448.0


@triton.jit
def _codes(w_ptr, offs_n, n_mask, stride_wn, k0, offs_k, BITS: tl.constexpr, FP8: tl.constexpr):
    """[BLOCK_N, BLOCK_K] float32 codes of the K tile starting at k0. Int codes: each int32 word is
    loaded once per code it holds (the repeats hit L1) and shifted to it, so no register reshape."""
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if FP8:
        w = tl.load(rows + (k0 + offs_k)[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
    else:
        PACK: tl.constexpr = 32 // BITS
        k = k0 + offs_k
        words = tl.load(rows + (k // PACK)[None, :], mask=n_mask[:, None], other=0)
        w = ((words >> ((k % PACK) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    return w


@triton.jit
def _gemv_q_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                   GS: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PACK: tl.constexpr):
    # A K tile is BLOCK_W words of PACK codes: codes [BLOCK_N, BLOCK_W, PACK] come from broadcasting
    # each word against the PACK shifts, x is loaded as [BLOCK_W, PACK]; products are summed per word,
    # and each word's group scale and zero (one group never splits a word) are applied per word.
    BLOCK_K: tl.constexpr = BLOCK_W * PACK
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    offs_p = tl.arange(0, PACK)
    rows = offs_n[:, None].to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_xm + k0 + offs_w[:, None] * PACK + offs_p[None, :]).to(tl.float32)  # [W, P]
        if FP8:
            w = tl.load(w_ptr + rows[:, :, None] * stride_wn + k0 + (offs_w[:, None] * PACK + offs_p[None, :])[None, :, :],
                        mask=n_mask[:, None, None], other=0.0).to(tl.float32)
        else:
            words = tl.load(w_ptr + rows * stride_wn + k0 // PACK + offs_w[None, :], mask=n_mask[:, None], other=0)
            w = ((words[:, :, None] >> (offs_p * BITS)[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        part = tl.sum(w * x[None, :, :], axis=2)  # [BLOCK_N, BLOCK_W]
        g = (k0 + offs_w * PACK) // GS
        s = tl.load(s_ptr + rows * stride_sn + g[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + rows * stride_sn + g[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
            part = part - z * tl.sum(x, axis=1)[None, :]
        acc += s * part
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                     GS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SUB: tl.constexpr):
    # FP8 codes are one byte each: a K tile is loaded as [BLOCK_N, BLOCK_K] and split into G_PER runs of
    # SUB features sharing a scale (SUB = min(BLOCK_K, GS)). Measured faster than the per-word layout of
    # `_gemv_q_kernel` for FP8 on an H100 (docs/benchmarks.md).
    G_PER: tl.constexpr = BLOCK_K // SUB
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, G_PER)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    s_row = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, G_PER], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.reshape(tl.load(w_ptrs, mask=n_mask[:, None], other=0.0).to(tl.float32), (BLOCK_N, G_PER, SUB))
        x = tl.reshape(tl.load(x_ptr + m * stride_xm + k0 + offs_k).to(tl.float32), (G_PER, SUB))
        part = tl.sum(w * x[None, :, :], axis=2)  # [BLOCK_N, G_PER]
        g = (k0 + offs_g * SUB) // GS
        s = tl.load(s_row + g[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        acc += s * part
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_q_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                   GS: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles sweep the same weight columns together (L2 reuse of codes).
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    s_row = s_ptr + offs_n.to(tl.int64) * stride_sn
    z_row = z_ptr + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = _codes(w_ptr, offs_n, n_mask, stride_wn, k0, offs_k, BITS, FP8)  # [BLOCK_N, BLOCK_K]
        g = k0 // GS  # BLOCK_K divides GS: one group per tile
        s = tl.load(s_row + g, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_row + g, mask=n_mask, other=0.0).to(tl.float32)
            w = w - z[:, None]
        w = (w * s[:, None]).to(a.dtype)  # rounded as the reference's dequantized weight
        acc = tl.dot(a, tl.trans(w), acc)
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                    GS: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, HAS_ZERO: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w = _codes(w_ptr, offs_n, n_mask, stride_wn, k0, offs_k, BITS, FP8)
    g = k0 // GS
    s = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        w = w - z[:, None]
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + (k0 + offs_k)[None, :]
    tl.store(out, (w * s[:, None]).to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def _common(bits: int | None, gs: int, zeros, bias) -> dict:
    fp8 = bits is None
    return dict(GS=gs, BITS=8 if fp8 else bits, FP8=fp8, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None)


def gemv_q(x, codes, scales, zeros, gs, bits, bias, cfg: dict) -> torch.Tensor:
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if bits is None:
        _gemv_fp8_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), m)](
            x, codes, scales, bias if bias is not None else scales, y, n, k, x.stride(0), codes.stride(0),
            scales.stride(0), y.stride(0), GS=gs, HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], SUB=min(cfg["BLOCK_K"], gs), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return y
    pack = 32 // bits
    _gemv_q_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), m)](
        x, codes, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y, n, k,
        x.stride(0), codes.stride(0), scales.stride(0), y.stride(0), **_common(bits, gs, zeros, bias),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_W=cfg["BLOCK_K"] // pack, PACK=pack, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return y


def gemm_q(x, codes, scales, zeros, gs, bits, bias, cfg: dict) -> torch.Tensor:
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _gemm_q_kernel[grid](x, codes, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
                         y, m, n, k, x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
                         **_common(bits, gs, zeros, bias), GROUP_M=8, **cfg)
    return y


def dequantize(codes, scales, zeros, gs, bits, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype` (for cuBLAS on long prefills)."""
    n = codes.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    bk = gemm_block_k(k, gs)
    c = _common(bits, gs, zeros, None)
    c.pop("HAS_BIAS")
    _dequant_kernel[(triton.cdiv(n, 64), k // bk)](codes, scales, zeros if zeros is not None else scales, out, n, k,
                                                  codes.stride(0), scales.stride(0), out.stride(0), **c, BLOCK_N=64,
                                                  BLOCK_K=bk, num_warps=4)
    return out


def matmul_q(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, gs: int,
             bits: int | None, bias: torch.Tensor | None = None, plan: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(codes)^T (+ bias), in x's dtype. bits None: codes are FP8 [N, K].
    `plan` (from `tune`): the GEMV tiles and, per row bucket, "fused" GEMM or "dequant" + cuBLAS."""
    m, k = x.shape
    n = codes.shape[0]
    assert x.stride(1) == 1 and codes.stride(1) == 1 and (scales.shape[1] == 1 or scales.stride(1) == 1)
    assert zeros is None or zeros.stride(0) == scales.stride(0) and (zeros.shape[1] == 1 or zeros.stride(1) == 1)
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    plan = plan or {}
    if m <= GEMV_MAX_ROWS:
        return gemv_q(x, codes, scales, zeros, gs, bits, bias, plan.get("gemv") or gemv_config(n, k, gs, bits))
    if plan.get(bucket(m)) == "dequant":
        return torch.nn.functional.linear(x, dequantize(codes, scales, zeros, gs, bits, k, x.dtype), bias)
    return gemm_q(x, codes, scales, zeros, gs, bits, bias, gemm_config(m, k, gs))


def bucket(m: int) -> str:
    return "mid" if m <= 1024 else "large"


GEMV_CANDIDATES = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                   for bn, bk, w, st in ((8, 512, 4, 4), (8, 1024, 4, 4), (16, 512, 4, 4), (16, 256, 4, 4),
                                         (32, 256, 8, 3), (4, 1024, 4, 4), (8, 2048, 8, 3))]


_PLANS: dict[tuple, dict] = {}


def tune(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, gs: int, bits: int | None, k: int,
         dtype: torch.dtype, gemm: bool = True) -> dict:
    """Measured once per weight shape (at load, before any CUDA graph): the fastest GEMV tiles of the
    candidates that fit, and for 256 and 2048 rows whether the fused GEMM beats dequantize + cuBLAS."""
    n = codes.shape[0]
    key = (n, k, gs, bits, dtype, gemm)
    if key in _PLANS:
        return _PLANS[key]
    x1 = torch.randn(1, k, device=codes.device, dtype=dtype)
    best, plan = None, {}
    for cfg in GEMV_CANDIDATES:
        if k % cfg["BLOCK_K"] or (bits is None and gs % cfg["BLOCK_K"] and cfg["BLOCK_K"] % gs):
            continue
        t = _time(lambda: gemv_q(x1, codes, scales, zeros, gs, bits, None, cfg))
        if best is None or t < best:
            best, plan["gemv"] = t, cfg
    for rows, name in ((256, "mid"), (2048, "large")) if gemm else ():
        x = torch.randn(rows, k, device=codes.device, dtype=dtype)
        fused = _time(lambda: gemm_q(x, codes, scales, zeros, gs, bits, None, gemm_config(rows, k, gs)), 3)
        deq = _time(lambda: torch.nn.functional.linear(x, dequantize(codes, scales, zeros, gs, bits, k, dtype)), 3)
        plan[name] = "fused" if fused <= deq else "dequant"
    _PLANS[key] = plan
    return plan


# ---------------------------------------------------------------- FP8 activations (W8A8)

@triton.jit
def fp8_row(y, mask, q_ptr, s_ptr, row, stride_q, offs):
    """Quantize one row held in registers (fp32 y, the activation values as the consumer would read them): per-token
    scale amax / 448 (at least 1e-12), codes clamp(y / scale) in e4m3. The producers that emit FP8 activations
    with their output (fused_ops.rms_norm / silu_and_mul) call this on the row they just rounded, so their codes
    are `_quant_fp8_rows_kernel`'s codes of that output, bit for bit."""
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), 0)
    # The scale as torch computes amax / 448.0 (a tensor by a scalar: times the reciprocal, which Triton's `/` by a
    # constant also does; with div_rn the scales differed from torch's on 2 x H200); the codes by IEEE division, as
    # torch divides a tensor by a tensor (Triton's fp32 `/` is the approximate one, which moved codes near a
    # rounding boundary one step from torch's: tests/gpu/test_fp8_fused_act.py, 2026-11-27; not yet rerun).
    scale = tl.maximum(amax / 448.0, 1e-12)
    q = tl.clamp(tl.div_rn(y, scale), -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def fp8_pad_row(q_ptr, s_ptr, row, stride_q, offs, mask):
    """A padding row of the W8A8 GEMM's activations (cuBLAS takes rows in multiples of 16): zero codes, scale 1."""
    tl.store(q_ptr + row * stride_q + offs, tl.zeros(offs.shape, tl.float32).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, 1.0)


@triton.jit
def _quant_fp8_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, BLOCK: tl.constexpr,
                           ONE_PASS: tl.constexpr):
    """Row m < M: its codes and scale. Rows M.. (padding up to a multiple of 16 for cuBLAS): zero codes, scale 1,
    written here rather than by two fill kernels before it. ONE_PASS (K <= BLOCK): the row is read once."""
    m = tl.program_id(0).to(tl.int64)
    if m < M:
        if ONE_PASS:
            offs = tl.arange(0, BLOCK)
            x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            fp8_row(x, offs < K, q_ptr, s_ptr, m, stride_qm, offs)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
                q = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
                tl.store(q_ptr + m * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
            tl.store(s_ptr + m, scale)
    else:
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            fp8_pad_row(q_ptr, s_ptr, m, stride_qm, offs, offs < K)


def quant_fp8_rows(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [R, K], float32 scales [R, 1]) with R = rows or M; rows past M are zero codes
    with scale 1 (cuBLAS wants M padded to a multiple of 16). One kernel, padding included."""
    m, k = x.shape
    r = rows or m
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(r, 1, dtype=torch.float32, device=x.device)
    if r:
        block = min(8192, triton.next_power_of_2(k))
        _quant_fp8_rows_kernel[(r,)](x, q, s, m, k, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=k <= block,
                                     num_warps=4 if block <= 2048 else 8)
    return q, s


def quant_fp8_static(x: torch.Tensor, input_scale: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 clamp(x / input_scale) [R, K], input_scale repeated [R, 1] float32): a checkpoint's
    static per-tensor activation scale (FP8 activation_scheme "static"), with rows past M zero, as in
    quant_fp8_rows. input_scale is a float32 [1] tensor on x's device (no host sync: CUDA-graph safe)."""
    m, k = x.shape
    r = rows or m
    scale = input_scale.reshape(1, 1).float()
    q = torch.zeros(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    q[:m] = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.expand(r, 1).contiguous()


def fp8_activations(x: torch.Tensor, rows: int, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 GEMM's activations: with the checkpoint's static scale when it has one, else per token."""
    return quant_fp8_rows(x, rows) if input_scale is None else quant_fp8_static(x, input_scale, rows)


def scaled_mm_fp8(x: torch.Tensor, w8: torch.Tensor, w_scale_row: torch.Tensor, bias: torch.Tensor | None,
                  input_scale: torch.Tensor | None = None, pre: tuple[torch.Tensor, torch.Tensor] | None = None,
                  fast_accum: bool = False) -> torch.Tensor:
    """W8A8: x [M, K] (16-bit) quantized per token (or with the static input_scale [1] float32), w8 [N, K]
    e4m3 with per-output-channel scales w_scale_row [1, N] float32 -> [M, N] in x's dtype, through
    cuBLASLt's FP8 GEMM (row-wise scaling: a static scale is repeated per row). `pre`: x's codes and scales
    [fp8_padded_rows(M)] already made by the kernel that produced x (parallel/quant/fp8_act.py), so no quantization
    kernel runs here. `fast_accum`: cuBLAS's fast FP8 accumulation (Hopper's reduced-precision accumulator), off
    by default (packed.py: TANDEM_FP8_FAST_ACCUM=1 at load)."""
    m = x.shape[0]
    padded = fp8_padded_rows(m)
    xq, xs = pre if pre is not None else fp8_activations(x, padded, input_scale)
    extra = dict(use_fast_accum=True) if fast_accum else {}
    y = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=w_scale_row, out_dtype=x.dtype, **extra)
    y = y[:m] if padded != m else y
    return y + bias if bias is not None else y
