"""Which quantized layers the fused batch-1 decoder (workers/models/fused_decode.py) can stream, and how.

After load a quantized linear layer on CUDA holds `layer.packed`: tinygemm's int4 layout (tinygemm.py,
4-bit GPTQ / AWQ with bf16 activations) or the Triton layout (packed.py: 8-bit GPTQ, fp16 activations, FP8).
`prepare` describes that weight to the quantized GEMV (parallel/kernels/gemv_quant.py, which reads it in
place: no second copy of any weight), picks its tiles by measuring them once per weight shape (before any
CUDA graph), and stores the result as `layer.gemv_weight`; the fused decoder then takes the model at batch 1
when every decoder linear has one. FP8 layers stream their e4m3 weights with bf16 activations there
(W8A16: exact to the dequantized weight up to fp32 summation order), not the W8A8 `_scaled_mm` product that
larger batches use.

4-bit layers in tinygemm's layout stream through parallel/kernels/w4_mma.py's one-row fused kernel (tensor cores; the
RMSNorm prologue and SiLU / RoPE / residual epilogues, same rounding; programmatic dependent launch inside the graph)
where they already run w4_mma at 1-8 rows (`w4_mma_fits`; TANDEM_FUSED_INT4=auto, the default). On an H200
(2026-11-29, Llama-3.1-8B shapes, docs/benchmarks.md) the decode graph took 2.15 ms a step that way against 2.32 ms on
the unfused decoder with w4_mma per linear and its separate norm, RoPE and SiLU kernels (TANDEM_FUSED_INT4=0), and
1.95 ms (2.11x bf16) after the thirtieth session's kernel changes, 1.82 ms (2.23x) after the thirty-first's.

FP8 layers take it. On an H100 (2026-11-27, Llama-3.1-8B shapes, batch-1 decode beside bf16 in one run) FP8 through the
fused decoder ran at 1.48-1.55x bf16. With TANDEM_FUSED_INT4=1, 4-bit layers take gemv_int4.py's Triton kernel
instead, and only where it is measured at load to beat tinygemm on the same weight
(`faster_than_tinygemm`: the fused call with its prologue and epilogue against tinygemm's bare product; a layer that
loses keeps `gemv_skipped`, so its model keeps the unfused decoder and tinygemm). Why opt-in: on an H100
(2026-11-27, CUDA graphs, weights past L2) that kernel ran at 0.6x tinygemm's speed per shape (qkv / o 600-850 GB/s
against ~1,300; gate/up 54.0 us, 1,156 GB/s, against tinygemm's 33.7 us, 1,850 GB/s; bf16 2,790): CUDA cores spend
4-7 instructions per 4-bit code (gemv_int4.py). On the GPU it agrees with gemv_quant's older integer kernel within
0.3% on every fused op (scripts/gemv_int4_check.py). gemv_quant's older integer path ran at 0.80x bf16 end to end.
The Triton integer layout (8-bit GPTQ, fp16 activations) keeps the unfused decoder.
TANDEM_FUSED_QUANT=0 leaves every quantized layer there (to compare).
"""
from __future__ import annotations

import os

import torch

ENV = "TANDEM_FUSED_QUANT"
INT4_ENV = "TANDEM_FUSED_INT4"  # 4-bit layers in tinygemm's layout: auto (default; w4_mma is a synonym) take w4_mma.py's
# fused one-row kernel; 0 keep the unfused decoder; 1 take gemv_int4.py's Triton kernel (where measured faster than
# tinygemm at load; slower than w4_mma everywhere measured).
INT4_VALUES = ("auto", "w4_mma", "0", "1")


def int4_mode() -> str:
    """TANDEM_FUSED_INT4 as "w4_mma", "0" or "1"; a value outside INT4_VALUES is refused by name."""
    value = os.environ.get(INT4_ENV, "auto").strip().lower()
    if value not in INT4_VALUES:
        raise ValueError(f"{INT4_ENV}={value!r}: expected one of {', '.join(INT4_VALUES)}")
    return "w4_mma" if value == "auto" else value

try:
    from parallel.kernels import gemv_quant as _gq
except ImportError:  # no Triton (CPU machines): quantized models keep the unfused decoder
    _gq = None


def enabled(fmt: int | None = None) -> bool:
    """Whether layers stored as `fmt` (a gemv_quant format; None: any) take the fused GEMV (see the module's note)."""
    if _gq is None or os.environ.get(ENV, "1") == "0":
        return False
    if fmt == _gq.INT4PACK:
        return int4_mode() != "0"
    return fmt is None or fmt == _gq.FP8


def view(pw) -> "_gq.QuantGemvWeight | str":
    """The GEMV's description of a layer's packed weight (PackedWeight or Int4PackWeight), or why there is none."""
    if _gq is None:
        return "no Triton"
    if getattr(pw, "kernel", None) == "tinygemm":
        qw = _gq.QuantGemvWeight(_gq.INT4PACK, pw.weight, pw.scales_and_zeros, None, pw.group_size, 4, pw.out_features,
                                 pw.in_features, j=pw.inner_k_tiles // 2, perm=pw.perm)
    elif pw.bits is None:
        if pw.codes.dtype != torch.float8_e4m3fn:
            return f"FP8 codes in {pw.codes.dtype}"
        qw = _gq.QuantGemvWeight(_gq.FP8, pw.codes, pw.scales, None, pw.group_size, 8, pw.codes.shape[0],
                                 pw.codes.shape[1])
    elif pw.bits in (4, 8):
        k = pw.codes.shape[1] * (32 // pw.bits)
        qw = _gq.QuantGemvWeight(_gq.PACKED, pw.codes, pw.scales, pw.zeros, pw.group_size, pw.bits, pw.codes.shape[0],
                                 k, perm=pw.perm)
    else:
        return f"{pw.bits}-bit codes"
    if not all(t.is_contiguous() for t in (qw.codes, qw.scales) + ((qw.zeros,) if qw.zeros is not None else ())):
        return "non-contiguous codes or scales"
    if _gq.default_config(qw) is None:
        return f"no GEMV tile divides K={qw.k}"
    return qw


_TUNED: dict[tuple, dict] = {}
MEASURED: list[dict] = []  # what `tune` measured, per weight shape (scripts/bench_quant.py reports it)


def tune(qw, dtype: torch.dtype, kind: str) -> dict:
    """The fastest of `gemv_quant.candidates` for this weight shape, format and kind of layer ("paired": gate/up
    with RMSNorm and SiLU, and qkv with RMSNorm and RoPE, measured as the former; "residual": the row-parallel
    epilogue), measured once per shape with CUDA events; the first candidate with TANDEM_QUANT_TUNE=0."""
    paired = kind == "paired"
    table = _gq.table_config(qw, kind)
    if table is not None:  # measured offline for this shape (scripts/bench_gemv.py --fp8 --sweep)
        return table
    cands = _gq.candidates(qw, paired)
    if os.environ.get("TANDEM_QUANT_TUNE", "1") == "0" or len(cands) == 1:
        return cands[0]
    key = (qw.fmt, qw.n, qw.k, qw.group_size, qw.bits, qw.j, qw.perm is not None, qw.zeros is not None,
           qw.scales.shape[-1] if qw.fmt == _gq.FP8 else 0, dtype, kind, qw.codes.device)
    if key not in _TUNED:
        x = torch.randn(1, qw.k, device=qw.codes.device, dtype=dtype)
        fused = _fused_args(qw, dtype, kind)
        times = [(_cold_time(lambda: _gq.qgemv(x, qw, config=c, **fused)), i) for i, c in enumerate(cands)]
        _TUNED[key] = cands[min(times)[1]]
        MEASURED.append(_measured(qw, kind, [(cands[i], ms) for ms, i in times], min(times)[0]))
    return _TUNED[key]


def _measured(qw, kind: str, times: list[tuple[dict, float]], best_ms: float) -> dict:
    """One shape's tuning: each tile's time, and the best one's weight bytes per second (codes and scales)."""
    nbytes = sum(t.numel() * t.element_size() for t in (qw.codes, qw.scales, qw.zeros) if t is not None)
    fmt = {_gq.INT4PACK: "int4 (tinygemm layout)", _gq.PACKED: f"int{qw.bits}", _gq.FP8: "fp8"}[qw.fmt]
    return {"format": fmt, "n": qw.n, "k": qw.k, "kind": kind, "weight_mb": nbytes / 1e6, "best_us": best_ms * 1e3,
            "best_gb_per_s": nbytes / best_ms / 1e6,
            "tiles": [{**{k: c[k] for k in ("BLOCK_N", "KS", "num_warps", "BLOCK_C", "RED", "Q4") if k in c}, "us": ms * 1e3}
                      for c, ms in times]}


def _cold_time(fn, iters: int = 5) -> float:
    """Milliseconds per call of `fn` with its weight out of L2, as in a forward (each layer's weight is read once
    per token): a 64 MB write before each timed call evicts it. Timing the same weight back to back would read
    it from L2 (a 4096 x 4096 int4 layer is 8 MB) and favour the tiles that compute fastest over those that keep
    enough loads in flight. A ~0.1 ms spin kernel before the start event keeps the GPU busy while the host
    launches `fn` (a Triton launch of this many arguments takes tens of microseconds of host time). Without it
    the interval could include that launch: on 2026-11-27 (H100) every FP8 shape measured 130-155 us, from 16.8 to
    117.6 MB of weight, while a whole 32-layer decode step took 3.7 ms."""
    fn()  # compiles
    flush = torch.empty(64 << 20, dtype=torch.uint8, device=torch.cuda.current_device())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for _ in range(iters):
        flush.zero_()
        torch.cuda._sleep(200_000)  # clock cycles: ~0.1 ms at an H100's 1.98 GHz
        start.record()
        fn()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
    return total / iters


def kind_of(layer) -> str:
    """How the fused decoder calls this layer's GEMV: "paired" (gate/up, qkv), "residual" (row-parallel), "plain"."""
    from parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
        return "paired" if sum(layer.out_shards) % 2 == 0 else "plain"  # tuned as the SiLU pairs (needs even rows)
    return "residual" if isinstance(layer, RowParallelLinear) else "plain"


def prepare(layer, dtype: torch.dtype) -> None:
    """Sets `layer.gemv_weight` (or `layer.gemv_skipped`, why not) for a layer with a packed weight on CUDA."""
    if not enabled():
        layer.gemv_skipped = f"{ENV}=0" if _gq is not None else "no Triton"
        return
    if dtype not in (torch.bfloat16, torch.float16):
        layer.gemv_skipped = f"activations in {dtype}"
        return
    qw = view(layer.packed)
    if isinstance(qw, str):
        layer.gemv_skipped = qw
        return
    if not enabled(qw.fmt):
        layer.gemv_skipped = "codes in the Triton integer layout stay on the unfused decoder"
        return
    kind = kind_of(layer)
    if qw.fmt == _gq.INT4PACK and int4_mode() == "w4_mma":
        why = w4_mma_fits(layer, qw, dtype, kind)
        if why is not None:
            layer.gemv_skipped = why
            return
        qw.config = dict(W4MMA=True)
        layer.gemv_weight = qw
        return
    qw.config = tune(qw, dtype, kind)
    if qw.fmt == _gq.INT4PACK:
        why = None if qw.config.get("Q4") else f"no tile of the 4-bit kernel fits (K={qw.k}, inner_k_tiles {2 * qw.j})"
        why = why or faster_than_tinygemm(qw, layer.packed, dtype, kind)
        if why is not None:
            layer.gemv_skipped = why
            return
    layer.gemv_weight = qw


def w4_mma_fits(layer, qw, dtype: torch.dtype, kind: str) -> str | None:
    """None when a 4-bit layer in tinygemm's layout streams through w4_mma.py's fused one-row kernel in the fused
    decoder, else why not: the layer must already run w4_mma at 1-8 rows (`Int4PackWeight.w4_config`: it fits, the
    device probe passed and it measured faster than tinygemm at load), and fit the fused kernel as the decoder calls it
    (gate/up's SiLU pairs, qkv's RoPE heads, the staged input row in shared memory)."""
    from parallel.kernels import w4_mma
    from parallel.linear import QKVParallelLinear

    if dtype != torch.bfloat16:
        return f"activations in {dtype} (w4_mma takes bf16)"
    if getattr(layer.packed, "w4_config", None) is None:
        return "w4_mma does not serve this layer (tinygemm measured faster at load, or it does not fit)"
    head_dim = layer.head_dim if isinstance(layer, QKVParallelLinear) else None
    why = w4_mma.fused_fits(qw.n, qw.k, qw.group_size, 2 * qw.j, silu=kind == "paired" and head_dim is None,
                            head_dim=head_dim)
    return None if why is None else f"w4_mma's fused kernel: {why}"


_VS_TINYGEMM: dict[tuple, str | None] = {}


def faster_than_tinygemm(qw, pw, dtype: torch.dtype, kind: str) -> str | None:
    """None if the fused 4-bit GEMV (its tuned tile, with the decoder's prologue / epilogue for `kind`) is at least as
    fast as tinygemm's bare product on this weight, measured once per shape; else why
    not. Conservative for the fused path: the unfused decoder also runs the norm, SiLU / RoPE and residual kernels.
    Unmeasured (TANDEM_QUANT_TUNE=0), tinygemm stays: it was the faster one wherever both were timed."""
    if os.environ.get("TANDEM_QUANT_TUNE", "1") == "0":
        return "TANDEM_QUANT_TUNE=0: not measured against tinygemm, which stays"
    key = (qw.n, qw.k, qw.group_size, qw.perm is not None, dtype, kind, tuple(sorted(qw.config.items())), qw.codes.device)
    if key not in _VS_TINYGEMM:
        x = torch.randn(1, qw.k, device=qw.codes.device, dtype=dtype)
        ours = _cold_time(lambda: _gq.qgemv(x, qw, **_fused_args(qw, dtype, kind)))
        tiny = _cold_time(lambda: torch.ops.aten._weight_int4pack_mm(x, pw.weight, pw.group_size, pw.scales_and_zeros))
        _VS_TINYGEMM[key] = None if ours <= tiny else f"tinygemm is faster at batch 1 ({tiny * 1e3:.1f} us, fused " \
                                                      f"4-bit GEMV {ours * 1e3:.1f} us)"
        MEASURED.append({"format": "int4 vs tinygemm", "n": qw.n, "k": qw.k, "kind": kind, "ours_us": ours * 1e3,
                         "tinygemm_us": tiny * 1e3})
    return _VS_TINYGEMM[key]


def _fused_args(qw, dtype: torch.dtype, kind: str) -> dict:
    """The fused arguments `tune` times a kind of layer with (gate/up's RMSNorm and SiLU; the residual add)."""
    dev = qw.codes.device
    if kind == "paired":
        return dict(norm_weight=torch.ones(qw.k, device=dev, dtype=dtype), eps=1e-6, silu=True)
    if kind == "residual":
        return dict(residual=torch.randn(1, qw.n, device=dev, dtype=dtype))
    return {}
