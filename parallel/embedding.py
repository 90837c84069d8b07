"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of the TP size and split in contiguous row ranges. Padded
rows are zero and never produce logits that survive (they are sliced off after the gather).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import gather_last_dim, reduce_partial_sums
from parallel.linear import set_weight_loader
from parallel.state import Group, tp_group


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows in the checkpoint, config says vocab_size={self.vocab_size}")
        real_rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        param.data.zero_()
        param.data[:real_rows].copy_(loaded[self.vocab_start : self.vocab_start + real_rows])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(token_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        local = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        out = F.embedding(torch.where(local, token_ids - self.vocab_start, 0), self.weight)
        out.masked_fill_(~local.unsqueeze(-1), 0)
        return reduce_partial_sums(out, self.group)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharding as the embedding (so tied weights share one parameter); produces logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("use compute_logits(hidden) on the LM head")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, d] -> full-vocabulary logits [n, vocab_size] on every TP rank."""
        logits = F.linear(hidden, self.weight)
        return gather_last_dim(logits, self.group)[:, : self.vocab_size]
