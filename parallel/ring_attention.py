"""Sequence-parallel (SP) attention: ring attention for prefill, LSE merging for decode.

A sequence's tokens are spread over the SP ranks. Attention of a query over keys held by several
ranks is split into partial attentions, one per key holder, each returning its softmax-normalised
output and the log-sum-exp (LSE) of its scores; partials merge exactly:

    lse = logaddexp(lse_1, lse_2),   out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)

Prefill (`ring_attention`): queries stay put and the K/V blocks travel around the ring. At step i
rank r holds the block of rank r - i, sends it on to r + 1 and receives the next one from r - 1
while it computes on the current one, so the transfer overlaps the compute. Causality comes from
the GLOBAL positions of queries and keys; blocks (or parts of blocks) that are entirely in the
future of a query are never computed.

Each step's partial attention is blockwise: on CUDA (Triton importable, fp16/bf16/fp32, head dim a
power of two) the fused kernel of parallel/kernels/ring_attention_triton.py, one launch per step for the
whole ragged batch from a tile table cached on the shards (two with split-K: a step too small for the GPU
spreads each query tile's keys over several programs, merged by LSE in a second launch), which also merges
the partial into the rank's fp32 accumulators (the first step writes them, the last writes the output in
q's dtype: `_RingSteps`);
elsewhere (CPU) `blockwise_attention_with_lse`, plain PyTorch
tiles of queries x keys with an online softmax. Either way a rank never holds more than one score tile,
whatever the prompt length; tiles wholly in the queries' future are skipped and only tiles that straddle
the causal boundary are masked.

`ring_rank_attention` is one rank's whole share of `ring_attention` (its queries against every rank's
K/V block in ring order, merged) without the communication: what one GPU runs to measure a rank of
SP=N (scripts/bench_sp_rank.py).

Decode (`sharded_decode_attention`): the few queries are replicated, each rank attends over the KV
it holds, and the partials are merged across the SP group (`merge_attention_partials`).

Zig-zag layout (`zigzag_positions`): a sequence is cut into 2 * sp chunks and rank r takes chunks
r and 2 * sp - 1 - r, so every rank gets one early (cheap) and one late (expensive) chunk of the
causal triangle. RoPE is applied by the caller at the global positions before calling in here.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from parallel.comm import gather_first_dim
from parallel.state import Group

NEG_INF = float("-inf")


# ---- layouts ----
def zigzag_chunks(seq_len: int, sp_size: int) -> list[range]:
    """2 * sp_size contiguous chunks covering [0, seq_len); the first seq_len % (2 * sp) get one token more."""
    n = 2 * sp_size
    base, extra = divmod(seq_len, n)
    chunks, start = [], 0
    for c in range(n):
        size = base + (c < extra)
        chunks.append(range(start, start + size))
        start += size
    return chunks


def zigzag_positions(seq_len: int, sp_size: int, sp_rank: int) -> list[int]:
    """The global positions SP rank `sp_rank` holds of a sequence: chunks r and 2 * sp - 1 - r, ascending."""
    chunks = zigzag_chunks(seq_len, sp_size)
    return [*chunks[sp_rank], *chunks[2 * sp_size - 1 - sp_rank]]


@dataclass
class TokenShard:
    """The tokens one rank holds of a batch of sequences: per sequence, ascending global positions.

    The rank's tensors hold these tokens sequence after sequence, so sequence b's rows are
    [offsets[b], offsets[b + 1]). Every rank of the ring must describe the same sequences in the same order.
    """

    positions: list[list[int]]
    offsets: list[int] = field(init=False)
    _on_device: dict = field(init=False, default_factory=dict, repr=False, compare=False)
    _arrays: list = field(init=False, default_factory=list, repr=False, compare=False)
    _tables: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.offsets = [0]
        for p in self.positions:
            self.offsets.append(self.offsets[-1] + len(p))

    def positions_on(self, device: torch.device) -> torch.Tensor:
        """All positions, row by row, as an int32 tensor on `device` [num_tokens]; made once per device
        (every layer of a step shares the shard, and a host-to-device copy would wait for the GPU)."""
        key = str(device)
        if key not in self._on_device:
            flat = [p for pos in self.positions for p in pos]
            self._on_device[key] = torch.tensor(flat, dtype=torch.int32).to(device)
        return self._on_device[key]

    def positions_np(self) -> list[np.ndarray]:
        """Per sequence its positions as an int64 numpy array; made once."""
        if not self._arrays:
            self._arrays.extend(np.asarray(p, dtype=np.int64) for p in self.positions)
        return self._arrays

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.positions)


# ---- partial attention and merging ----
# Tile sizes (queries x keys) of the blockwise attention. One score tile is [Hq, TILE_Q, TILE_K] fp32:
# 32 heads x 1024 x 2048 x 4 B = 256 MiB on a GPU, where bigger tiles mean fewer kernel launches from
# the Python loop; on a CPU small tiles stay in cache and the loop's overhead is negligible next to the math.
CUDA_TILES = (1024, 2048)
CPU_TILES = (128, 512)


def default_tiles(device: torch.device) -> tuple[int, int]:
    return CUDA_TILES if device.type == "cuda" else CPU_TILES


def _tile_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hkv, g * tq, D] fp32, k [Hkv, tk, D] fp32 -> scores [Hkv, g * tq, tk] fp32.

    The only score tensor the blockwise attention makes, so a test can bound its size (the start-up OOM
    of issue 25 was one [Hq, T/2, T/2] score matrix per layer)."""
    return torch.bmm(q, k.transpose(1, 2)).mul_(scale)


def blockwise_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 q_pos: list[int] | None = None, k_pos: list[int] | None = None,
                                 tiles: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention computed tile by tile (flash-style online softmax), with its LSE, in fp32.

    q [Tq, Hq, D]; k, v [Tk, Hkv, D] (Hq a multiple of Hkv: GQA, the KV heads are never repeated).
    q_pos / k_pos: ascending global positions of the rows (host lists); a query attends to the keys at
    positions <= its own. Both None: non-causal, every query sees every key. tiles: (queries, keys) per
    tile, default by device. Memory: O((Tq + Tk) * H * D) plus one [Hq, tq, tk] tile, never [Tq, Tk].
    Returns out [Tq, Hq, D] fp32 and lse [Tq, Hq] fp32; a query that sees no key gets out 0, lse -inf.
    """
    tq_all, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    tile_q, tile_k = tiles or default_tiles(q.device)
    causal = q_pos is not None
    # Query head h uses KV head h // g (as SDPA's enable_gqa): queries as [Hkv, g, Tq, D], keys [Hkv, Tk, D].
    qh = q.float().view(tq_all, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, Tq, D] (a view; tiles copy)
    kh = k.float().transpose(0, 1).contiguous()  # [Hkv, Tk, D]
    vh = v.float().transpose(0, 1).contiguous()  # [Hkv, Tk, D]
    qp = torch.tensor(q_pos, device=q.device) if causal else None  # [Tq] for the masks of diagonal tiles
    kp = torch.tensor(k_pos, device=q.device) if causal else None  # [Tk]
    out = q.new_zeros((hkv, g, tq_all, d), dtype=torch.float32)  # [Hkv, g, Tq, D]
    lse = q.new_full((hkv, g, tq_all), NEG_INF, dtype=torch.float32)  # [Hkv, g, Tq]
    for q0 in range(0, tq_all, tile_q):
        q1 = min(q0 + tile_q, tq_all)
        k_end, k_full = k.shape[0], k.shape[0]
        if causal:
            # Positions ascend: keys after the tile's last query are unseen by all of it (skipped), keys
            # up to its first query are seen by all of it (no mask).
            k_end = bisect.bisect_right(k_pos, q_pos[q1 - 1])
            k_full = bisect.bisect_right(k_pos, q_pos[q0])
        bounds = (q0, q1, k_end, k_full)
        o_t, l_t = _query_tile(qh[:, :, q0:q1], kh, vh, qp, kp, scale, bounds, tile_k)
        out[:, :, q0:q1], lse[:, :, q0:q1] = o_t, l_t
    return out.permute(2, 0, 1, 3).reshape(tq_all, hq, d), lse.permute(2, 0, 1).reshape(tq_all, hq)


def _query_tile(qt: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, qp: torch.Tensor | None,
                kp: torch.Tensor | None, scale: float, bounds: tuple[int, int, int, int],
                tile_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One query tile over keys [0, k_end) by key tiles, with a running max / sum (online softmax).

    qt [Hkv, g, tq, D]; kh, vh [Hkv, Tk, D]; qp [Tq], kp [Tk] positions (None: no mask anywhere);
    bounds (q0, q1, k_end, k_full): the tile's rows [q0, q1) see keys [0, k_end), all of [0, k_full).
    Returns out [Hkv, g, tq, D] and lse [Hkv, g, tq], fp32.
    """
    q0, q1, k_end, k_full = bounds
    hkv, g, tq, d = qt.shape
    qf = qt.reshape(hkv, g * tq, d)  # [Hkv, g * tq, D]: one bmm covers every query head of a KV head
    m = qf.new_full((hkv, g * tq), NEG_INF)  # running max of the scores
    s = qf.new_zeros((hkv, g * tq))  # running sum of exp(score - m)
    acc = qf.new_zeros((hkv, g * tq, d))  # running sum of exp(score - m) * v
    for k0 in range(0, k_end, tile_k):
        k1 = min(k0 + tile_k, k_end)
        scores = _tile_scores(qf, kh[:, k0:k1], scale)  # [Hkv, g * tq, tk]
        if k1 > k_full:  # the tile straddles some query's position: mask the keys in its future
            visible = qp[q0:q1, None] >= kp[None, k0:k1]  # [tq, tk]
            scores.view(hkv, g, tq, k1 - k0).masked_fill_(~visible, NEG_INF)
        m_new = torch.maximum(m, scores.amax(dim=-1))  # [Hkv, g * tq]
        m_safe = _finite(m_new)  # rows with nothing seen yet stay -inf: exp(-inf - 0) = 0, no nan
        probs = scores.sub_(m_safe.unsqueeze(-1)).exp_()  # [Hkv, g * tq, tk], in place: no second tile
        rescale = torch.exp(m - m_safe)  # [Hkv, g * tq]: the old sums were relative to the old max
        s = s * rescale + probs.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.bmm(probs, vh[:, k0:k1])
        m = m_new
    out = acc / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)  # rows that saw nothing: acc = 0
    lse = m + torch.log(s)  # -inf where nothing was seen (log 0)
    return out.view(hkv, g, tq, d), lse.view(hkv, g, tq)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention that also returns the LSE of the scores, computed in fp32: the reference
    the blockwise attention is tested against (it makes the whole [Hq, Tq, Tk] score matrix).

    q [Tq, Hq, D]; k, v [Tk, Hkv, D] (Hq a multiple of Hkv: GQA); mask [Tq, Tk] bool, True = may attend.
    Returns out [Tq, Hq, D] fp32 and lse [Tq, Hq] fp32; a row with nothing to attend to gets out 0, lse -inf.
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    # Query head h uses KV head h // g (as SDPA's enable_gqa), so view the query heads as [Hkv, g].
    qf = q.float().view(tq, hkv, hq // hkv, d)
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale  # [Hkv, g, Tq, Tk]
    if mask is not None:
        scores.masked_fill_(~mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, g, Tq]
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float()).reshape(tq, hq, d)
    return out, lse.permute(2, 0, 1).reshape(tq, hq)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # -inf marks "no keys"; subtracting 0 instead keeps exp(-inf - (-inf)) = nan out of the result.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """acc += partial, in place. acc_out/out [T, H, D] fp32; acc_lse/lse [T, H] fp32."""
    new_lse = torch.logaddexp(acc_lse, lse)
    safe = _finite(new_lse)
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1)).add_(out * torch.exp(lse - safe).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def merge_attention_partials(out: torch.Tensor, lse: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions of the SAME queries, one per rank of `group`, over disjoint key sets.

    out [T, H, D], lse [T, H] (fp32) -> the attention over the union of the keys, on every rank.
    One all-gather of [T, H, D + 1]; T is the same on every rank.
    """
    if group.size == 1:
        return out, lse
    packed = torch.cat([out.float(), lse.float().unsqueeze(-1)], dim=-1).contiguous()
    gathered = gather_first_dim(packed, group).view(group.size, *packed.shape)  # [n, T, H, D + 1]
    outs, lses = gathered[..., :-1], gathered[..., -1]  # [n, T, H, D], [n, T, H]
    total = torch.logsumexp(lses, dim=0)  # [T, H]
    weights = torch.exp(lses - _finite(total))  # [n, T, H]
    return (outs * weights.unsqueeze(-1)).sum(dim=0), total


def decode_attention_partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_lens: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over this rank's share of its KV (padded batch).

    q [B, Hq, D]; keys, values [B, Hkv, L, D]; kv_lens [B] valid keys per row (may be 0).
    Returns out [B, Hq, D] fp32 and lse [B, Hq] fp32 (-inf where the rank holds no key of that sequence).
    """
    b, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    qf = q.float().view(b, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bhkd->bhgk", qf, keys.float()) * scale  # [B, Hkv, g, L]
    valid = torch.arange(length, device=q.device)[None, :] < kv_lens.to(q.device)[:, None]  # [B, L]
    scores.masked_fill_(~valid[:, None, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, g]
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    out = torch.einsum("bhgk,bhkd->bhgd", probs, values.float())
    return out.reshape(b, hq, d), lse.reshape(b, hq)


def sharded_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_lens: torch.Tensor,
                             scale: float, group: Group) -> torch.Tensor:
    """Decode attention when each sequence's KV is spread over the SP ranks.

    Every rank passes the same queries q [B, Hq, D] and ITS keys/values [B, Hkv, L_rank, D] with
    kv_lens [B]; returns the attention over all ranks' keys, [B, Hq, D] in q's dtype, on every rank.
    """
    out, lse = decode_attention_partial(q, keys, values, kv_lens, scale)
    out, _ = merge_attention_partials(out, lse, group)
    return out.to(q.dtype)


# ---- ring attention ----
def _visible_part(q_pos: list[int], k_pos: list[int]) -> tuple[int, int, bool] | None:
    """Which part of a (query run, key block) pair can attend at all, from ascending positions.

    Returns (q_lo, k_hi, full): queries [q_lo:] see some key, keys [:k_hi] are seen by some query,
    and full=True when every such query sees every such key (no mask needed). None: nothing visible.
    """
    if not q_pos or not k_pos:
        return None
    k_hi = bisect.bisect_right(k_pos, q_pos[-1])  # keys after the last query are in everyone's future
    q_lo = bisect.bisect_left(q_pos, k_pos[0])  # queries before the first key see none of these keys
    if k_hi == 0 or q_lo == len(q_pos):
        return None
    return q_lo, k_hi, q_pos[q_lo] >= k_pos[k_hi - 1]


class _RingExchange:
    """One step's send of the current K/V block to the next rank and receive of the next block.

    Sizes come from the shared layout, so an empty block is simply not sent (nor received).
    """

    def __init__(self, group: Group, send: torch.Tensor, recv_tokens: int):
        """send [2, T, Hkv, D]; the block received has recv_tokens tokens."""
        n, me = group.size, group.rank
        self.recv = send.new_empty((2, recv_tokens, *send.shape[2:]))
        ops = []
        if send.shape[1]:
            ops.append(dist.P2POp(dist.isend, send, group.ranks[(me + 1) % n], group.device_group))
        if recv_tokens:
            ops.append(dist.P2POp(dist.irecv, self.recv, group.ranks[(me - 1) % n], group.device_group))
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> torch.Tensor:
        """The received block, ready on `stream` (None: the current stream) once the GPU gets there."""
        if stream is None:
            for w in self.works:
                w.wait()
            return self.recv
        with torch.cuda.stream(stream):
            for w in self.works:
                w.wait()
        return self.recv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_shard: TokenShard,
                   kv_shards: list[TokenShard], scale: float, group: Group,
                   tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of all ranks of `group` (ragged batch).

    q [Tq, Hq, D] holds the tokens of `q_shard`; k, v [Tk, Hkv, D] hold this rank's keys, described by
    kv_shards[group.rank]; kv_shards[r] describes rank r's keys (so receive buffers are sized without a
    handshake). A query at global position p attends to every key at position <= p, whichever rank holds
    it. Queries and keys may be different token sets (e.g. new tokens vs. new + cached). Returns [Tq, Hq, D].
    Each step's partial is blockwise (the Triton kernel on CUDA, one launch per step, else
    `blockwise_attention_with_lse` with `tiles` as there): memory per rank is O(Tq + Tk) plus one score tile,
    never the [Tq, Tk] score matrix.
    """
    n, me = group.size, group.rank
    block = torch.stack([k, v]).contiguous()  # [2, Tk, Hkv, D]: one message per step instead of two
    order = [kv_shards[(me - step) % n] for step in range(n)]  # whose keys each step holds
    steps = _RingSteps(q, block, q_shard, order, scale, tiles, triton_is_default(q, block))
    if getattr(steps, "fused", False):
        return _ring_fused(steps, group, block, kv_shards)
    for step in range(n):
        src = (me - step) % n
        exchange = None
        if step < n - 1:
            # Start passing the block on before computing with it: the transfer overlaps the compute.
            exchange = _RingExchange(group, block, kv_shards[(src - 1) % n].num_tokens)
        steps.step(step, block)
        if exchange is not None:
            block = exchange.wait(steps.recv_stream())
    return steps.result()


def _ring_fused(steps: "_RingSteps", group: Group, block: torch.Tensor, kv_shards: list[TokenShard]) -> torch.Tensor:
    """The ring under RingConfig.fuse: every block's whole trip issued before the first step's kernel (exchange j
    sends on what exchange j - 1 receives: the NCCL stream keeps them in order, and none waits for this rank's
    compute, which NCCL's stream would if an exchange were issued after a kernel), the own block's step computed
    meanwhile, then each received block scattered into the position-ordered buffer and one launch over them all."""
    n, me = group.size, group.rank
    exchanges, send = [], block
    for step in range(n - 1):
        exchanges.append(_RingExchange(group, send, kv_shards[(me - step - 1) % n].num_tokens))
        send = exchanges[-1].recv
    steps.step(0, block)
    for step, exchange in enumerate(exchanges, 1):
        steps.step(step, exchange.wait(steps.recv_stream()))
    return steps.result()


def ring_rank_attention(q: torch.Tensor, blocks: list[torch.Tensor], shards: list[TokenShard], rank: int,
                        scale: float, backend: str | None = None, tiles: tuple[int, int] | None = None,
                        kernel_config=None) -> torch.Tensor:
    """Everything SP rank `rank` computes in `ring_attention`, on one device and without communication.

    q [Tq, Hq, D]: the rank's queries (rows of shards[rank]); blocks[r] [2, Tk_r, Hkv, D]: rank r's keys
    and values (rows of shards[r]), attended in ring order (the rank's own, then rank - 1, rank - 2, ...)
    and merged exactly, as the ring does. backend: "triton", "torch" or None (Triton where it runs).
    kernel_config: the Triton kernel's launch config (a `RingConfig` or its string, see
    parallel/kernels/ring_attention_triton.py; default its `default_config`).
    Returns [Tq, Hq, D] in q's dtype. `split_for_ranks` builds the arguments from a whole prompt.
    """
    n = len(shards)
    if len(blocks) != n or not 0 <= rank < n:
        raise ValueError(f"need one K/V block per shard and 0 <= rank < {n}; got {len(blocks)} blocks, rank {rank}")
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, not {backend!r}")
    # One support check either way (on the way to the rank's first launch): the default asks it, "triton" needs it.
    use_triton = triton_is_default(q, blocks[rank]) if backend is None else backend == "triton"
    if backend == "triton" and not _triton_runs(q, blocks[rank]):
        raise ValueError("the Triton ring kernel needs Triton and CUDA tensors it supports (or TRITON_INTERPRET=1), "
                         "see ring_attention_triton.supported")
    srcs = [(rank - step) % n for step in range(n)]
    steps = _RingSteps(q, blocks[rank], shards[rank], [shards[s] for s in srcs], scale, tiles, use_triton,
                       kernel_config)
    for step, src in enumerate(srcs):
        steps.step(step, blocks[src])
    return steps.result()


def attention_by_positions(q: torch.Tensor, block: torch.Tensor, q_shard: TokenShard, kv_shard: TokenShard,
                           scale: float, tiles: tuple[int, int] | None = None,
                           use_triton: bool | None = None) -> torch.Tensor:
    """q [Tq, Hq, D] over one K/V block [2, Tk, Hkv, D] (a ragged batch, rows as the shards), causal by the
    shards' positions, in one pass of the ring's blockwise step; no communication. use_triton None: the
    Triton kernel where it runs (`triton_is_default`). Returns [Tq, Hq, D] in q's dtype (Ulysses' attention)."""
    use_triton = triton_is_default(q, block) if use_triton is None else use_triton
    steps = _RingSteps(q, block, q_shard, [kv_shard], scale, tiles, use_triton)
    steps.step(0, block)
    return steps.result()


class _RingSteps:
    """One rank's ring steps and their merge: step i attends q (rows of `q_shard`) over the block of
    kv_shards[i] and merges it exactly into the result.

    Triton: one launch per step for the whole ragged batch, from tile tables made before the first launch
    and cached on the shards (every layer of a forward reuses them), each launch's arguments planned once per plan
    at its first use (`StepLaunch`, kept in the plan; later calls only run it with their tensors) and, for short
    chunks, the accumulators kept there too (`KEEP_ACC_TOKENS`): the host's time to a call's first kernel is the
    plan's lookup and that launch; a step the kernel's split-K rule splits
    (`split_counts`, or the config's split=N) adds the launch that merges its pieces, and the steps share
    one scratch for the pieces' partials. The first step writes the fp32
    accumulators (its table covers every query row: no zero fill), middle steps merge into them, the last
    merges and writes the output in q's dtype (no separate cast); a ring of one step writes the output
    directly. Under RingConfig.fuse (three or more steps) the steps after the first only scatter their block into
    a position-ordered buffer (`_fused_layout`; under RingConfig.batchcopy they hold it and the last scatters
    them all in one launch, `_scatter_all`), and the last launches once over it: two attention launches in all;
    under RingConfig.gather (two or more) the first step's block is scattered too: one launch in all.
    PyTorch (CPU): zeroed accumulators, `blockwise_attention_with_lse` and `merge_into` per
    sequence, one cast at the end."""

    def __init__(self, q: torch.Tensor, first_block: torch.Tensor, q_shard: TokenShard, kv_shards: list[TokenShard],
                 scale: float, tiles: tuple[int, int] | None, use_triton: bool, kernel_config=None):
        self.q, self.q_shard, self.kv_shards, self.scale, self.tiles = q, q_shard, kv_shards, scale, tiles
        self.n, self.use_triton, self.side = len(kv_shards), use_triton, None
        if not use_triton:
            self.acc_out, self.acc_lse = _accumulators(q)
            return
        if q.shape[0] != q_shard.num_tokens:
            raise ValueError(f"q has {q.shape[0]} rows, its shard {q_shard.num_tokens} tokens")
        plan = _ring_plan(q, first_block, q_shard, kv_shards, kernel_config)
        self.config, self.tma, self.q_hkv, self.fused, self.f0 = plan.config, plan.tma, plan.hkv, plan.fused, plan.f0
        self.dst, self.n_launch, self.q_pos, self.k_pos = plan.dst, plan.n_launch, plan.q_pos, plan.k_pos
        self.tables, self.partials, self.key_tokens = plan.tables, plan.partials, plan.key_tokens
        self.specs, self.hybrid, self.plan = plan.specs, plan.hybrid, plan
        # Only what the first launch needs is made before it (the accumulators it writes); the fused buffer and the
        # output when a launch first needs them (`_fused_buffer`, `_run`), while the GPU runs the launches before.
        self.first_block, self.fused_kv, self.out, self.acc, self.side = first_block, plan.kv, None, None, plan.side
        if self.fused or self.hybrid:
            self.pending = []  # the blocks to scatter, as their steps come (`step`)
        if self.n_launch > 1:
            self.acc = plan.acc or (torch.empty(q.shape, dtype=plan.acc_dtype, device=q.device),
                                    torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))
        # Each launch's `StepLaunch` is made at its first use in the first call with this plan and kept in the plan
        # (released: it holds no call's tensors), so later calls (every layer of a forward, every forward of these
        # shards) plan nothing; this call's list, so a caller may swap one in (scripts/bench_ring_launch.py).
        self.launches = list(plan.launches)

    def step(self, i: int, block: torch.Tensor) -> None:
        """Attend over `block` [2, Tk, Hkv, D], the keys of kv_shards[i], and merge."""
        if not self.use_triton:
            _attend_block(self.q, block, self.q_shard, self.kv_shards[i], self.scale, self.acc_out, self.acc_lse,
                          self.tiles)
            return
        if i == 0 and self.side is not None:  # RingConfig.overlap: what the first launch may run beside starts here
            self.side[1].record()
        if self.hybrid:
            self._hybrid_step(i, block)
            return
        if self.fused and i >= self.f0:  # into position order (as it arrives, or all at the last step: batchcopy)
            if self.config.batchcopy:
                self.pending.append(block)
            else:
                _scatter_runs(self._fused_buffer(), block, *self.dst[i - self.f0])
            if i < self.n - 1:
                return
            if self.config.batchcopy:
                self._scatter_pending()
            i, block = self.n_launch - 1, self.fused_kv
        self._run(i, block)

    def recv_stream(self) -> "torch.cuda.Stream | None":
        """The stream a received block must be ready on before it is passed to `step`: RingConfig.overlap's side
        stream (its one scatter reads the block there; the launches that read it wait for that scatter), else None
        (the current stream)."""
        return self.side[0] if self.side is not None else None

    def _scatter_pending(self) -> None:
        """The held blocks into the fused buffer in one go (`_scatter_all`); under RingConfig.overlap on the side
        stream, after the blocks were ready at the ring's start (or received there: `recv_stream`), so the copy runs
        beside the first launch, and the current stream waits for it before the launch that reads the buffer."""
        buf, scatter = self._fused_buffer(), self.plan.scatter
        # trim0: the own block's first rows are the scatter's last source
        blocks = self.pending + [self.first_block] if self.plan.trim else self.pending
        if self.side is None:
            if scatter is None or not scatter(blocks):
                _scatter_all(buf, blocks, self.dst)
            return
        stream, ready, done = self.side
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            if scatter is None or not scatter(blocks):
                _scatter_all(buf, blocks, self.dst)
            done.record(stream)
        torch.cuda.current_stream(self.q.device).wait_event(done)

    def _hybrid_step(self, i: int, block: torch.Tensor) -> None:
        """RingConfig.hybrid (SP = 2): step 0 runs the own block for the first head groups; step 1 scatters both
        blocks into position order, runs the other head groups over every key, then the first ones over the other
        block (merging into step 0's accumulators)."""
        self.pending.append(block)
        if i == 0:
            self._run(0, block)
            return
        self._scatter_pending()
        self._run(1, self.fused_kv)
        self._run(2, block)

    def _fused_buffer(self) -> torch.Tensor:
        """The position-ordered K/V buffer of a fused or hybrid ring: the plan's (short chunks), else made at its first
        use (after the first launch)."""
        if self.fused_kv is None:
            self.fused_kv = self.first_block.new_empty((2, self.plan.fused_tokens, *self.first_block.shape[2:]))
        return self.fused_kv

    def _run(self, i: int, block: torch.Tensor) -> None:
        """Launch i over block [2, Tk, Hkv, D] (its plan made once; plain loads for a block TMA cannot read)."""
        k, v = self.plan.kv_views if block is self.plan.kv else (block[0], block[1])
        tma = None
        # The first block's TMA-readability is the plan's (its key); another may be misaligned: plain loads.
        if self.tma and k.shape[0] and block is not self.first_block and block is not self.plan.kv \
                and not _triton_kernels().tma_ok_block(block):
            tma = False
        if self.out is None and self.specs[i][2]:  # the output, made when the first launch that writes it comes
            self.out = torch.empty(self.q.shape, dtype=self.q.dtype, device=self.q.device)
        # The own block's layout is the plan's key (and checked when the plan was made), the fused buffer the plan's.
        self._launch(i, tma).run(k, v, self.q, self.acc, self.out,
                                 (i == 0 and block is self.first_block) or block is self.plan.kv)

    def _launch(self, i: int, tma: bool | None = None):
        """Launch i's `StepLaunch` (planned at its first use with this plan; tma given: a one-off plan with that)."""
        if self.launches[i] is None or tma is not None:
            load_prev, store_acc, writes_out, groups = self.specs[i]
            if writes_out and self.out is None:
                self.out = torch.empty(self.q.shape, dtype=self.q.dtype, device=self.q.device)
            config = self.config  # RingConfig.oneloop0: the first launch's programs in one loop
            if i == 0 and config.oneloop0 and not config.oneloop:
                config = dataclasses.replace(config, oneloop=True)
            if i == 0 and config.first and (self.tables[0][1] is None or config.block_n % config.first[0] == 0):
                n0, w0, s0 = config.first[:3]  # RingConfig.first: the first launch's BLOCK_N, warps, stages
                config = dataclasses.replace(config, block_n=n0, num_warps=w0, num_stages=s0,
                                             block_m=self.plan.block_m0 or config.block_m)  # and BLOCK_M (its table's)
            # RingConfig.plain0: the first launch by plain loads (no tensor descriptors on the host before it)
            use_tma = False if i == 0 and config.plain0 else self.tma if tma is None else tma
            launch = _triton_kernels().StepLaunch(
                self.q, self.key_tokens[i], self.q_hkv, self.scale, self.tables[i][0], self.q_pos, self.k_pos[i],
                config, self.acc, load_prev, store_acc, self.out if writes_out else None, use_tma,
                self.tables[i][1], self.partials, not (self.fused or self.hybrid), groups).release()
            if tma is not None:
                return launch
            self.launches[i] = self.plan.launches[i] = launch
        return self.launches[i]

    def result(self) -> torch.Tensor:
        """[Tq, Hq, D] in q's dtype, once every step ran."""
        if not self.use_triton:
            return self.acc_out.to(self.q.dtype)
        if self.out is None:  # no launch wrote it (never after a whole ring: its last launch writes the output)
            raise RuntimeError("the ring's result was asked for before its last step ran")
        return self.out


@dataclass(frozen=True)
class _RingPlan:
    """What `_RingSteps` works out for the Triton kernel from the shards, the shapes and the config alone: the same
    for every layer of a forward (`_ring_plan` caches it on the query shard)."""
    config: object  # RingConfig
    tma: bool  # K/V read by TMA
    hkv: int
    fused: bool  # RingConfig.fuse (SP >= 3) or gather (SP >= 2): blocks scattered into one position-ordered buffer
    f0: int  # the first step whose block is scattered (fused)
    dst: list | None  # per scattered block, its rows' runs in the buffer (`_runs`)
    fused_tokens: int  # the buffer's rows
    n_launch: int
    q_pos: torch.Tensor
    k_pos: list
    tables: list  # per launch (tiles, merge table or None, split slots), `_tile_table`
    partials: tuple | None  # split-K scratch, shared by the launches (one stream: they never overlap)
    key_tokens: list  # per launch, its keys
    acc_dtype: torch.dtype
    specs: list  # per launch (load_prev, store_acc, writes the output, head groups (first, count) or None: all)
    hybrid: bool  # RingConfig.hybrid (SP = 2): launches [own block, some groups], [all keys, the rest], [other, some]
    launches: list  # per launch its `StepLaunch` (released), made at its first use (`_RingSteps._launch`), or None
    acc: tuple | None  # the accumulators every call shares (short chunks, `KEEP_ACC_TOKENS`), else None: per call
    kv: torch.Tensor | None  # the fused / hybrid position-ordered K/V buffer every call shares (short chunks), or None
    side: tuple | None  # RingConfig.overlap: (side stream, event "blocks ready", event "scatter done"), or None
    kv_views: tuple | None  # kv's K and V ([Tk, Hkv, D] views), made once
    scatter: object | None  # the one scatter into kv (hybrid, batchcopy) planned once (`ScatterLaunch`), or None
    trim: int = 0  # RingConfig.trim0: the own block's rows [0, trim) go to the fused launch (its last scattered source)
    block_m0: int = 0  # RingConfig.first's BLOCK_M: the first launch's (its own, unsplit tile table); 0: the config's


# Up to this many query rows per rank the plan keeps the ring's accumulators (fp32, 4 x Hq x D bytes a row: 128 MiB at
# 8K rows of 32 x 128) and every call with it (every layer of a forward) writes them again, as it does the split
# scratch: at 16K tokens a rank's first launch is ~1 ms of GPU time and the host's time before it counts in full
# (two allocations of ~5-10 us each on an H100 host). The calls share one stream (a forward's), so one call's steps
# end before the next call's first step overwrites them. Longer chunks allocate per call: held across a forward,
# their accumulators (512 MiB at 32K rows) would sit beside every other layer's activations.
KEEP_ACC_TOKENS = 8192


def _ring_plan(q: torch.Tensor, first_block: torch.Tensor, q_shard: TokenShard, kv_shards: list[TokenShard],
               kernel_config) -> _RingPlan:
    """The Triton ring's plan for these shards (kv_shards in step order), q's shape and dtype, K/V's shape and
    TMA-readability and the config (None: `default_config`, which TANDEM_RING_KERNEL may set); cached on q_shard
    like the tile tables, so a layer's ring does one lookup here, not a dozen."""
    kernels = _triton_kernels()
    env = os.environ.get(kernels.ENV) if kernel_config is None else None
    # q's strides too: the plan's launches (`launches`) pass them to the kernel, which specialises on them; and
    # TANDEM_RING_DIRECT, which they read when they are made. The first block's layout and alignment decide TMA
    # (`tma_ok_block`, worked out on a miss only: this lookup is on the way to the rank's first launch).
    key = ("plan", tuple(map(id, kv_shards)), kernel_config, env, os.environ.get(kernels.DIRECT_ENV), q.shape,
           q.stride(), q.dtype, q.get_device(), first_block.shape, first_block.stride(), first_block.dtype,
           first_block.data_ptr() % 16 == 0)
    hit = q_shard._tables.get(key)
    if hit is not None:  # the key's ids are those shards': the entry holds them, so no other object has those ids
        return hit[1]
    # What the first launch then takes unchecked (`StepLaunch.run`'s checked): the own block's layout, fixed by the key.
    if first_block.dtype != q.dtype or first_block.shape[1] != kv_shards[0].num_tokens \
            or first_block.stride()[2:] != (first_block.shape[3], 1):
        raise ValueError(f"the own K/V block must be [2, {kv_shards[0].num_tokens}, Hkv, D] in q's dtype with packed "
                         f"heads, got {tuple(first_block.shape)} {first_block.dtype} strides {first_block.stride()}")
    tma = kernels.tma_ok_block(first_block)
    cfg = kernel_config
    config = kernels.parse_config(cfg) if isinstance(cfg, str) else cfg or kernels.default_config(
        q.shape[0], q.shape[-1], q.element_size(), tma, len(kv_shards), first_block.nbytes, kernels.l2_bytes(q.device))
    hkv = first_block.shape[2]
    rows = kernels.rows_per_tile(config, q.shape[1], hkv)
    n_groups = q.shape[1] // config.heads_per_program(q.shape[1] // hkv)
    block_m0, rows0 = _first_tiles(config, q.shape[1], hkv)
    split = (config.block_n, n_groups, kernels.sm_count(q.device), config.splits)
    # fuse: the steps after the first are one launch over the other blocks, each scattered on arrival into
    # rows in position order (`_fused_layout`); the launches' key shards are then [own, fused]. gather: every
    # block so (the own one too), one launch over [fused]. f0: the first step whose block is scattered.
    n = len(kv_shards)
    hybrid = config.hybrid and n == 2 and n_groups >= 2
    gather = config.gather and n >= 2 and not hybrid
    fused = gather or (config.fuse and n >= 3)
    f0 = 0 if gather else 1
    launches, dst, fused_tokens = kv_shards, None, 0
    specs = [(i > 0, i < n - 1, i == n - 1, None) for i in range(n)]
    trim = _trim_rows(config, fused and not gather, q, q_shard, kv_shards[0], rows0 or rows)
    scattered = kv_shards[f0:] + ([_prefix_shard(q_shard, kv_shards[0], trim)] if trim else [])
    if fused:
        fused_shard, dst = _fused_layout(q_shard, scattered, q.device)
        launches = [fused_shard] if gather else [kv_shards[0], fused_shard]
        fused_tokens = fused_shard.num_tokens
        specs = [(i > 0, i < len(launches) - 1, i == len(launches) - 1, None) for i in range(len(launches))]
    if hybrid:  # a launch over some head groups is never split: their pieces would share the scratch's rows
        first = max(1, n_groups // kernels.HYBRID_SHARE)
        fused_shard, dst = _fused_layout(q_shard, kv_shards, q.device)
        launches, fused_tokens = [kv_shards[0], fused_shard, kv_shards[1]], fused_shard.num_tokens
        specs = [(False, True, False, (0, first)), (False, False, True, (first, n_groups - first)),
                 (True, False, True, (0, first))]
        split = split[:3] + (1,)
    # Before the first kernel: a host-to-device copy issued later would wait for the kernels queued before it.
    q_pos = q_shard.positions_on(q.device)
    k_pos = [shard.positions_on(q.device) for shard in launches]
    tables = _launch_tables(q_shard, launches, rows, rows0, hybrid, trim, split, q.device)
    slots = max(t[2] for t in tables)
    partials = kernels.partial_buffers(slots, n_groups, config, q.shape[-1], q.device) if slots else None
    # acc16: the running output in q's 16-bit dtype (half the traffic of the steps' merges), LSE fp32.
    acc_dtype = q.dtype if config.acc16 and q.element_size() == 2 else torch.float32
    acc, kept = None, (None, None, None, None)
    if q.shape[0] <= KEEP_ACC_TOKENS:
        if len(launches) > 1:
            acc = (torch.empty(q.shape, dtype=acc_dtype, device=q.device),
                   torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))
            _unseen_rows(acc, q_shard, kv_shards[0], trim)
        if fused or hybrid:  # trim0: the own block is the scatter's last source (its first rows)
            tokens = [s.num_tokens for s in (kv_shards if hybrid else scattered)]
            tokens[-1] = kv_shards[0].num_tokens if trim else tokens[-1]
            kept = _kept_buffers(first_block, tokens, hybrid, fused_tokens, dst, config, q.device)
    plan = _RingPlan(config, tma, hkv, fused, f0, dst, fused_tokens, len(launches), q_pos, k_pos, tables, partials,
                     [shard.num_tokens for shard in launches], acc_dtype, specs, hybrid, [None] * len(launches), acc,
                     *kept, trim, block_m0)
    q_shard._tables[key] = (list(kv_shards), plan)
    return plan


def _launch_tables(q_shard: TokenShard, launches: list[TokenShard], rows: int, rows0: int, hybrid: bool, trim: int,
                   split: tuple[int, int, int, int], device: torch.device) -> list[tuple]:
    """Each launch's `_tile_table` over its key shard: the last (and every hybrid one, and an untrimmed first) covering
    every query row. trim0: the first launch's table from the own block's row `trim` on, covering only the queries that
    see those keys. RingConfig.first's BLOCK_M (`rows0` rows a tile, else 0): the first launch's table in its own rows,
    never split (its pieces would not fit the scratch, sized by the config's BLOCK_M)."""
    return [_tile_table(q_shard, shard, rows0 if i == 0 and rows0 else rows,
                        hybrid or i == len(launches) - 1 or (i == 0 and not trim), device,
                        split[:3] + (1,) if i == 0 and rows0 else split, trim if i == 0 else 0)
            for i, shard in enumerate(launches)]


def _first_tiles(config, num_q_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """RingConfig.first's BLOCK_M and the first launch's rows per tile under it: (0, 0) where it gives none, it is the
    config's, or it would change the heads a program packs (the launches' head groups must agree)."""
    if len(config.first) != 4 or config.first[3] == config.block_m:
        return 0, 0
    first = dataclasses.replace(config, block_m=config.first[3])
    gqa = num_q_heads // num_kv_heads
    if first.heads_per_program(gqa) != config.heads_per_program(gqa):
        return 0, 0
    return first.block_m, _triton_kernels().rows_per_tile(first, num_q_heads, num_kv_heads)


def _kept_buffers(first_block: torch.Tensor, tokens: list[int], hybrid: bool, fused_tokens: int,
                  dst: list, config, device: torch.device) -> tuple:
    """A fused or hybrid ring's position-ordered K/V buffer kept in its plan (`tokens`: the rows of the blocks whose
    rows go there, in the order of `dst`), with its K/V views, RingConfig.overlap's stream and events, and its one
    scatter planned (`ScatterLaunch`: hybrid, batchcopy): (kv, side, kv_views, scatter)."""
    kv = first_block.new_empty((2, fused_tokens, *first_block.shape[2:]))
    side = scatter = None
    if hybrid or config.batchcopy:
        if config.overlap and kv.is_cuda:
            side = (_side_stream(device), torch.cuda.Event(), torch.cuda.Event())
        row = kv.shape[2] * kv.shape[3] * kv.element_size()
        if all(run * row % 8 == 0 for run, _ in dst):  # else `_scatter_all`'s copy per block
            scatter = _triton_kernels().ScatterLaunch(kv, dst, tokens)
    return kv, side, (kv[0], kv[1]), scatter


def _trim_rows(config, fused: bool, q: torch.Tensor, q_shard: TokenShard, own: TokenShard, rows: int) -> int:
    """RingConfig.trim0's R: the own block's rows that go to the fused launch instead of the first one (1 /
    TRIM0_SHARE of them, whole query tiles of `rows`), or 0 where it does not apply: no fuse with batchcopy (the own
    block joins the one scatter), more than one sequence (its first rows would not be one run of the block), or
    accumulators not kept (the rows the first launch leaves are set once, in the kept ones: `_unseen_rows`)."""
    if not (config.trim0 and fused and config.batchcopy) or q_shard.num_seqs != 1 or own.num_seqs != 1 \
            or q.shape[0] > KEEP_ACC_TOKENS:
        return 0
    return own.num_tokens // _triton_kernels().TRIM0_SHARE // rows * rows


def _prefix_shard(q_shard: TokenShard, own: TokenShard, trim: int) -> TokenShard:
    """The own shard's first `trim` keys as a shard (one sequence), made once (cached on q_shard: the fused layout and
    its tables are keyed by the shards' identity)."""
    key = ("prefix", id(own), trim)
    hit = q_shard._tables.get(key)
    if hit is not None and hit[0] is own:
        return hit[1]
    prefix = TokenShard([own.positions[0][:trim]])
    q_shard._tables[key] = (own, prefix)
    return prefix


def _unseen_rows(acc: tuple[torch.Tensor, torch.Tensor], q_shard: TokenShard, own: TokenShard, trim: int) -> None:
    """Under RingConfig.trim0, the kept accumulators' rows of the queries before the first key the first launch reads
    (no program of it writes them): output 0, LSE -inf (nothing seen), set once when the plan is made. The fused
    launch merges into them as into any row; nothing else writes them, so they stay so call after call."""
    if not trim:
        return
    rows = int(np.searchsorted(q_shard.positions_np()[0], own.positions[0][trim], side="left"))
    acc[0][:rows].zero_()
    acc[1][:rows].fill_(NEG_INF)


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream RingConfig.overlap's scatters run on, one per device (they never overlap each other: each call's
    current stream waits for its scatter before the launch that reads it)."""
    return torch.cuda.Stream(device=device)


def _tile_table(q_shard: TokenShard, kv_shard: TokenShard, rows: int, cover: bool, device: torch.device,
                split: tuple[int, int, int, int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The Triton kernel's tile table of q_shard's queries over kv_shard's keys (`build_tiles`), split-K applied
    (`split_counts` / `split_tiles` with split = (BLOCK_N, head groups, SMs, the config's splits)), int32 on
    `device`: (tiles, merge table or None, slots), cached on q_shard (every layer of a step uses the same shards).
    start > 0 (RingConfig.trim0, a shard of one sequence): only its keys from row `start` on (rows as in the block)."""
    key = (id(kv_shard), rows, cover, str(device), split, start)
    hit = q_shard._tables.get(key)
    if hit is not None and hit[0] is kv_shard:
        return hit[1]
    kernels = _triton_kernels()
    k_pos, k_off = kv_shard.positions_np(), kv_shard.offsets[:-1]
    if start:
        k_pos, k_off = [k_pos[0][start:]], [start]
    table = kernels.build_tiles(q_shard.positions_np(), k_pos, q_shard.offsets[:-1], k_off, rows, cover)
    block_n, n_groups, sms, splits = split
    table, merge = kernels.split_tiles(table, kernels.split_counts(table, block_n, n_groups, sms, splits), block_n)
    slots = int((merge[:, 2] + merge[:, 3]).max()) if len(merge) else 0
    on_device = (_to_device(table, device), _to_device(merge, device) if slots else None, slots)
    q_shard._tables[key] = (kv_shard, on_device)
    return on_device


def _fused_layout(q_shard: TokenShard, kv_shards: list[TokenShard],
                  device: torch.device) -> tuple[TokenShard, list[tuple[int, torch.Tensor]]]:
    """The keys of `kv_shards` (disjoint position sets: other ranks' tokens) as one shard, each sequence's positions
    ascending, and per shard how its rows scatter there (`_runs`); cached on q_shard (every layer of a forward uses
    the same shards)."""
    key = ("fused", tuple(id(s) for s in kv_shards), str(device))
    hit = q_shard._tables.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], kv_shards)):
        return hit[1]
    positions, dst = [], [np.empty(s.num_tokens, dtype=np.int64) for s in kv_shards]
    start = 0
    for b in range(q_shard.num_seqs):
        parts = [s.positions_np()[b] for s in kv_shards]
        order = np.argsort(np.concatenate(parts), kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(len(order))  # concatenated row -> its row in position order
        positions.append(np.concatenate(parts)[order].tolist())
        cut = 0
        for s, part, rows in zip(kv_shards, parts, dst):
            rows[s.offsets[b]:s.offsets[b + 1]] = start + rank_of[cut:cut + len(part)]
            cut += len(part)
        start += len(order)
    fused = (TokenShard(positions), [_runs(rows, start, device) for rows in dst])
    q_shard._tables[key] = (list(kv_shards), fused)
    return fused


def _runs(dst: np.ndarray, total: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """A block's scatter into the fused buffer (its row j goes to row dst[j] of `total`) as whole runs of R rows:
    R the largest length dividing every run of consecutive rows and every run's start on both sides (16, the SP
    layout's block, for whole prompts; 1 at worst). Returns (R, the destination run of each source run), so the
    copy moves R x Hkv x D values per index (`_scatter_runs`), not one row's or one value's."""
    if len(dst) == 0:
        return 1, _to_device(np.zeros(0, dtype=np.int64), device)
    starts = np.flatnonzero(np.diff(dst, prepend=dst[0] - 2) != 1)  # a new run: not the previous row + 1
    ends = np.append(starts[1:], len(dst))
    run = int(np.gcd.reduce(np.concatenate([starts, ends, dst[starts], [len(dst)]])))
    run = run if run and total // run * run >= dst.max() + 1 else 1
    return run, _to_device(dst[::run] // run, device)


def _scatter_all(buf: torch.Tensor, blocks: list[torch.Tensor], dst: list[tuple[int, torch.Tensor]]) -> None:
    """Every block into the fused buffer at once (RingConfig.batchcopy, and hybrid): one launch per three blocks
    (`scatter_blocks`) where they are contiguous and their runs whole 8-byte words, else one copy per block
    (`_scatter_runs`). Done at the last step, not as each block arrives: the copies run after the first step's
    kernel either way (one stream), and the host issues one launch, not one per block, before the fused launch
    the GPU waits for."""
    rows = [(b, d) for b, d in zip(blocks, dst) if b.shape[1]]
    row = buf.shape[2] * buf.shape[3] * buf.element_size()
    if rows and buf.is_contiguous() and all(b.is_contiguous() and b.dtype == buf.dtype and d[0] * row % 8 == 0
                                            for b, d in rows):
        _triton_kernels().scatter_blocks(buf, [b for b, _ in rows], [d for _, d in rows])
        return
    for block, (run, index) in zip(blocks, dst):  # the rows its runs read (trim0: the own block's first ones)
        _scatter_runs(buf, block[:, :index.numel() * run] if block.shape[1] else block, run, index)


def _scatter_runs(buf: torch.Tensor, block: torch.Tensor, run: int, index: torch.Tensor) -> None:
    """buf [2, T, Hkv, D] rows of block [2, Tk, Hkv, D] by `_runs`: one row copy (parallel/kernels/block_copy.py,
    8-byte words, wide vector loads) per run of R rows of K or V, where index_copy_ would index every word."""
    from parallel.kernels.block_copy import copy_rows

    tk, t = block.shape[1], buf.shape[1] // run * run
    if tk == 0:
        return
    row = run * block.shape[2] * block.shape[3]
    if (row * block.element_size()) % 8 or not block.is_contiguous():
        buf.index_copy_(1, (index[:, None] * run + torch.arange(run, device=index.device)).reshape(-1), block)
        return
    src = block.view(1, 2, tk // run, row).view(torch.int64)  # views (a copy would take the writes)
    dst = buf[:, :t].view(1, 2, t // run, row).view(torch.int64)
    copy_rows(src, dst, index, gather=False, programs=0)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(array)
    if torch.device(device).type == "cuda":  # pinned: the copy does not wait for the kernels queued before it
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def split_for_ranks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[TokenShard]]:
    """Cut one prompt's q [T, Hq, D], k/v [T, Hkv, D] into what each SP rank holds: positions[r] are rank
    r's (ascending, together every position once). Returns per rank its queries [T_r, Hq, D], its K/V
    block [2, T_r, Hkv, D] and its TokenShard, the arguments of `ring_rank_attention`."""
    held = sorted(p for pos in positions for p in pos)
    if held != list(range(q.shape[0])) or any(pos != sorted(pos) for pos in positions):
        raise ValueError(f"positions must cover 0..{q.shape[0] - 1} once, each rank's ascending")
    idx = [torch.tensor(pos, dtype=torch.long, device=q.device) for pos in positions]
    qs = [q.index_select(0, i) for i in idx]
    blocks = [torch.stack([k.index_select(0, i), v.index_select(0, i)]) for i in idx]
    return qs, blocks, [TokenShard([pos]) for pos in positions]


def _accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty merge state for q [Tq, Hq, D]: out [Tq, Hq, D] zeros and lse [Tq, Hq] -inf, fp32."""
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:2], NEG_INF, dtype=torch.float32, device=q.device)
    return acc_out, acc_lse


_TRITON_MODULE: list = []  # [module or None] once the import was tried


def _triton_kernels():
    """parallel/kernels/ring_attention_triton.py, or None where Triton cannot be imported."""
    if not _TRITON_MODULE:
        try:
            from parallel.kernels import ring_attention_triton
        except ImportError:
            ring_attention_triton = None
        _TRITON_MODULE.append(ring_attention_triton)
    return _TRITON_MODULE[0]


def _triton_runs(q: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on these tensors: Triton importable, inputs it supports, and CUDA
    (or CPU tensors under Triton's interpreter, TRITON_INTERPRET=1: the kernel tests)."""
    kernels = _triton_kernels()
    on_device = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and kernels is not None and kernels.supported_block(q, block)


def triton_is_default(q: torch.Tensor, block: torch.Tensor) -> bool:
    """The default: the Triton kernel on CUDA where it runs, the PyTorch tiles elsewhere (always on CPU)."""
    return q.is_cuda and _triton_runs(q, block)


def _attend_block(q: torch.Tensor, block: torch.Tensor, q_shard: TokenShard, kv_shard: TokenShard, scale: float,
                  acc_out: torch.Tensor, acc_lse: torch.Tensor, tiles: tuple[int, int] | None) -> None:
    """The PyTorch path of one step: merge each sequence's partial attention over one K/V block into the
    accumulators (exact, by LSE). q [Tq, Hq, D]; block [2, Tk, Hkv, D] (the K/V heads travel, never the
    repeated query heads); acc_out [Tq, Hq, D], acc_lse [Tq, Hq] fp32."""
    for b in range(q_shard.num_seqs):
        q_pos, k_pos = q_shard.positions[b], kv_shard.positions[b]
        part = _visible_part(q_pos, k_pos)
        if part is None:
            continue
        q_lo, k_hi, full = part
        q0, q1 = q_shard.offsets[b] + q_lo, q_shard.offsets[b + 1]
        k0 = kv_shard.offsets[b]
        k1 = kv_shard.offsets[b] + k_hi
        # A pair whose every query sees every key (full) runs unmasked; else the tiles mask by position.
        qp, kp = (None, None) if full else (q_pos[q_lo:], k_pos[:k_hi])
        out, lse = blockwise_attention_with_lse(q[q0:q1], block[0, k0:k1], block[1, k0:k1], scale, qp, kp, tiles)
        merge_into(acc_out[q0:q1], acc_lse[q0:q1], out, lse)
