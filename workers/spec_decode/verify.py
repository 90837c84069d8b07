"""Verification of proposed tokens against the target model's logits, exactly.

A speculating sequence ran `[last, d_1 .. d_k]` through the target: its k+1 logit rows give the
target's distribution for output indices n .. n+k, where row j has seen d_1 .. d_j. Each row is
processed as the plain sampler would process that index on its own (penalties over the history
including the drafts before it, min_tokens at index n+j, temperature, top-k/top-p/min-p), then:

* greedy requests keep drafts while each equals the target's argmax, and emit the argmax at the first
  mismatch (or the argmax after the last draft: the bonus token). Token for token the plain output.
* sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft d_j drawn
  from q_j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token is drawn
  from norm(max(0, p_j - q_j)); when all k are kept, a bonus token is drawn from p_{k+1}. The emitted
  tokens are then distributed exactly as the target's own samples. A deterministic proposer (n-gram, a
  greedy draft) has a one-hot q: keep with probability p(d), else draw from p with d removed.

Seeded requests draw their coins and tokens from generators keyed by (seed, output index), so a run is
reproducible whatever the batch.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from workers.host_fetch import host_lists
from workers.sampler import Sampler
from workers.scheduler_output import SampledToken, ScheduledSeq

# Salt of the acceptance coins, so they never reuse the noise of the token drawn at the same index.
ACCEPT_SALT = 0x5EC

RowView = ScheduledSeq


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise, [R, V]: what a rejected draft's replacement is drawn from.

    A rejection implies p(d) < q(d), hence sum(max(0, p - q)) = sum(max(0, q - p)) > 0; where rounding
    leaves nothing, p itself is the limit of the residual and is used."""
    r = (p - q).clamp_(min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def row_views(seq: ScheduledSeq) -> list[RowView]:
    """One view of `seq` per verified row: output index n + j, history extended by the drafts before it."""
    drafts = seq.spec_token_ids
    history = seq.sampling_params.needs_token_history
    return [replace(seq, token_ids=[], spec_token_ids=[], spec_probs=None, num_output_tokens=seq.num_output_tokens + j,
                    output_token_ids=seq.output_token_ids + drafts[:j] if history else seq.output_token_ids)
            for j in range(len(drafts) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> list[list[SampledToken]]:
    """logits [sum(len(s.spec_token_ids) + 1), V], each sequence's rows in order -> the tokens each emits."""
    views = [v for s in seqs for v in row_views(s)]
    if logits.dim() != 2 or logits.shape[0] != len(views):
        raise ValueError(f"verification needs {len(views)} logit rows, got {tuple(logits.shape)}")
    raw = logits.float()
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s.spec_token_ids) + 1)

    if all(Sampler.is_plain_greedy(s) for s in seqs):  # min_tokens met at n, so at n + j too
        (packed,) = host_lists(Sampler.greedy_pack(raw))  # one device-to-host copy
        argmax = [int(t) for t, _ in packed]
        x = None
    else:
        x = sampler.process(raw, views)
        (argmax,) = host_lists(x.argmax(dim=-1))

    # Sampled sequences: target probabilities of every row, coins for every draft.
    sampled_idx = [i for i, s in enumerate(seqs) if not s.sampling_params.greedy]
    is_sampled = set(sampled_idx)
    chosen_row: dict[int, int] = {}  # sequence index -> the row whose distribution its last token comes from
    final_dists: list[torch.Tensor] = []
    emitted_ids: list[list[int]] = [[] for _ in seqs]
    for i, s in enumerate(seqs):
        if i in is_sampled:
            continue
        t = argmax[starts[i]:starts[i + 1]]
        a = 0
        while a < len(s.spec_token_ids) and s.spec_token_ids[a] == t[a]:
            a += 1
        emitted_ids[i] = s.spec_token_ids[:a] + [t[a]]
    if sampled_idx:
        rows = [r for i in sampled_idx for r in range(starts[i], starts[i + 1])]
        p = sampler.probs(x[rows], [views[r] for r in rows])  # [R, V]
        local = {r: n for n, r in enumerate(rows)}
        draft_rows = [r for i in sampled_idx for r in range(starts[i], starts[i + 1] - 1)]
        keep: list[bool] = []
        if draft_rows:
            drafts = torch.tensor([seqs[i].spec_token_ids[j] for i in sampled_idx
                                   for j in range(len(seqs[i].spec_token_ids))], device=p.device)
            p_d = p[[local[r] for r in draft_rows]].gather(1, drafts[:, None]).squeeze(1)
            q_d = torch.cat([_draft_q_at(seqs[i]) for i in sampled_idx]).to(p.device)
            coins = sampler.uniform([views[r] for r in draft_rows], p.device, ACCEPT_SALT)
            (keep,) = host_lists(coins * q_d < p_d)  # u < p/q without dividing by a q of 0 (never drafted then)
        n = 0
        for i in sampled_idx:
            s, k = seqs[i], len(seqs[i].spec_token_ids)
            a = 0
            while a < k and keep[n + a]:
                a += 1
            n += k
            row = local[starts[i] + a]
            if a < k:
                final_dists.append(residual(p[row:row + 1], _draft_q_row(s, a, p)))
            else:
                final_dists.append(p[row:row + 1])
            chosen_row[i] = starts[i] + a
            emitted_ids[i] = s.spec_token_ids[:a]
        (last,) = host_lists(sampler.draw(torch.cat(final_dists), [views[chosen_row[i]] for i in sampled_idx]))
        for i, tok in zip(sampled_idx, last):
            emitted_ids[i] = emitted_ids[i] + [tok]
    return _with_logprobs(raw, seqs, starts, emitted_ids)


def verify_greedy(packed: torch.Tensor, rows: list[int], seqs: list[ScheduledSeq]) -> list[list[SampledToken]]:
    """A step whose sequences are all plain greedy (`Sampler.is_plain_greedy`): `packed` [R, 2] holds each logit
    row's argmax and its log-probability (`Sampler.greedy_pack`; the verification CUDA graph computes it in
    the replay), `rows` each sequence's len(spec_token_ids) + 1 rows of it, in order. What `verify` returns
    for such a step, from one small device-to-host copy and no other kernel: an emitted greedy token is
    its row's argmax (a kept draft equals it), so its log-probability is the row's too."""
    (table,) = host_lists(packed)
    out: list[list[SampledToken]] = []
    r = 0
    for s in seqs:
        drafts = s.spec_token_ids
        mine = [table[i] for i in rows[r:r + len(drafts) + 1]]
        r += len(drafts) + 1
        a = 0
        while a < len(drafts) and drafts[a] == int(mine[a][0]):
            a += 1
        top = [] if s.sampling_params.logprobs == 0 else None  # plain greedy asks for no top-n
        out.append([SampledToken(int(t), lp, top) for t, lp in mine[:a + 1]])
    if r != len(rows):
        raise ValueError(f"verification needs {r} rows, got {len(rows)}")
    return out


def _draft_q_at(seq: ScheduledSeq) -> torch.Tensor:
    """[k] q_j(d_j) of a sequence's drafts (1 for a deterministic proposal)."""
    k = len(seq.spec_token_ids)
    if seq.spec_probs is None:
        return torch.ones(k)
    q = seq.spec_probs.float()
    return q.gather(1, torch.tensor(seq.spec_token_ids, device=q.device)[:, None]).squeeze(1).cpu()


def _draft_q_row(seq: ScheduledSeq, j: int, like: torch.Tensor) -> torch.Tensor:
    """[1, V] the proposal distribution of draft j."""
    if seq.spec_probs is None:
        q = torch.zeros(1, like.shape[1], device=like.device)
        q[0, seq.spec_token_ids[j]] = 1.0
        return q
    return seq.spec_probs[j : j + 1].to(like.device, torch.float32)


def _with_logprobs(raw: torch.Tensor, seqs: list[ScheduledSeq], starts: list[int],
                   emitted: list[list[int]]) -> list[list[SampledToken]]:
    """Each emitted token with its log-probability under the raw logits of its row (as the plain sampler
    reports it) and the top-n where asked."""
    rows = [starts[i] + j for i, toks in enumerate(emitted) for j in range(len(toks))]
    flat = [t for toks in emitted for t in toks]
    sel = raw[rows]  # [E, V]
    lps_t = (sel.gather(1, torch.tensor(flat, device=raw.device)[:, None]).squeeze(1)
             - torch.logsumexp(sel, dim=-1))
    n_top = max((s.sampling_params.logprobs or 0 for s in seqs), default=0)
    top_ids = top_lps = None
    if n_top > 0:
        vals, ids = sel.topk(n_top, dim=-1)
        lps, top_ids, top_lps = host_lists(lps_t, ids, vals - torch.logsumexp(sel, dim=-1, keepdim=True))
    else:
        (lps,) = host_lists(lps_t)
    out: list[list[SampledToken]] = []
    e = 0
    for s, toks in zip(seqs, emitted):
        n = s.sampling_params.logprobs
        mine = []
        for tok in toks:
            top = None
            if n is not None:
                top = list(zip(top_ids[e][:n], top_lps[e][:n])) if n > 0 else []
            mine.append(SampledToken(tok, lps[e], top))
            e += 1
        out.append(mine)
    return out
