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

Decode (`sharded_decode_attention`): the few queries are replicated, each rank attends over the KV
it holds, and the partials are merged across the SP group (`merge_attention_partials`).

Zig-zag layout (`zigzag_positions`): a sequence is cut into 2 * sp chunks and rank r takes chunks
r and 2 * sp - 1 - r, so every rank gets one early (cheap) and one late (expensive) chunk of the
causal triangle. RoPE is applied by the caller at the global positions before calling in here.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        self.offsets = [0]
        for p in self.positions:
            self.offsets.append(self.offsets[-1] + len(p))

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.positions)


# ---- partial attention and merging ----
def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the LSE of the scores, computed in fp32.

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

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.recv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_shard: TokenShard,
                   kv_shards: list[TokenShard], scale: float, group: Group) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of all ranks of `group` (ragged batch).

    q [Tq, Hq, D] holds the tokens of `q_shard`; k, v [Tk, Hkv, D] hold this rank's keys, described by
    kv_shards[group.rank]; kv_shards[r] describes rank r's keys (so receive buffers are sized without a
    handshake). A query at global position p attends to every key at position <= p, whichever rank holds
    it. Queries and keys may be different token sets (e.g. new tokens vs. new + cached). Returns [Tq, Hq, D].
    """
    n, me = group.size, group.rank
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:2], NEG_INF, dtype=torch.float32, device=q.device)
    block = torch.stack([k, v]).contiguous()  # [2, Tk, Hkv, D]: one message per step instead of two
    for step in range(n):
        src = (me - step) % n  # whose keys `block` holds now
        exchange = None
        if step < n - 1:
            # Start passing the block on before computing with it: the transfer overlaps the compute.
            exchange = _RingExchange(group, block, kv_shards[(src - 1) % n].num_tokens)
        _attend_block(q, block, q_shard, kv_shards[src], scale, acc_out, acc_lse)
        if exchange is not None:
            block = exchange.wait()
    return acc_out.to(q.dtype)


def _attend_block(q: torch.Tensor, block: torch.Tensor, q_shard: TokenShard, kv_shard: TokenShard, scale: float,
                  acc_out: torch.Tensor, acc_lse: torch.Tensor) -> None:
    """Merge each sequence's partial attention over one K/V block into the accumulators."""
    for b in range(q_shard.num_seqs):
        q_pos, k_pos = q_shard.positions[b], kv_shard.positions[b]
        part = _visible_part(q_pos, k_pos)
        if part is None:
            continue
        q_lo, k_hi, full = part
        q0, q1 = q_shard.offsets[b] + q_lo, q_shard.offsets[b + 1]
        k0 = kv_shard.offsets[b]
        mask = None
        if not full:
            qp = torch.tensor(q_pos[q_lo:], device=q.device)
            kp = torch.tensor(k_pos[:k_hi], device=q.device)
            mask = qp[:, None] >= kp[None, :]  # [q1 - q0, k_hi]
        out, lse = attention_with_lse(q[q0:q1], block[0, k0 : k0 + k_hi], block[1, k0 : k0 + k_hi], scale, mask)
        merge_into(acc_out[q0:q1], acc_lse[q0:q1], out, lse)
