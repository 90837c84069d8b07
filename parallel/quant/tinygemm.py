"""W4A16 on CUDA through PyTorch's own tinygemm int4 kernel (gpt-fast's path), for GPTQ and AWQ 4-bit layers.

    torch.ops.aten._convert_weight_to_int4pack(w uint8 [N, K/2], inner_k_tiles) -> int32 [N/8, K/(IKT*16), 32, IKT/2]
    torch.ops.aten._weight_int4pack_mm(x bf16 [M, K], packed, group_size, scales_and_zeros bf16 [K/gs, N, 2]) -> bf16 [M, N]
with w = (code - 8) * scale + zero per (group, output column) (aten/src/ATen/native/cuda/int4mm.cu; the
uint8 input holds code k of a row in the high nibble of byte k // 2 for even k, the low one for odd k,
as gpt-fast and torchao pack it since torch 2.5). Both ops are CUDA, bf16 activations, sm80+.

At load (`convert`, called from LinearMethod.process_weights once the method has repacked its rank's
weight into the Triton layout, parallel/quant/packed.py) a 4-bit layer's codes, scales and integer
zero points z become the tinygemm layout: zero = (8 - z) * scale, so (q - 8) * scale + zero = (q - z) *
scale, the checkpoint's value (GPTQ's stored zero-minus-one and AWQ's nibble order are already decoded
by then). Scale and zero are rounded to bf16 (GPTQ/AWQ store fp16 scales): the kernel's weight differs
from the reference dequantized one by at most about 2^-8 of a quantization step times the code range,
less than the bf16 rounding of the weight itself. GPTQ act order (`g_idx`) keeps the layout's input
permutation: K is sorted by group at load and the activations' columns are permuted the same way
(`x[:, perm]`) at run time. Group sizes tinygemm lacks (it has 32, 64, 128, 256) that are multiples of
one of them (e.g. one group, -1) repeat each scale over the smaller groups; anything else (8-bit codes,
groups of 16, N not a multiple of 8, K not a multiple of 32, non-bf16 activations) keeps the Triton
kernels, with a log line saying why.

For many rows tinygemm (one m16n8k16 tile column per block, the weights re-read per 16 rows) loses to
dequantize + cuBLAS: per weight shape, at load, the row count from which the latter is faster is
measured (`dequant_rows`); the dequantize kernel reads the int4pack layout directly
(parallel/kernels/int4pack.py). Nothing syncs with the host in `apply`, so it runs inside the decode
CUDA graphs; a one-time probe per device checks the op, the layout and graph capture against plain
torch before any layer uses it, and turns the path off with a warning if any of them fails.

TANDEM_W4A16_KERNEL=triton keeps the Triton kernels (to compare); the default `auto` takes tinygemm
where it fits.

At 1-8 rows (decode batches) a layer runs parallel/kernels/w4_mma.py's tensor-core GEMV instead, which reads this
same layout in place (no second copy), where `choose_w4` finds it faster than tinygemm at load (`Int4PackWeight.
w4_config`; TANDEM_W4_GEMV=0 never, =1 wherever it fits, to compare). On an H200 (2026-11-29) it took every Llama-3.1-8B
shape: 43 us a decoder layer at one row against tinygemm's 68 (scripts/bench_w4_mma.py), half tinygemm's time at
eight rows.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallel.kernels import w4_mma
from parallel.kernels.quant_tiles import cuda_time as _time

log = logging.getLogger(__name__)

KERNEL_ENV = "TANDEM_W4A16_KERNEL"
KERNEL_CHOICES = ("auto", "triton")
GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm takes, largest first
DEFAULT_DEQUANT_ROWS = 64  # without load-time measurement (TANDEM_QUANT_TUNE=0)
TUNE_ROWS = (16, 32, 64, 128, 256, 512, 1024)


def kernel_choice() -> str:
    v = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if v not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={v!r}: choose one of {list(KERNEL_CHOICES)}")
    return v


IKT_ENV = "TANDEM_TINYGEMM_IKT"


def ikt_order() -> tuple[int, ...]:
    """inner_k_tiles to try, first that divides K wins: 8, 4, 2 (gpt-fast's default first), or TANDEM_TINYGEMM_IKT=4 /
    2 to prefer another (scripts/gemv_int4_check.py times tinygemm at batch 1 with each)."""
    first = int(os.environ.get(IKT_ENV, "8"))
    if first not in (2, 4, 8):
        raise ValueError(f"{IKT_ENV}={first}: choose 2, 4 or 8")
    return (first,) + tuple(t for t in (8, 4, 2) if t != first)


def plan_shape(n: int, k: int, group_size: int) -> tuple[int, int] | str:
    """(tinygemm group size, inner_k_tiles) for an [N, K] weight in groups of `group_size` consecutive
    input features, or why the kernel cannot take it."""
    if n % 8:
        return f"N={n} is not a multiple of 8"
    tg = next((g for g in GROUP_SIZES if group_size % g == 0), None)
    if tg is None:
        return f"group size {group_size} is not a multiple of 32 (tinygemm takes 32, 64, 128, 256)"
    if k % tg:
        return f"K={k} is not a multiple of the group size {tg}"
    ikt = next((t for t in ikt_order() if k % (t * 16) == 0), None)
    if ikt is None:
        return f"K={k} is not a multiple of 32"
    return tg, ikt


# ---------------------------------------------------------------- the layout, in plain torch (CPU-testable)

def unpack_codes(words: torch.Tensor, bits: int = 4, chunk_rows: int = 4096) -> torch.Tensor:
    """Triton-layout codes int32 [N, K / (32 / bits)] (low bits first) -> uint8 [N, K], a chunk of rows at a time."""
    n = words.shape[0]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    out = torch.empty(n, words.shape[1] * shifts.numel(), dtype=torch.uint8, device=words.device)
    for r in range(0, n, chunk_rows):
        w = words[r:r + chunk_rows]
        out[r:r + chunk_rows] = ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1).to(torch.uint8)
    return out


def to_uint8_pairs(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) -> uint8 [N, K / 2]: code 2i in the high nibble of byte i, code 2i + 1 in the low one."""
    c = codes.to(torch.uint8)
    return ((c[:, 0::2] << 4) | c[:, 1::2]).contiguous()


def scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, tiny_group: int) -> torch.Tensor:
    """scales, integer zero points z [N, G] (groups of `group_size` inputs) -> tinygemm's bf16 [K / tiny_group, N, 2]:
    (scale, (8 - z) * scale), each repeated over the group_size / tiny_group smaller groups of a group.
    zeros None: symmetric codes around 8 (zero 0)."""
    s = scales.float()
    z = torch.zeros_like(s) if zeros is None else (8.0 - zeros.float()) * s
    sz = torch.stack([s, z], dim=-1)  # [N, G, 2]
    if group_size != tiny_group:
        sz = sz.repeat_interleave(group_size // tiny_group, dim=1)
    return sz.transpose(0, 1).contiguous().to(torch.bfloat16)


def _layout_view(codes: torch.Tensor, ikt: int) -> torch.Tensor:
    """codes [N, K] -> [N/8, K/(ikt*16), 32, ikt/2, 8]: element [nt, ko, t, j, b] is the code of nibble b of word [nt, ko, t, j]."""
    n, k = codes.shape
    j = ikt // 2
    v = codes.reshape(n // 8, 8, k // (ikt * 16), j, 2, 2, 4, 2)  # nt, nq, ko, j, i1, i0, a, lo
    v = v.permute(0, 2, 1, 6, 3, 7, 4, 5)  # nt, ko, nq, a, j, lo, i1, i0   (t = 4 nq + a, b = 4 lo + 2 i1 + i0)
    return v.reshape(n // 8, k // (ikt * 16), 32, j, 8)


def _from_layout(v: torch.Tensor) -> torch.Tensor:
    """The inverse of `_layout_view`: [N/8, K/(ikt*16), 32, ikt/2, 8] -> [N, K]."""
    nt, ko, _, j, _ = v.shape
    v = v.reshape(nt, ko, 8, 4, j, 2, 2, 2).permute(0, 2, 1, 4, 6, 7, 3, 5)  # nt, nq, ko, j, i1, i0, a, lo
    return v.reshape(nt * 8, ko * j * 32)


def int4pack_reference(w_uint8: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Plain-torch model of `_convert_weight_to_int4pack` on CUDA (N a multiple of 8, K of inner_k_tiles * 16)."""
    n, k = w_uint8.shape[0], w_uint8.shape[1] * 2
    codes = torch.empty(n, k, dtype=torch.int64, device=w_uint8.device)
    codes[:, 0::2] = (w_uint8 >> 4).long()
    codes[:, 1::2] = (w_uint8 & 15).long()
    v = _layout_view(codes, inner_k_tiles)
    words = (v << (4 * torch.arange(8, device=v.device))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_int4pack_reference(packed: torch.Tensor, sz: torch.Tensor, tiny_group: int) -> torch.Tensor:
    """The float32 [N, K] weight tinygemm computes from its layout: (code - 8) * scale + zero."""
    nib = (packed.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32, device=packed.device))) & 15  # [nt, ko, 32, j, 8]
    codes = _from_layout(nib)
    g = torch.arange(codes.shape[1], device=packed.device) // tiny_group
    s, z = sz[..., 0].float()[g].t(), sz[..., 1].float()[g].t()  # [N, K]
    return (codes.float() - 8.0) * s + z


# ---------------------------------------------------------------- the layer's weight on CUDA

@dataclass
class Int4PackWeight:
    """One layer's weight in tinygemm's layout; `apply` is its linear. Mirrors PackedWeight's fields the
    rest of the code reads (bits, perm, plan, w8a8_scale)."""

    weight: torch.Tensor  # int32 [N/8, K/(IKT*16), 32, IKT/2]
    scales_and_zeros: torch.Tensor  # bf16 [K/group_size, N, 2]
    group_size: int  # tinygemm's (the checkpoint's, or a divisor of it)
    inner_k_tiles: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None = None
    dequant_rows: int | None = DEFAULT_DEQUANT_ROWS  # from this many rows on: dequantize + cuBLAS; None: never
    bits: int = 4
    kernel: str = "tinygemm"
    plan: dict | None = None
    w8a8_scale: torch.Tensor | None = None
    w4_config: dict | None = None  # 1-8 rows: w4_mma.py's tile (measured faster than tinygemm at load), or None

    def describe(self) -> str:
        tail = f"; dequantize + cuBLAS from {self.dequant_rows} rows" if self.dequant_rows is not None else ""
        head = "w4_mma at 1-8 rows, " if self.w4_config is not None else ""
        return f"{head}tinygemm int4 (group {self.group_size}, inner_k_tiles {self.inner_k_tiles}{tail})"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_and_zeros))

    def dense(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """[N, K] in the layout's (permuted) input order, through the Triton dequantize kernel."""
        from parallel.kernels.int4pack import dequantize_int4pack

        return dequantize_int4pack(self.weight, self.scales_and_zeros, self.group_size, self.out_features,
                                   self.in_features, dtype)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 in the layer's original input order."""
        w = self.dense(torch.float32)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.contiguous()
        m = x.shape[0]
        if m == 0:
            return torch.empty(0, self.out_features, dtype=x.dtype, device=x.device)
        if x.dtype != torch.bfloat16 or (self.dequant_rows is not None and m >= self.dequant_rows):
            return F.linear(x, self.dense(x.dtype), bias)
        if self.w4_config is not None and m <= w4_mma.MAX_ROWS:
            y = w4_mma.gemv_w4_mma(x, self.weight, self.scales_and_zeros, self.group_size, self.out_features,
                                   self.w4_config)
            return y + bias if bias is not None else y
        y = torch.ops.aten._weight_int4pack_mm(x, self.weight, self.group_size, self.scales_and_zeros)
        return y + bias if bias is not None else y


def build(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
          perm: torch.Tensor | None = None) -> Int4PackWeight | str:
    """codes [N, K] (0..15, the layer's K order after any act-order sort), scales / integer zeros [N, K / group_size]
    -> the tinygemm weight on codes' device (CUDA), or why not."""
    n, k = codes.shape
    fit = plan_shape(n, k, group_size)
    if isinstance(fit, str):
        return fit
    tg, ikt = fit
    packed = torch.ops.aten._convert_weight_to_int4pack(to_uint8_pairs(codes), ikt)
    return Int4PackWeight(packed, scales_and_zeros(scales, zeros, group_size, tg), tg, ikt, n, k, perm)


_PROBED: dict[int, str | None] = {}  # device index -> None (works) or why not


def probe(device: torch.device) -> str | None:
    """Once per device: the op exists, its output equals (code - 8) * scale + zero on our layout, the dequantize
    kernel agrees with it, and the op captures into a CUDA graph. None when all hold, else what failed."""
    return _probe_once(_PROBED, device, _check, "the tinygemm int4 path", "the Triton kernels serve instead")


def _probe_once(cache: dict[int, str | None], device: torch.device, check, what: str, instead: str) -> str | None:
    """`check(device)` run once per device index and cached: None (works) or why not; an exception (an op missing
    from this build, a compile or launch failure, a capture error) is a why-not too. A why-not is logged once."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in cache:
        try:
            why = check(device)
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:300]}"
        cache[idx] = why
        if why is not None:
            log.warning("W4A16: %s is off on %s (%s); %s", what, device, why, instead)
    return cache[idx]


def _random_layer(g: torch.Generator, device: torch.device, n: int, k: int, gs: int):
    """A random asymmetric 4-bit layer built as load builds it: (its codes [N, K] on CPU, the Int4PackWeight or why
    not). Explicit dtypes: the loader runs the probes under a bf16 default dtype."""
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // gs, generator=g, dtype=torch.float32) * 0.02 + 0.01
    zeros = torch.randint(0, 16, (n, k // gs), generator=g).float()
    return codes, build(codes.to(device), scales.to(device), zeros.to(device), gs)


def _same_in_graph(fn, x: torch.Tensor, y: torch.Tensor) -> bool:
    """fn captured into a CUDA graph on a copy of x and replayed gives the eager result y."""
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(x.device)
    with torch.cuda.graph(graph):
        static_y = fn(static_x)
    graph.replay()
    torch.cuda.synchronize(x.device)
    return torch.equal(static_y, y)


def _check(device: torch.device) -> str | None:
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability 8.0+"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return f"torch {torch.__version__} has no aten._weight_int4pack_mm"
    g = torch.Generator(device="cpu").manual_seed(0)
    k = 512
    codes, w = _random_layer(g, device, 64, k, 128)
    if isinstance(w, str):
        return w
    if not torch.equal(w.weight.cpu(), int4pack_reference(to_uint8_pairs(codes), w.inner_k_tiles)):
        return "_convert_weight_to_int4pack's layout differs from the documented one"
    ref = dequantize_int4pack_reference(w.weight.cpu(), w.scales_and_zeros.cpu(), w.group_size)  # float32 [N, K]
    x = torch.randn(5, k, generator=g, dtype=torch.float32).to(device, torch.bfloat16)
    want = x.float() @ ref.to(device).t()
    tol = 0.02 * want.abs().max().item()
    mm = lambda v: torch.ops.aten._weight_int4pack_mm(v, w.weight, w.group_size, w.scales_and_zeros)  # noqa: E731
    y = mm(x)
    if (y.float() - want).abs().max().item() > tol:
        return "_weight_int4pack_mm disagrees with (code - 8) * scale + zero on this layout"
    if (w.dense(torch.float32).cpu() - ref).abs().max().item() > 1e-2 * ref.abs().max().item():
        return "the int4pack dequantize kernel disagrees with the layout"
    if not _same_in_graph(mm, x, y):
        return "_weight_int4pack_mm gives another result inside a CUDA graph"
    return None


_DEQUANT_ROWS: dict[tuple, int | None] = {}


def measure_dequant_rows(w: Int4PackWeight) -> int | None:
    """The smallest of TUNE_ROWS at which dequantize + cuBLAS beats tinygemm for this weight shape (None: never),
    measured once per shape at load, before any CUDA graph."""
    if os.environ.get("TANDEM_QUANT_TUNE", "1") == "0":
        return DEFAULT_DEQUANT_ROWS
    key = (w.out_features, w.in_features, w.group_size, w.inner_k_tiles, w.weight.device)
    if key not in _DEQUANT_ROWS:
        found = None
        for rows in TUNE_ROWS:
            x = torch.randn(rows, w.in_features, device=w.weight.device, dtype=torch.bfloat16)
            tiny = _time(lambda: torch.ops.aten._weight_int4pack_mm(x, w.weight, w.group_size, w.scales_and_zeros))
            deq = _time(lambda: F.linear(x, w.dense()))
            if deq < tiny:
                found = rows
                break
        _DEQUANT_ROWS[key] = found
    return _DEQUANT_ROWS[key]


def convert(pw, dtype: torch.dtype) -> Int4PackWeight | str:
    """A PackedWeight (parallel/quant/packed.py) on CUDA -> its tinygemm form, or why it stays with Triton."""
    choice = kernel_choice()
    if choice == "triton":
        return f"{KERNEL_ENV}=triton"
    if pw.bits != 4:
        return f"{'FP8' if pw.bits is None else f'{pw.bits}-bit'} codes (tinygemm is int4 only)"
    if dtype != torch.bfloat16:
        return f"activations in {str(dtype).replace('torch.', '')} (tinygemm takes bf16)"
    why = probe(pw.codes.device)
    if why is not None:
        return f"tinygemm unavailable: {why}"
    w = build(unpack_codes(pw.codes), pw.scales, pw.zeros, pw.group_size, pw.perm)
    if isinstance(w, str):
        return w
    w.dequant_rows = measure_dequant_rows(w)
    w.w4_config = choose_w4(w)
    return w


W4_ENV = "TANDEM_W4_GEMV"
W4_CHOICES = ("auto", "0", "1")
W4_MARGIN = 0.95  # w4_mma must measure at most this fraction of tinygemm's time at load
_W4_CHOICE: dict[tuple, dict | None] = {}
W4_MEASURED: list[dict] = []  # what `choose_w4` timed, per weight shape (scripts/bench_quant.py reports it)


def w4_choice() -> str:
    v = os.environ.get(W4_ENV, "auto").strip().lower() or "auto"
    if v not in W4_CHOICES:
        raise ValueError(f"{W4_ENV}={v!r}: choose one of {list(W4_CHOICES)}")
    return v


def choose_w4(w: Int4PackWeight) -> dict | None:
    """w4_mma's tile for this weight at 1-8 rows, or None (tinygemm). TANDEM_W4_GEMV: `auto` (default) takes it where
    it measures faster than tinygemm at one row at load, as the decode graph runs both (`graph_time`), by W4_MARGIN,
    once per shape (TANDEM_QUANT_TUNE=0: unmeasured); `1` wherever it fits and compiles; `0` never."""
    choice = w4_choice()
    if choice == "0":
        return None
    tile = w4_mma.tile_for(w.out_features, w.in_features)
    if w4_mma.fits(w.out_features, w.in_features, w.group_size, w.inner_k_tiles, R=tile["R"]) is not None:
        return None
    if probe_w4(w.weight.device) is not None:
        return None
    if choice == "1" or os.environ.get("TANDEM_QUANT_TUNE", "1") == "0":
        return tile
    key = (w.out_features, w.in_features, w.group_size, w.weight.device)
    if key not in _W4_CHOICE:
        x = torch.randn(1, w.in_features, device=w.weight.device, dtype=torch.bfloat16)
        tiny = graph_time(lambda: torch.ops.aten._weight_int4pack_mm(x, w.weight, w.group_size, w.scales_and_zeros))
        ours = graph_time(lambda: w4_mma.gemv_w4_mma(x, w.weight, w.scales_and_zeros, w.group_size, w.out_features,
                                                     tile))
        _W4_CHOICE[key] = tile if ours <= W4_MARGIN * tiny else None
        W4_MEASURED.append({"n": w.out_features, "k": w.in_features, "tinygemm_us": tiny * 1e3, "w4_us": ours * 1e3,
                            "tile": tile, "chosen": _W4_CHOICE[key] is not None})
        log.info("W4A16 %dx%d at one row: tinygemm %.1f us, w4_mma %.1f us -> %s", w.out_features, w.in_features,
                 tiny * 1e3, ours * 1e3, "w4_mma" if _W4_CHOICE[key] else "tinygemm")
    return _W4_CHOICE[key]


_W4_PROBED: dict[int, str | None] = {}  # device index -> None (works) or why not


def probe_w4(device: torch.device) -> str | None:
    """Once per device: w4_mma compiles (NVRTC), equals x @ the dequantized weight at 1, 3 and 8 rows for groups of
    32 and 128, and gives the same output replayed from a CUDA graph. None when all hold, else what failed (logged
    once; tinygemm then serves every row count)."""
    return _probe_once(_W4_PROBED, device, _check_w4, "the w4_mma GEMV", "tinygemm serves 1-8 rows")


def _check_w4(device: torch.device) -> str | None:
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability 8.0+"
    g = torch.Generator(device="cpu").manual_seed(0)
    n, k = 64, 512
    tile = w4_mma.tile_for(n, k)
    for gs in (32, 128):
        _, w = _random_layer(g, device, n, k, gs)
        if isinstance(w, str):
            return w
        ref = dequantize_int4pack_reference(w.weight.cpu(), w.scales_and_zeros.cpu(), w.group_size).to(device)
        mm = lambda v: w4_mma.gemv_w4_mma(v, w.weight, w.scales_and_zeros, w.group_size, n, tile)  # noqa: E731
        for m in (1, 3, 8):
            x = torch.randn(m, k, generator=g, dtype=torch.float32).to(device, torch.bfloat16)
            want = x.float() @ ref.t()
            y = mm(x)
            if (y.float() - want).abs().max().item() > 0.01 * want.abs().max().item():
                return f"w4_mma disagrees with x @ the dequantized weight (group {gs}, {m} rows)"
    if not _same_in_graph(mm, x, y):
        return "w4_mma gives another result inside a CUDA graph"
    return None


def graph_time(fn, reps: int = 16) -> float:
    """Milliseconds per call of `fn` as a decode step runs it: replayed from a CUDA graph with its weight out of L2 (a
    64 MB write before each call, timed alone in a second graph and subtracted). Eager single calls mislead here: on
    2026-11-27 (H100) they timed a Triton batch-1 GEMV faster than tinygemm on qkv (21.9 against 23.2 us) where the decode
    graph ran it 1.4x slower (14.0 against 9.9 us)."""
    dev = torch.cuda.current_device()
    flush = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compiles, warms the allocator
    torch.cuda.current_stream().wait_stream(s)
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    times = []
    for g in graphs:
        g.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 3)
    return max(times[0] - times[1], 1e-6) / reps
