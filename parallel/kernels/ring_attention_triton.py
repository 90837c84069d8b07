"""One ring-attention step in Triton: query rows against one K/V chunk, with the log-sum-exp, merged in place.

`chunk_attention(q, k, v, scale, q_pos, k_pos)`: q [Tq, Hq, D], k/v [Tk, Hkv, D] (GQA: query head h
reads KV head h // (Hq / Hkv), KV heads never repeated); q_pos [Tq] / k_pos [Tk] ascending absolute
positions of the rows (a query sees the keys at positions <= its own), or both None (every query sees
every key). Returns out [Tq, Hq, D] and lse [Tq, Hq] fp32 (-inf, out 0, for a row that sees no key).
`chunk_attention_merge_` instead merges the chunk's attention into running fp32 accumulators
(out, lse) in place, exactly (the LSE merge of parallel/ring_attention.py). `ring_step` is what
parallel/ring_attention.py's ring runs per step: one launch for a whole ragged batch, driven by a tile
table (`build_tiles`, made once per pair of shards and reused by every layer), whose first step writes the
fp32 accumulators (no zero fill), middle steps merge into them and last step merges and writes the output
in q's dtype (no separate cast); a ring of one writes the output directly.

Flash-attention-2 style: one program per (head group, tile of query rows), online softmax over BLOCK_N key
tiles in registers, exp2 with log2(e) folded into the scale. Each tile-table row is one query tile:
rows [q0, q1) of one sequence, its keys rows [k0, k_end), of which [k0, k_full) are seen by every query of
the tile (those tiles run with no mask at all: no position loads, no compares) and [k_full, k_end) by some
(only the tiles there load positions and compare them; positions may be any ascending sets: the SP layout
interleaves the ranks' 16-token blocks); keys past k_end are in the whole tile's future and never loaded.
Rows are sorted heaviest first (the tiles with the most keys start first, the grid's tail is the short
ones) and heads vary fastest in the grid (programs sharing K/V tiles run together and hit L2).

GQA packing (`RingConfig.pack`): a program takes all Hq / Hkv query heads of one KV head for BLOCK_M / G
query rows, interleaved in the M dimension (row m: position m // G, head m % G), so every K/V tile it loads
serves G heads (G times fewer K/V loads from L2 than one program per query head); otherwise one program per
query head and BLOCK_M rows. Launch configs: `RingConfig`, the `CONFIGS` table by head dim, the
TANDEM_RING_KERNEL environment variable ("BLOCK_M,BLOCK_N,warps,stages[,pack]"); scripts/tune_ring_kernel.py
times candidates on a GPU. Memory: the inputs, the accumulators and output, and the tile table, O(chunk).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

try:  # TMA descriptors (Triton >= 3.4, Hopper and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

_LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_FIELDS = 6  # a tile-table row: q0, q1, k0, k_full, k_end, causal (int32)
ENV = "TANDEM_RING_KERNEL"


@dataclass(frozen=True)
class RingConfig:
    """Launch configuration of the ring kernel: tile sizes, warps, pipeline stages and GQA packing (a program
    takes every query head of one KV head: BLOCK_M / G query rows x G heads, see the module docstring)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: bool = False

    @classmethod
    def parse(cls, text: str) -> "RingConfig":
        """"BLOCK_M,BLOCK_N,warps,stages" with an optional fifth field "pack" (or 1/0): as the env variable."""
        parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
        if len(parts) not in (4, 5):
            raise ValueError(f"a ring kernel config is BLOCK_M,BLOCK_N,warps,stages[,pack], not {text!r}")
        pack = len(parts) == 5 and parts[4].lower() in ("pack", "1", "true", "p")
        cfg = cls(*(int(p) for p in parts[:4]), pack)
        if cfg.block_m < 16 or cfg.block_n < 16 or cfg.num_warps < 1 \
                or cfg.num_stages < 1 or cfg.block_m & (cfg.block_m - 1) or cfg.block_n & (cfg.block_n - 1):
            raise ValueError(f"bad ring kernel config {text!r}: tiles powers of two >= 16, warps and stages >= 1")
        return cfg

    def __str__(self) -> str:
        return f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}" + (",pack" if self.pack else "")

    def heads_per_program(self, gqa: int) -> int:
        """Query heads one program takes: the GQA group when packing (and it fits BLOCK_M with >= 1 row), else 1."""
        return gqa if self.pack and gqa > 1 and self.block_m % gqa == 0 and gqa & (gqa - 1) == 0 else 1


# Long query chunks in 16/32-bit floats, by head dim: (TMA loads, plain loads). 128 x 128 tiles, 8 warps and
# 3 stages are the prefill kernel's best on an H100 at 8K tokens (scripts/bench_prefill_attention.py); three
# stages of 128 x 128 K/V tiles need Hopper's shared memory, hence 128 x 64 with plain loads.
# scripts/tune_ring_kernel.py times candidates for this kernel; edit here with what it finds. Its first run
# (H100, 2026-11-26, docs/benchmarks.md) put GQA packing first: each K/V tile then serves the group's query
# heads, 0.491x of SP=1 at 64K SP=2 against 0.516x unpacked, and at least as good in 5 of 6 cells.
CONFIGS: dict[int, tuple[RingConfig, RingConfig]] = {
    d: (RingConfig(128, 128, 8, 3, True), RingConfig(128, 64, 8, 3, True)) for d in (16, 32, 64, 128)
}


def default_config(tq: int, head_dim: int, element_size: int, tma: bool) -> RingConfig:
    """The config for `tq` query rows: TANDEM_RING_KERNEL if set, else `CONFIGS` (16-bit floats, D <= 128,
    >= 128 rows), else fp32 (two stages: three would not fit in shared memory) or short chunks."""
    env = os.environ.get(ENV)
    if env:
        return RingConfig.parse(env)
    if tq >= 128 and head_dim in CONFIGS and element_size == 2:
        return CONFIGS[head_dim][0 if tma else 1]
    if tq >= 128 and head_dim <= 128:
        return RingConfig(128, 64, 8, 2)
    return RingConfig(max(16, min(64, triton.next_power_of_2(max(tq, 1)))), 64, 4, 2)


@triton.jit
def _tile(q, k, v, m_i, l_i, acc, qk_scale, visible, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One K/V tile of online softmax in the log2 domain; q [M, D], k/v [N, D], visible [M, N] (MASK only)."""
    if IEEE:  # fp32 inputs: exact fp32 products, not TF32
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet stays at -inf: subtract 0 instead (exp2(-inf) = 0, no nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
    else:  # every score visible: the scale rides on the max subtraction (one FMA per score)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_safe = m_new
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_safe)  # the old sums were relative to the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _load_kv(ptr, desc, start_n, valid, col, stride_t, offs_d, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
             BOUNDED: tl.constexpr):
    """K or V rows [start_n, start_n + BLOCK_N) of the KV head whose values start at column `col` (TMA: one
    box, rows past the tensor zero-filled; else plain loads, masked by `valid` when BOUNDED: a tile that may
    run past the keys in use). Rows past the tile's keys are masked by the caller."""
    if TMA:
        x = desc.load([start_n, col])
    else:
        rows = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        ptrs = ptr + rows[:, None] * stride_t + col + offs_d[None, :]
        if BOUNDED:
            x = tl.load(ptrs, mask=valid[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit(do_not_specialize=["load_prev", "store_acc", "store_out"])  # one compile for every step
def _ring_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, qpos_ptr, kpos_ptr, tiles_ptr, acc_o_ptr, acc_l_ptr, out_ptr,
                 qk_scale, n_groups, load_prev, store_acc, store_out,
                 stride_qt, stride_qh, stride_kt, stride_vt, stride_at, stride_ah, stride_lt, stride_lh,
                 stride_ot, stride_oh,
                 GQA: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr):
    # Heads vary fastest: the programs of one tile (same keys) run side by side.
    pid = tl.program_id(0)
    hg = pid % n_groups  # head group: query heads hg * HP .. hg * HP + HP - 1
    row = tiles_ptr + (pid // n_groups) * 6
    q0 = tl.load(row)
    q1 = tl.load(row + 1)
    k0 = tl.load(row + 2)
    k_full = tl.load(row + 3)  # keys [k0, k_full) are seen by every query of the tile
    k_end = tl.load(row + 4)  # keys [k_end, ...) by none of them
    causal = tl.load(row + 5)  # 0: every key in [k0, k_end) is seen by every query (bounds masks only)
    if (k_end == k0) & (load_prev != 0) & (store_out == 0):  # nothing to add: the accumulators stay as they are
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    t_idx = q0 + offs_m // HP  # query row of each M row (HP > 1: GQA packing, heads interleaved)
    head = hg * HP + offs_m % HP
    mask_m = t_idx < q1
    rows = t_idx.to(tl.int64)
    kv_col = ((hg * HP) // GQA) * D  # k/v rows hold Hkv heads of D contiguous values
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full_end = k0 + ((k_full - k0) // BLOCK_N) * BLOCK_N
    for start_n in range(k0, full_end, BLOCK_N):  # every score visible: no mask, no positions
        k = _load_kv(k_ptr, k_desc, start_n, None, kv_col, stride_kt, offs_d, BLOCK_N, TMA, False)
        v = _load_kv(v_ptr, v_desc, start_n, None, kv_col, stride_vt, offs_d, BLOCK_N, TMA, False)
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, None, False, IEEE)
    # The tiles that straddle some query's position (and the partial last tile). Query positions are loaded
    # only now, so they take no registers in the loop above; without `causal` no position is read.
    use_pos = (tl.zeros([BLOCK_M], tl.int32) + causal) != 0
    qpos = tl.load(qpos_ptr + t_idx, mask=mask_m & use_pos, other=2147483647)
    for start_n in range(full_end, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < k_end
        k = _load_kv(k_ptr, k_desc, start_n, mask_n, kv_col, stride_kt, offs_d, BLOCK_N, TMA, True)
        v = _load_kv(v_ptr, v_desc, start_n, mask_n, kv_col, stride_vt, offs_d, BLOCK_N, TMA, True)
        kpos = tl.load(kpos_ptr + offs_n, mask=mask_n & ((tl.zeros([BLOCK_N], tl.int32) + causal) != 0), other=0)
        visible = mask_n[None, :] & (qpos[:, None] >= kpos[None, :])
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, visible, True, IEEE)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    a_ptrs = acc_o_ptr + rows[:, None] * stride_at + head[:, None] * stride_ah + offs_d[None, :]
    l_ptrs = acc_l_ptr + rows * stride_lt + head * stride_lh
    if load_prev != 0:  # out, lse := the merge of the accumulators and this chunk's partial, as merge_into does
        prev_o = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
        prev_lse = tl.load(l_ptrs, mask=mask_m, other=float("-inf"))
        hi = tl.maximum(prev_lse, lse)
        hi = tl.where(hi == float("-inf"), 0.0, hi)
        w_prev = tl.exp(prev_lse - hi)
        w_new = tl.exp(lse - hi)
        total = w_prev + w_new
        out = (prev_o * w_prev[:, None] + out * w_new[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
        lse = tl.where(total > 0, hi + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    if store_acc != 0:
        tl.store(a_ptrs, out.to(acc_o_ptr.dtype.element_ty), mask=mask_m[:, None])
        tl.store(l_ptrs, lse, mask=mask_m)
    if store_out != 0:  # the final output, in its own dtype
        o_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: one float dtype, head dim a power of two in [16, 256],
    Hq a multiple of Hkv, unit stride along D and the KV heads packed (k/v rows [Hkv * D])."""
    d = q.shape[-1]
    return (q.dtype in DTYPES and k.dtype == v.dtype == q.dtype and 16 <= d <= 256 and d & (d - 1) == 0
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and q.stride(2) == 1
            and all(x.stride(2) == 1 and x.stride(1) == d for x in (k, v)))


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def tma_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K/V can be read by TMA: Hopper or newer and 16-byte aligned bases and row strides."""
    if _TensorDescriptor is None or not k.is_cuda or _capability(k.device)[0] < 9:
        return False
    return all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in (k, v))


def rows_per_tile(config: RingConfig, num_q_heads: int, num_kv_heads: int) -> int:
    """Query rows (tokens) per tile-table row under `config`: BLOCK_M, or BLOCK_M / G when packing GQA."""
    return config.block_m // config.heads_per_program(num_q_heads // num_kv_heads)


def build_tiles(q_pos: list[np.ndarray], k_pos: list[np.ndarray], q_offsets: list[int], k_offsets: list[int],
                block_q: int, cover: bool = False) -> np.ndarray:
    """The tile table of one ring step for a ragged batch, on the host: int32 [n, TILE_FIELDS].

    Sequence b's queries are rows [q_offsets[b], + len(q_pos[b])) at positions q_pos[b] (ascending), its keys
    rows [k_offsets[b], + len(k_pos[b])) at k_pos[b]. Per query tile of `block_q` rows (from the first query
    that sees any key): q0, q1, k0, k_full, k_end (absolute rows, see the module docstring) and causal (0 where
    every key up to k_end is seen by every query of the tile). `cover`: also rows for the queries that see none
    of these keys (k_end = k0), so a launch that writes the accumulators or the output reaches every row.
    Sorted by keys per tile, most first."""
    parts = []
    for qp, kp, qo, ko in zip(q_pos, k_pos, q_offsets, k_offsets):
        nq = len(qp)
        k_hi = int(np.searchsorted(kp, qp[-1], side="right")) if nq and len(kp) else 0
        q_lo = int(np.searchsorted(qp, kp[0], side="left")) if k_hi else nq  # earlier queries see no key
        if cover and q_lo:
            s = np.arange(0, q_lo, block_q)
            empty = np.stack([s, np.minimum(s + block_q, q_lo), *([np.zeros_like(s)] * 4)], 1)
            parts.append(empty + [qo, qo, ko, ko, ko, 0])
        if q_lo < nq:
            s = np.arange(q_lo, nq, block_q)
            e = np.minimum(s + block_q, nq)
            kf = np.searchsorted(kp[:k_hi], qp[s], side="right")
            ke = np.searchsorted(kp[:k_hi], qp[e - 1], side="right")
            causal = (kf < ke).astype(s.dtype)
            parts.append(np.stack([s + qo, e + qo, np.full_like(s, ko), kf + ko, ke + ko, causal], 1))
    if not parts:
        return np.zeros((0, TILE_FIELDS), dtype=np.int32)
    tiles = np.concatenate(parts).astype(np.int32)
    return tiles[np.argsort(tiles[:, 2] - tiles[:, 4], kind="stable")]


def _device_tiles(q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, tq: int, tk: int, block_q: int,
                  device: torch.device) -> torch.Tensor:
    """The tile table of one sequence (rows [0, Tq), keys [0, Tk)) built on the device from device positions
    (no host round trip): tiles last-first, which is most keys first for ascending positions."""
    s = torch.arange(0, tq, block_q, device=device)
    e = torch.clamp(s + block_q, max=tq)
    if q_pos is None:
        kf = ke = torch.full_like(s, tk)
    else:
        kf = torch.searchsorted(k_pos, q_pos[s], right=True)
        ke = torch.searchsorted(k_pos, q_pos[e - 1], right=True)
    table = torch.stack([s, e, torch.zeros_like(s), kf, ke, (kf < ke).to(s.dtype)], 1)
    return table.flip(0).to(torch.int32).contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None,
           k_pos: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"want q [Tq, Hq, D], k and v [Tk, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not supported(q, k, v):
        raise ValueError(f"chunk_attention needs fp16/bf16/fp32 q, k, v of one dtype, D a power of two in [16, 256], "
                         f"Hq a multiple of Hkv and packed heads; got {q.dtype}/{k.dtype}/{v.dtype}, "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos go together: both position tensors (causal) or both None")
    if q_pos is not None and (q_pos.shape != (q.shape[0],) or k_pos.shape != (k.shape[0],)):
        raise ValueError(f"q_pos must be [Tq] and k_pos [Tk]; got {tuple(q_pos.shape)}, {tuple(k_pos.shape)}")


def as_config(tiles: RingConfig | tuple | None, tq: int, q: torch.Tensor, tma: bool) -> RingConfig:
    """`tiles` as a RingConfig: given one, a (BLOCK_M, BLOCK_N, warps, stages[, pack]) tuple, or None (default)."""
    if isinstance(tiles, RingConfig):
        return tiles
    if tiles is not None:
        return RingConfig(*tiles[:4], bool(tiles[4]) if len(tiles) > 4 else False)
    return default_config(tq, q.shape[-1], q.element_size(), tma)


def ring_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: torch.Tensor,
              q_pos: torch.Tensor | None, k_pos: torch.Tensor | None, config: RingConfig,
              acc: tuple[torch.Tensor, torch.Tensor] | None, load_prev: bool, store_acc: bool,
              out: torch.Tensor | None = None, tma: bool | None = None) -> None:
    """One launch over a tile table (`build_tiles` with `rows_per_tile(config, ...)` rows per tile, on q's device).

    q [Tq, Hq, D]; k/v [Tk, Hkv, D] (rows as the table's k0.. k_end); q_pos [Tq] / k_pos [Tk] int32 positions on
    the device (None: no row of the table is causal). acc (out [Tq, Hq, D] fp32 or any float dtype, lse [Tq, Hq]
    fp32): merged with this step's partial when `load_prev`, written with the result when `store_acc`. out
    [Tq, Hq, D]: written with the result when given (a last step). A step that writes without loading, or
    writes `out`, must have a table that covers every row (`build_tiles(..., cover=True)`)."""
    _check(q, k, v, q_pos, k_pos)
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    n_tiles = tiles.shape[0]
    if tq == 0 or n_tiles == 0:
        return
    if (load_prev or store_acc) and acc is None:
        raise ValueError("ring_step: loading or storing accumulators needs them")
    use_tma = tk > 0 and (tma_ok(k, v) if tma is None else tma)
    hp = config.heads_per_program(hq // hkv)
    if tk == 0:  # no keys: no tile loads any, but the kernel takes pointers of q's dtype
        k = v = q.new_empty((1, hkv, d))
    k_desc = v_desc = None
    if use_tma:  # 2-D views [Tk, Hkv * D] with their row strides: one box is one head's BLOCK_N rows
        k_desc = _TensorDescriptor(k, [tk, hkv * d], [k.stride(0), 1], [config.block_n, d])
        v_desc = _TensorDescriptor(v, [tk, hkv * d], [v.stride(0), 1], [config.block_n, d])
    if acc is None:  # never read nor written: fp32 stand-ins, so the kernel compiled for the ring serves too
        dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
        acc = (dummy.expand(1, 1, 1), dummy.view(1, 1))
    acc_o, acc_l = acc
    fin = out if out is not None else acc_o
    q_pos = tiles if q_pos is None else q_pos  # int32 stand-ins, never read
    k_pos = tiles if k_pos is None else k_pos
    n_groups = hq // hp
    _ring_kernel[(n_groups * n_tiles,)](
        q, k, v, k_desc, v_desc, q_pos, k_pos, tiles, acc_o, acc_l, fin, scale * _LOG2E, n_groups,
        int(load_prev), int(store_acc), int(out is not None),
        q.stride(0), q.stride(1), k.stride(0), v.stride(0), acc_o.stride(0), acc_o.stride(1),
        acc_l.stride(0), acc_l.stride(1), fin.stride(0), fin.stride(1),
        GQA=hq // hkv, HP=hp, D=d, BLOCK_M=config.block_m, BLOCK_N=config.block_n, TMA=use_tma,
        IEEE=q.dtype == torch.float32, num_warps=config.num_warps, num_stages=config.num_stages)


def _launch(q, k, v, scale, q_pos, k_pos, out, lse, merge: bool, tiles, tma) -> None:
    """chunk_attention(_merge_): one sequence, its tile table built on the device."""
    _check(q, k, v, q_pos, k_pos)
    tq, hq, d = q.shape
    tk = k.shape[0]
    if tq == 0:
        return
    if tk == 0:  # no keys: nothing seen (answered here, no launch)
        if not merge:
            out.zero_()
            lse.fill_(float("-inf"))
        return
    use_tma = tk > 0 and (tma_ok(k, v) if tma is None else tma)
    config = as_config(tiles, tq, q, use_tma)
    if q_pos is not None:
        q_pos, k_pos = q_pos.to(q.device, torch.int32), k_pos.to(q.device, torch.int32)
    table = _device_tiles(q_pos, k_pos, tq, tk, rows_per_tile(config, hq, k.shape[1]), q.device)
    ring_step(q, k, v, scale, table, q_pos, k_pos, config, (out, lse), merge, True, tma=use_tma)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32, tiles: RingConfig | tuple | None = None,
                    tma: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Tq, Hq, D] over k/v [Tk, Hkv, D] -> out [Tq, Hq, D] (out_dtype), lse [Tq, Hq] fp32.

    q_pos [Tq], k_pos [Tk]: ascending absolute positions (causal by position), or both None (no mask).
    tiles: a RingConfig or (BLOCK_M, BLOCK_N, num_warps, num_stages[, pack]), default `default_config`;
    tma: force TMA loads of K/V on or off (default: on where Hopper and alignment allow)."""
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    _launch(q, k, v, scale, q_pos, k_pos, out, lse, False, tiles, tma)
    return out, lse


def chunk_attention_merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None,
                           k_pos: torch.Tensor | None = None, tiles: RingConfig | tuple | None = None,
                           tma: bool | None = None) -> None:
    """acc := merge(acc, attention of q over k/v), in place and exact; acc_out [Tq, Hq, D] fp32 and
    acc_lse [Tq, Hq] fp32 (lse -inf: nothing seen yet). Arguments otherwise as `chunk_attention`."""
    if acc_out.shape != q.shape or acc_lse.shape != q.shape[:2] or acc_out.dtype != torch.float32 \
            or acc_lse.dtype != torch.float32 or acc_out.stride(2) != 1:
        raise ValueError(f"accumulators must be fp32 out {tuple(q.shape)} (unit stride on D) and lse "
                         f"{tuple(q.shape[:2])}; got {acc_out.dtype} {tuple(acc_out.shape)}, "
                         f"{acc_lse.dtype} {tuple(acc_lse.shape)}")
    _launch(q, k, v, scale, q_pos, k_pos, acc_out, acc_lse, True, tiles, tma)
