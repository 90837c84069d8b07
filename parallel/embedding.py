"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of the TP size and split in contiguous row ranges. Padded
rows are zero and never produce logits that survive (sliced off after the gather, or masked to -inf
before a per-rank argmax).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import gather_first_dim, gather_last_dim_to_first, gather_to_all, gather_to_first, reduce_partial_sums
from parallel.linear import ColumnParallelLinear, set_weight_loader
from parallel.matmul import linear
from parallel.quant.base import QuantConfig
from parallel.state import Group, tp_group

GREEDY_KERNELS_ENV = "TANDEM_TP_GREEDY_KERNELS"  # "0": a TP head's greedy choice in the PyTorch form (to compare)
# A TP rank's share of the token embedding on CUDA: "push" (default: the lookup and the zeros in one launch,
# `fused_ops.vocab_rows`, and the batch-1 fused decoder pushes the rows into a first pushed-partials site for the
# first qkv GEMV to sum, with no all-reduce: workers/models/fused_decode.py; other batches all-reduce them), "kernel"
# (the one launch, then the all-reduce at every batch), "torch" (compares, shift, lookup, fill, then the all-reduce).
# Batch-1 TP=2 on 2 x H200, one call: push 382.6 / 382.4 tok/s, kernel 382.0, torch 380.1 (docs/benchmarks.md).
TP_EMBED_ENV = "TANDEM_TP_EMBED"
TP_EMBED_MODES = ("torch", "kernel", "push")

try:
    from parallel.kernels import fused_ops as _fused_ops
    from parallel.kernels import sampling as _sampling
except ImportError:  # no Triton (CPU machines): the PyTorch form
    _fused_ops = _sampling = None


def tp_embed_mode() -> str:
    """TANDEM_TP_EMBED's value (see TP_EMBED_MODES); another is refused by name."""
    mode = os.environ.get(TP_EMBED_ENV, "push").strip().lower()
    if mode not in TP_EMBED_MODES:
        raise ValueError(f"{TP_EMBED_ENV}={mode!r}: expected one of {', '.join(TP_EMBED_MODES)}")
    return mode


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, embedding_dim: int, group: Group | None = None):
        super().__init__()
        self.group = group or tp_group()
        self.vocab_size = vocab_size
        self.rows_per_rank = pad_vocab(vocab_size, self.group.size) // self.group.size
        self.vocab_start = self.group.rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = set_weight_loader(
            nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False), self.weight_loader
        )
        self.lookup_kernel = tp_embed_mode() != "torch"  # read once: the rows' lookup on CUDA under TP, each step

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows in the checkpoint, config says vocab_size={self.vocab_size}")
        real_rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        param.data.zero_()
        param.data[:real_rows].copy_(loaded[self.vocab_start : self.vocab_start + real_rows])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(token_ids, self.weight)
        if token_ids.is_cuda and _fused_ops is not None and self.lookup_kernel:
            return reduce_partial_sums(_fused_ops.vocab_rows(token_ids, self.weight, self.vocab_start), self.group)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        local = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        out = F.embedding(torch.where(local, token_ids - self.vocab_start, 0), self.weight)
        out.masked_fill_(~local.unsqueeze(-1), 0)
        return reduce_partial_sums(out, self.group)


class _LogitsHead:
    """What an LM head does with its projection (`local_logits_raw(hidden)`: [n, rows_per_rank] logits of this
    rank's vocabulary slice, rows `vocab_start`..): full logits on one rank, or greedy tokens from three numbers a
    row. Needs `group`, `vocab_size`, `vocab_start`, `rows_per_rank`.

    Only one rank samples (the TP group's first), so logits are gathered there alone. Greedy rows
    need even less: each rank reduces its vocabulary slice to (max logit, its token id, log-sum-exp)
    and only those three numbers per row travel, instead of vocab_size / tp logits; few enough to send
    to every rank where each wants the tokens (`greedy_tokens(everywhere=True)`).
    """

    group: Group
    vocab_size: int
    vocab_start: int
    rows_per_rank: int

    def local_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("use compute_logits(hidden) or greedy_tokens(hidden) on the LM head")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, d] -> full-vocabulary logits [n, vocab_size] on the group's first rank, None on the others."""
        logits = gather_last_dim_to_first(self.local_logits_raw(hidden), self.group)
        # Padding rows sit at the end of the last rank's slice, so slicing drops exactly them.
        return None if logits is None else logits[:, : self.vocab_size]

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, rows_per_rank] logits of this rank's slice; padding columns are -inf so they never win."""
        logits = self.local_logits_raw(hidden)
        real = min(max(self.vocab_size - self.vocab_start, 0), self.rows_per_rank)
        if real < self.rows_per_rank:
            logits[:, real:] = float("-inf")
        return logits

    def greedy_tokens(self, hidden: torch.Tensor, everywhere: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [n, d] -> (argmax token ids [n] int64, their log-probabilities [n] fp32) on the
        group's first rank; None on the others, unless `everywhere` (see `greedy_packed`)."""
        packed = self.greedy_packed(hidden, everywhere)
        return None if packed is None else (packed[0].long(), packed[1].float())

    def greedy_packed(self, hidden: torch.Tensor, everywhere: bool = False) -> torch.Tensor | None:
        """hidden [n, d] -> [2, n] float64 (argmax token ids, their log-probabilities in fp32's values) on the
        group's first rank; None on the others, unless `everywhere`: then every rank gets the same
        [n, 3] per rank from an all-gather and picks bitwise the same tokens (so each can fill the next step's
        placeholders itself, with no round trip through the driver: cluster/rank_worker.py).

        Ties go to the lowest token id, as a full-vocabulary argmax would: slices are in ascending id
        order and both argmaxes return the first maximum. On CUDA a rank's (max, id, log-sum-exp) come from one
        pass of the greedy kernel over its slice and the ranks' are combined by another (parallel/kernels/
        sampling.py): two or three kernels and the all-gather, where the PyTorch form below launches ~25 small ones
        after the head's GEMM, in each TP decode step of a rank (batch-1 TP=2 on 2 x H200: 365.0 -> 380 tok/s).
        """
        logits = self.local_logits(hidden)  # [n, V/tp]
        if logits.is_cuda and _sampling is not None and os.environ.get(GREEDY_KERNELS_ENV, "1") != "0":
            pushed = getattr(self.group, "pushed_greedy", None) if everywhere else None
            if pushed is not None and 3 * logits.shape[0] <= pushed.width:  # the same rows on every rank
                site = pushed.next_site()  # every rank's (max, id, lse) pushed to every rank, not all-gathered
                _sampling.greedy_parts(logits, self.vocab_start, push=site)
                return _sampling.greedy_combine(None, site=site, rows=logits.shape[0])
            parts = _sampling.greedy_parts(logits, self.vocab_start)  # [n, 3]
            if everywhere:
                per_rank = gather_first_dim(parts, self.group).view(self.group.size, *parts.shape)
            else:
                gathered = gather_to_first(parts, self.group)
                if gathered is None:
                    return None
                per_rank = torch.stack(gathered)  # [tp, n, 3]
            return _sampling.greedy_combine(per_rank)
        logits = logits.float()
        index = logits.argmax(dim=-1)  # [n]
        values = logits.gather(1, index[:, None]).squeeze(1)
        lse = torch.logsumexp(logits, dim=-1)
        # float64 holds any token id exactly, so one message carries all three numbers.
        packed = torch.stack([values.double(), (index + self.vocab_start).double(), lse.double()], dim=-1)  # [n, 3]
        parts = gather_to_all(packed, self.group) if everywhere else gather_to_first(packed, self.group)
        if parts is None:
            return None
        per_rank = torch.stack(parts, dim=1)  # [n, tp, 3]
        best = per_rank[..., 0].argmax(dim=1)  # [n]
        chosen = per_rank.gather(1, best[:, None, None].expand(-1, 1, 3)).squeeze(1)  # [n, 3]
        total_lse = torch.logsumexp(per_rank[..., 2], dim=1)  # [n]
        return torch.stack([chosen[:, 1], (chosen[:, 0] - total_lse).float().double()])


class ParallelLMHead(_LogitsHead, VocabParallelEmbedding):
    """Same sharding as the embedding (so tied weights share one parameter); produces logits."""

    def local_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)


class QuantizedLMHead(_LogitsHead, ColumnParallelLinear):
    """An LM head stored quantized (a GPTQ checkpoint with `lm_head: true`, as GPTQModel writes and vLLM loads):
    the vocabulary split over TP ranks as a column-parallel linear's outputs, its parameters named as the
    checkpoint names them (`lm_head.qweight`, ...) and applied by the quantization's linear method, so on CUDA
    the 4-bit GEMV reads a quarter of the bf16 head's bytes (at batch 1 the head is ~15% of a Llama-3.1-8B
    step). Unlike the plain head its rows are not padded: the vocabulary must split evenly over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_config: QuantConfig, group: Group | None = None):
        group = group or tp_group()
        if vocab_size % group.size:
            raise ValueError(f"a quantized LM head splits its {vocab_size} vocabulary rows evenly over the "
                             f"{group.size} TP ranks; {vocab_size} is not a multiple of {group.size}")
        ColumnParallelLinear.__init__(self, hidden_size, vocab_size, bias=False, group=group,
                                      quant_config=quant_config)
        self.vocab_size = vocab_size
        self.rows_per_rank = self.output_size_per_rank
        self.vocab_start = group.rank * self.rows_per_rank

    def local_logits_raw(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden, None)


def make_lm_head(vocab_size: int, hidden_size: int, quant_config: QuantConfig | None) -> nn.Module:
    """The quantized head where the checkpoint quantizes it (`quant_config.lm_head`), else the plain one."""
    if quant_config is not None and quant_config.lm_head:
        return QuantizedLMHead(vocab_size, hidden_size, quant_config)
    return ParallelLMHead(vocab_size, hidden_size)
