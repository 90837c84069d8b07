"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): router softmax, top-k, experts, weighted sum.

Expert weights are stacked per rank: w13 [E_local, 2 * I_shard, H] (gate rows then up rows) and
w2 [E_local, H, I_shard]. FP8 checkpoints (`quant_method: fp8`, e4m3 experts) keep them in e4m3 with a
float32 scale per block, `w13_scale` [E_local, rows, cols] and `w2_scale`: element (n, k) of expert e is
w[e, n, k] * scale[e, n // bn, k // bk]. Block-wise checkpoints give (bn, bk) = weight_block_size;
per-tensor and per-channel ones a scale per output row, (1, K). The experts run weight-only: weights are
dequantized in registers (the fused kernel) or per expert (the loop), activations stay in the model dtype. With TP, each expert's intermediate dim is split over the TP ranks and
the outputs are summed across them. With EP (expert_parallel_size > 1), whole experts (no TP split)
are spread contiguously over the EP group (the TP x SP ranks of a stage) and tokens travel to them
(parallel/moe_dispatch.py); the TP ranks, which hold the same tokens, each dispatch a share of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import reduce_partial_sums
from parallel.linear import ReplicatedLinear, set_weight_loader
from parallel.moe_dispatch import ep_moe, expert_range, gather_token_shares, token_share
from parallel.state import Group, ep_group, tp_group

try:  # Triton grouped-GEMM MoE for the CUDA path; the expert loop below is the reference and the CPU path
    from parallel.kernels.fused_moe import fused_moe as _fused_moe
except ImportError:
    _fused_moe = None


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, group: Group | None = None,
                 local_experts: range | None = None, fp8_block: tuple[int, int] | None | bool = False):
        """group: the ranks splitting each expert's intermediate dim (TP); local_experts: the experts held here (EP).
        fp8_block: False for plain weights; for e4m3 weights, the checkpoint's weight_block_size, or None for
        per-tensor / per-channel scales."""
        super().__init__()
        self.group = group or tp_group()
        if intermediate_size % self.group.size:
            raise ValueError(f"moe intermediate size {intermediate_size} not divisible by tensor_parallel_size {self.group.size}")
        self.num_experts = num_experts
        local = local_experts if local_experts is not None else range(num_experts)
        self.expert_start, self.num_local_experts = local.start, len(local)
        self.i_shard = intermediate_size // self.group.size
        e, h, n = self.num_local_experts, hidden_size, self.i_shard
        self.fp8 = fp8_block is not False
        dtype = torch.float8_e4m3fn if self.fp8 else None
        self.w13 = set_weight_loader(nn.Parameter(torch.empty(e, 2 * n, h, dtype=dtype), requires_grad=False), self.weight_loader)
        self.w2 = set_weight_loader(nn.Parameter(torch.empty(e, h, n, dtype=dtype), requires_grad=False), self.weight_loader)
        if not self.fp8:
            return
        if fp8_block is None:  # a scale per output row
            self.w13_block, self.w2_block = (1, h), (1, n)
        else:
            bn, bk = fp8_block
            if self.group.size > 1 and (n % bn or n % bk):
                # A rank's rows (w13) or columns (w2) must start on a block boundary, or its blocks' scales are another rank's.
                raise ValueError(f"FP8 MoE: the intermediate size per rank ({n}) is not a multiple of weight_block_size "
                                 f"{list(fp8_block)}")
            if n % bn:
                raise ValueError(f"FP8 MoE: moe intermediate size {n} is not a multiple of weight_block_size[0] ({bn})")
            self.w13_block, self.w2_block = (bn, bk), (bn, bk)
        rows13, cols13 = -(-2 * n // self.w13_block[0]), -(-h // self.w13_block[1])
        rows2, cols2 = -(-h // self.w2_block[0]), -(-n // self.w2_block[1])
        self.w13_scale = set_weight_loader(nn.Parameter(torch.empty(e, rows13, cols13), requires_grad=False), self.scale_loader)
        self.w2_scale = set_weight_loader(nn.Parameter(torch.empty(e, rows2, cols2), requires_grad=False), self.scale_loader)

    def is_local(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """shard_id: 'gate' / 'up' ([I, H] in the checkpoint) or 'down' ([H, I])."""
        e = expert_id - self.expert_start
        r, n = self.group.rank, self.i_shard
        if self.fp8 != (loaded.dtype == torch.float8_e4m3fn):
            raise ValueError(f"a {loaded.dtype} expert weight, but config.json's quantization_config says "
                             f"{'FP8' if self.fp8 else 'nothing (no FP8)'}")
        if shard_id == "down":
            param.data[e].copy_(loaded.narrow(1, r * n, n))
        else:
            offset = 0 if shard_id == "gate" else n
            param.data[e].narrow(0, offset, n).copy_(loaded.narrow(0, r * n, n))

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """An expert projection's FP8 scale: `weight_scale_inv` [ceil(out / bn), ceil(in / bk)] (block-wise), or
        `weight_scale` [] / [1] (per tensor) or [out] / [out, 1] (per channel), into this rank's rows/columns."""
        e = expert_id - self.expert_start
        r, n = self.group.rank, self.i_shard
        down = shard_id == "down"
        bn, bk = self.w2_block if down else self.w13_block
        loaded = loaded.float()
        if bn == 1:  # per tensor / per channel: one scale per output row
            out_rows = param.shape[1] if down else n
            if loaded.numel() == 1:
                rows = loaded.reshape(1, 1).expand(out_rows, 1)
            else:
                flat = loaded.reshape(-1, 1)
                rows = flat if down else flat.narrow(0, r * n, n)
            if rows.shape[0] != out_rows:
                raise ValueError(f"FP8 expert scale of shape {tuple(loaded.shape)} does not match its {out_rows} rows")
        else:
            rows = loaded.narrow(1, r * n // bk, param.shape[2]) if down else loaded.narrow(0, r * n // bn, n // bn)
        if down:
            param.data[e].copy_(rows)
        else:
            param.data[e].narrow(0, 0 if shard_id == "gate" else rows.shape[0], rows.shape[0]).copy_(rows)

    @torch.no_grad()
    def fill_dummy(self, gen: torch.Generator) -> None:
        """Random e4m3 weights with scales that put them in the small range plain dummy weights use."""
        for w, scale in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)):
            w.copy_(torch.empty(w.shape, device=w.device).uniform_(-448, 448, generator=gen).to(w.dtype))
            scale.fill_(1e-2 / 448)

    def dequantized(self, e: int, which: str, dtype: torch.dtype) -> torch.Tensor:
        """Local expert e's w13 or w2 [N, K] in `dtype` (scales applied for FP8)."""
        w = getattr(self, which)[e]
        if not self.fp8:
            return w
        bn, bk = getattr(self, which + "_block")
        scale = getattr(self, which + "_scale")[e]
        full = scale.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
        return (w.float() * full).to(dtype)

    use_fused = True  # the fused kernel on CUDA when Triton imports (benchmarks switch it off to compare)

    @property
    def graph_safe(self) -> bool:
        """No host sync in forward (CUDA graphs): true for the fused kernel, not for the expert loop."""
        return _fused_moe is not None and self.use_fused and self.w13.is_cuda and self._fused_takes_scales()

    def _fused_takes_scales(self) -> bool:
        """The fused kernel reads one scale column per K tile: a scale per row (bk = K), or a K block that is a
        power of two of at least 16 (the kernel's K tile is cut to it)."""
        if not self.fp8:
            return True
        ks = ((self.w13_block[1], self.w13.shape[2]), (self.w2_block[1], self.w2.shape[2]))
        return all(bk >= k or (bk >= 16 and bk & (bk - 1) == 0) for bk, k in ks)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids/topk_weights [T, k] (global expert ids, fp32 weights) -> partial [T, H]."""
        if x.shape[0] == 0:  # an EP rank that was sent no tokens
            return torch.zeros_like(x)
        if x.is_cuda and self.graph_safe:
            scales = (self.w13_scale, self.w13_block, self.w2_scale, self.w2_block) if self.fp8 else None
            return _fused_moe(x, self.w13, self.w2, topk_ids, topk_weights, self.expert_start, self.num_experts, scales)
        out = torch.zeros_like(x)
        n_local = self.num_local_experts
        local_ids = topk_ids - self.expert_start
        # Other ranks' experts (EP) map to a sentinel bin after the local ones, which is never computed.
        local_ids = torch.where((local_ids >= 0) & (local_ids < n_local), local_ids, n_local)
        # Sorting the (token, slot) pairs by expert makes each expert's tokens one contiguous slice.
        flat = local_ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=n_local + 1).tolist()
        token_of = order // topk_ids.shape[1]
        weight_of = topk_weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts[:n_local]):
            if n:
                tok = token_of[start : start + n]
                h = F.linear(x[tok], self.dequantized(e, "w13", x.dtype))
                gate, up = h.chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.dequantized(e, "w2", x.dtype))
                out.index_add_(0, tok, (y * weight_of[start : start + n, None]).to(x.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 fp8_block: tuple[int, int] | None | bool = False):
        super().__init__()
        self.top_k, self.renormalize, self.num_experts = top_k, renormalize, num_experts
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.ep = ep_group()
        if self.ep.size == 1:
            self.experts = Experts(num_experts, hidden_size, intermediate_size, fp8_block=fp8_block)
        else:
            if num_experts < self.ep.size:
                raise ValueError(f"expert_parallel_size ({self.ep.size}) exceeds the number of experts ({num_experts})")
            # Each token's expert runs on one rank, whole: nothing to split over TP.
            self.experts = Experts(num_experts, hidden_size, intermediate_size, group=Group(),
                                   local_experts=expert_range(num_experts, self.ep.size, self.ep.rank), fp8_block=fp8_block)
        # Where the EP group is the TP group (no SP), every EP rank already holds every token: each runs its
        # own experts on all of them and one all-reduce sums the partial outputs, as TP's MoE does. No
        # all-to-all, no token counts read on the host, so decode stays inside CUDA graphs. (With top-8 of
        # 128 experts over 2 ranks nearly every token needs both ranks, so a dispatch would move as many
        # bytes as the all-reduce, in three collectives and a host sync per layer.)
        self.ep_tokens_replicated = self.ep.size > 1 and sorted(self.ep.ranks) == sorted(tp_group().ranks)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if self.ep.size == 1 or self.ep_tokens_replicated:
            ids, weights = self.route(x)
            group = self.ep if self.ep_tokens_replicated else self.experts.group  # the TP group (parallel/state.py)
            return reduce_partial_sums(self.experts(x, ids, weights), group)
        # EP over TP x SP ranks: the SP ranks hold different tokens, so tokens travel to their experts. The TP
        # ranks of one SP rank hold the same T tokens: each routes and dispatches its own share, then they gather.
        tp = tp_group()
        share = x[token_share(x.shape[0], tp)]
        ids, weights = self.route(share)
        out = ep_moe(share, ids, weights, self.num_experts, self.experts, self.ep)
        return gather_token_shares(out, x.shape[0], tp)
