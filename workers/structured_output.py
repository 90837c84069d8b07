"""Structured output on the rank: the step's grammar bitmask applied to the full-vocabulary logits,
batched, just before the sampler (the grammar state itself stays in the engine, engine/grammar.py).

`apply_token_bitmask(logits, seqs, mask)` sets every token a constrained row may not sample to -inf,
in place, for all constrained rows at once. Rows are matched by sequence id, so the model runner's
own row order (decodes first, micro-batches, SP gathers) does not matter. Bits past the bitmask's
width (a padded lm_head) are disallowed. xgrammar's kernels do it where xgrammar is installed (CUDA
or Triton on a GPU, C++ on the CPU: 7x faster there than torch at batch 256); without it (the rank
machine may lack xgrammar), a torch expansion of the bits, which is also the tests' reference.
"""
from __future__ import annotations

import torch

from workers.scheduler_output import ScheduledSeq, TokenBitmask

_BITS = 32


def constrained_rows(seqs: list[ScheduledSeq], mask: TokenBitmask | None) -> tuple[list[int], list[int]]:
    """(logit rows, bitmask rows) of the sequences in `seqs` that `mask` constrains."""
    if mask is None:
        return [], []
    row_of = {s.seq_id: i for i, s in enumerate(seqs)}
    pairs = [(row_of[sid], k) for k, sid in enumerate(mask.seq_ids) if sid in row_of]
    return [r for r, _ in pairs], [k for _, k in pairs]


def is_constrained(seqs: list[ScheduledSeq], mask: TokenBitmask | None) -> bool:
    return bool(constrained_rows(seqs, mask)[0])


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, W] int32 -> [N, vocab] bool (True = allowed); tokens past 32 * W are not allowed."""
    shifts = torch.arange(_BITS, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)  # [N, 32 W]
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [B, V] in place: rows[k] keeps only the tokens bitmask[k] allows."""
    index = torch.tensor(rows, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])  # [N, V]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _xgrammar_kernel():
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:  # the rank may run without xgrammar: the torch path is exact too
        return None
    return apply_token_bitmask_inplace


def apply_bitmask_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """xgrammar's fused kernel (on logits' device); False when xgrammar is missing (use the torch path)."""
    kernel = _xgrammar_kernel()
    if kernel is None or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not logits.is_contiguous():
        return False
    vocab = logits.shape[1]
    if bitmask.shape[1] * _BITS < vocab:  # a padded lm_head: the padding is never a grammar token
        logits[torch.tensor(rows, device=logits.device), bitmask.shape[1] * _BITS:] = float("-inf")
        vocab = bitmask.shape[1] * _BITS
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)  # unconstrained rows: all allowed
    full[rows] = bitmask
    kernel(logits, full.to(logits.device, non_blocking=True), vocab_size=vocab, indices=rows)
    return True


def apply_token_bitmask(logits: torch.Tensor, seqs: list[ScheduledSeq], mask: TokenBitmask | None) -> None:
    """logits [len(seqs), V] (full vocabulary, on the sampling rank): the constrained rows masked in place."""
    rows, ks = constrained_rows(seqs, mask)
    if not rows:
        return
    bitmask = mask.bitmask[ks] if ks != list(range(mask.bitmask.shape[0])) else mask.bitmask
    if not apply_bitmask_xgrammar(logits, bitmask, rows):
        apply_bitmask_torch(logits, bitmask, rows)
