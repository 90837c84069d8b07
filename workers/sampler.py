"""Turns the last-position logits of each sampled sequence into the next token (vLLM/OpenAI semantics).

Order: logprobs from the raw logits; penalties; min_tokens masking; greedy argmax, or
temperature -> top-k -> top-p -> min-p -> draw. B = len(seqs) rows, V = vocab.
"""
from __future__ import annotations

import array

import torch

from workers.host_fetch import host_lists
from workers.sampling_params import SamplingParams
from workers.scheduler_output import SampledToken, ScheduledSeq

try:  # one-kernel greedy decoding on CUDA
    from parallel.kernels import sampling as _kernels
except ImportError:  # no Triton (CPU machines)
    _kernels = None

# Below this a temperature is numerically greedy anyway; dividing by it could overflow float32.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


def _row_seed(seed: int, step: int) -> int:
    """A well-mixed 64-bit seed from (request seed, output index), so nearby seeds/steps don't correlate."""
    x = (seed * 0x9E3779B97F4A7C15 + step) & _MASK64
    # splitmix64 finaliser
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int | None = None):
        """`seed` seeds the generator shared by unseeded requests; None draws a fresh one."""
        self.eos_token_ids = list(eos_token_ids)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @staticmethod
    def is_plain_greedy(seq: ScheduledSeq) -> bool:
        """True when the next token is the raw argmax and nothing but its own logprob is asked for:
        then the full-vocabulary logits are not needed (a sharded argmax gives the same answer)."""
        p = seq.sampling_params
        return p.greedy and not p.logprobs and not p.needs_token_history and seq.num_output_tokens >= p.min_tokens

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> list[SampledToken]:
        tokens, logprobs, tops = self.columns(logits, seqs)
        return list(map(SampledToken, tokens, logprobs, tops or [None] * len(tokens)))

    def columns(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> tuple[list[int], list[float], list | None]:
        """(token ids, their logprobs, top logprobs per row or None when no row asked): the sampled rows as
        columns, which `ModelRunnerOutput.from_columns` takes without an object per token."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [len(seqs)={len(seqs)}, vocab], got {tuple(logits.shape)}")
        if not seqs:
            return [], [], None
        params = [s.sampling_params for s in seqs]
        raw = logits.float()  # [B, V]
        if all(self.is_plain_greedy(s) for s in seqs):
            return self.greedy_columns(self.greedy_pack(raw), params)
        x = raw.clone()  # [B, V], what penalties/masks/temperature modify; `raw` stays for logprobs
        self._apply_penalties(x, seqs)
        self._apply_min_tokens(x, seqs)

        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == len(seqs):
            tokens = self._sample(x, seqs)  # [B]
        else:
            tokens = x.argmax(dim=-1)  # [B]; first maximum on ties, like HF greedy
            if sample_rows:
                rows = torch.tensor(sample_rows, device=x.device)
                # x[rows] is a copy, so the in-place steps in _sample don't touch the greedy rows
                tokens[rows] = self._sample(x[rows], [seqs[i] for i in sample_rows])

        # log_softmax(raw) at a few columns, without materialising [B, V] log-probs
        lse = torch.logsumexp(raw, dim=-1, keepdim=True)  # [B, 1]
        token_logprobs = (raw.gather(1, tokens[:, None]) - lse).squeeze(1)  # [B]
        n_top = max((p.logprobs or 0 for p in params), default=0)
        tops = None
        if n_top > 0:
            top_vals, top_ids_t = raw.topk(n_top, dim=-1)  # [B, n_top], best first
            token_list, lp_list, top_ids, top_lps = host_lists(tokens, token_logprobs, top_ids_t, top_vals - lse)
            tops = [None if p.logprobs is None else list(zip(ids[:p.logprobs], lps[:p.logprobs]))
                    for p, ids, lps in zip(params, top_ids, top_lps)]
            return token_list, lp_list, tops
        token_list, lp_list = host_lists(tokens, token_logprobs)
        return token_list, lp_list, no_top_logprobs(params)

    @staticmethod
    def greedy_pack(logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B, 2] float64 (argmax token id, its log-probability): one tensor, so one
        device-to-host copy (float64 holds any token id exactly). No host syncs: CUDA-graph safe."""
        if _kernels is not None and logits.is_cuda:
            return _kernels.greedy_pack(logits)
        raw = logits.float()
        tokens = raw.argmax(dim=-1)  # [B], first maximum on ties
        lps = raw.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)  # [B]
        return torch.stack([tokens.double(), lps.double()], dim=1)

    @staticmethod
    def greedy_columns(packed: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], list[float], list | None]:
        """`greedy_pack`'s [B, 2] as `columns` gives them (the all-greedy batch: no copies of the logits)."""
        tokens, logprobs = host_lists(packed.t())[0]
        return [int(t) for t in tokens], logprobs, no_top_logprobs(params)

    # ---- logit processors, in place on x [B, V] ----

    @staticmethod
    def _apply_penalties(x: torch.Tensor, seqs: list[ScheduledSeq]) -> None:
        """Repetition (HF, prompt + output), then frequency and presence (OpenAI, output only), as vLLM.

        Works on the (row, token) pairs of the histories instead of [B, V] count tensors: a gather,
        a transform and a scatter. Duplicate pairs write the same value, so each token is penalised once.
        """
        dev = x.device
        rep_rows = [i for i, s in enumerate(seqs) if s.sampling_params.repetition_penalty != 1.0]
        if rep_rows:
            r, t = _row_token_pairs(rep_rows, [(seqs[i].prompt_token_ids, seqs[i].output_token_ids) for i in rep_rows], dev)
            pen = torch.tensor([s.sampling_params.repetition_penalty for s in seqs], device=dev)[r]  # [N]
            v = x[r, t]  # [N]
            x[r, t] = torch.where(v > 0, v / pen, v * pen)

        out_rows = [
            i for i, s in enumerate(seqs)
            if (s.sampling_params.frequency_penalty != 0.0 or s.sampling_params.presence_penalty != 0.0)
            and s.output_token_ids
        ]
        if out_rows:
            r, t = _row_token_pairs(out_rows, [(seqs[i].output_token_ids,) for i in out_rows], dev)
            freq = torch.tensor([s.sampling_params.frequency_penalty for s in seqs], device=dev)  # [B]
            pres = torch.tensor([s.sampling_params.presence_penalty for s in seqs], device=dev)  # [B]
            x.index_put_((r, t), -freq[r], accumulate=True)  # one subtraction per occurrence = count * freq
            x[r, t] = x[r, t] - pres[r]  # gather-then-write: once per distinct token

    def _apply_min_tokens(self, x: torch.Tensor, seqs: list[ScheduledSeq]) -> None:
        vocab = x.shape[1]
        rows: list[int] = []
        toks: list[int] = []
        for i, s in enumerate(seqs):
            p = s.sampling_params
            if s.num_output_tokens >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            # a user-supplied id past the vocab would be a device-side assert on CUDA
            banned = [t for t in banned if 0 <= t < vocab]
            rows += [i] * len(banned)
            toks += banned
        if toks:
            x[torch.tensor(rows, device=x.device), torch.tensor(toks, device=x.device)] = float("-inf")

    # ---- random sampling, on the R non-greedy rows ----

    def _sample(self, x: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """x: [R, V] processed logits (modified in place). Returns [R] token ids."""
        return self.draw(self.probs(x, seqs), seqs)

    def process(self, raw: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """raw [B, V] logits -> a copy with penalties and min_tokens applied (what greedy takes the argmax of)."""
        x = raw.float().clone()
        self._apply_penalties(x, seqs)
        self._apply_min_tokens(x, seqs)
        return x

    def probs(self, x: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """x: [R, V] processed logits of sampled rows (modified in place) -> [R, V] the distribution a
        token is drawn from: temperature, top-k, top-p, min-p, softmax. Speculative verification
        compares these with the draft's (workers/spec_decode/verify.py)."""
        dev, vocab = x.device, x.shape[1]
        params = [s.sampling_params for s in seqs]
        temps = torch.tensor([max(p.temperature, _MIN_TEMPERATURE) for p in params], device=dev)  # [R]
        x.div_(temps[:, None])

        use_top_k = any(0 < p.top_k < vocab for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_p:
            x = _top_k_top_p(x, params)
        elif use_top_k:
            _top_k_only(x, params)

        if any(p.min_p > 0.0 for p in params):
            probs = x.softmax(dim=-1)  # [R, V]
            min_p = torch.tensor([p.min_p for p in params], device=dev)  # [R]
            cutoff = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [R, 1]
            x.masked_fill_(probs < cutoff, float("-inf"))
        return x.softmax(dim=-1)  # [R, V]

    def draw(self, probs: torch.Tensor, seqs: list[ScheduledSeq], salt: int = 0) -> torch.Tensor:
        """probs [R, V] (modified in place) -> [R] one draw per row.

        Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p. Seeded rows get their
        own noise, so their token depends only on (seed, output index, salt, their probabilities);
        `salt` separates other draws made for the same output index (a draft model's proposals)."""
        noise = torch.empty_like(probs)  # [R, V]
        if any(s.sampling_params.seed is None for s in seqs):
            noise.exponential_(generator=self._shared_generator(probs.device))
        for r, s in enumerate(seqs):
            if s.sampling_params.seed is not None:
                noise[r].exponential_(generator=self.seeded_generator(s, probs.device, salt))
        # an exact 0 draw would turn a masked token's 0/0 into NaN, which argmax would pick
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def seeded_generator(seq: ScheduledSeq, device: torch.device, salt: int = 0) -> torch.Generator:
        """The generator of a seeded request's draw for output index `seq.num_output_tokens`."""
        g = torch.Generator(device=device)
        seed = _row_seed(seq.sampling_params.seed, seq.num_output_tokens)
        g.manual_seed(_row_seed(seed, salt) if salt else seed)
        return g

    def uniform(self, seqs: list[ScheduledSeq], device: torch.device, salt: int) -> torch.Tensor:
        """[R] uniform draws in [0, 1), one per row, seeded like `draw` (rejection sampling's coins)."""
        u = torch.empty(len(seqs), device=device)
        if any(s.sampling_params.seed is None for s in seqs):
            u.uniform_(generator=self._shared_generator(device))
        for r, s in enumerate(seqs):
            if s.sampling_params.seed is not None:
                u[r : r + 1].uniform_(generator=self.seeded_generator(s, device, salt))
        return u

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self._seed is None:
                g.seed()
            else:
                g.manual_seed(self._seed)
            self._generators[device] = g
        return g


def _row_token_pairs(
    rows: list[int], histories: list[tuple[list[int], ...]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattens each row's token lists into (row index, token id) pairs, [N] each, on `device`.

    Histories can be long (whole prompts, every step): array.array packs Python ints several times
    faster than torch.tensor(list) does.
    """
    flat = array.array("q")
    lengths: list[int] = []
    for lists in histories:
        n = 0
        for ids in lists:
            flat.extend(ids)
            n += len(ids)
        lengths.append(n)
    if not flat:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty
    tokens = torch.frombuffer(flat, dtype=torch.int64)  # [N]
    row_idx = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths))  # [N]
    return row_idx.to(device), tokens.to(device)


def _top_k_values(params: list[SamplingParams], vocab: int, device: torch.device) -> torch.Tensor:
    """[R] k per row, `vocab` where top-k is off."""
    return torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)


def _top_k_only(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """x: [R, V]. torch.topk up to the largest k in the batch is much cheaper than a full sort."""
    vocab = x.shape[1]
    k = _top_k_values(params, vocab, x.device)  # [R]
    k_max = max(p.top_k for p in params if 0 < p.top_k < vocab)
    top = x.topk(k_max, dim=-1).values  # [R, k_max], descending
    kth = top.gather(1, (k.clamp(max=k_max) - 1)[:, None])  # [R, 1]
    kth.masked_fill_((k >= vocab)[:, None], float("-inf"))  # rows without top-k keep everything
    x.masked_fill_(x < kth, float("-inf"))  # ties with the k-th value survive, as in vLLM


# Top-p sorts only this many of the best logits per row when they hold the kept set (all but the
# flattest distributions): a partial top-k selection instead of a sort of the whole vocabulary.
TOP_P_CANDIDATES = 1024
MIN_CUDA_ROWS = 16


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x: [R, V] -> [R, V] with top-k then top-p (on the top-k renormalised distribution) applied.

    Works on the best C = max(TOP_P_CANDIDATES, largest k) logits of each row; a row whose top-p set
    might reach past them (no top-k and less than top_p of the mass among them) sends the batch to the
    full sort (`_top_k_top_p_sorted`, same result).
    """
    vocab = x.shape[1]
    c = max([TOP_P_CANDIDATES] + [p.top_k for p in params if 0 < p.top_k < vocab])
    # On a GPU a few rows sort faster than they select (scripts/bench_sampler.py, H200: 0.18 vs 0.48 ms at one row).
    if c >= vocab or (x.is_cuda and x.shape[0] < MIN_CUDA_ROWS):
        return _top_k_top_p_sorted(x, params)
    dev = x.device
    k = _top_k_values(params, vocab, dev)  # [R]
    p = torch.tensor([p.top_p for p in params], device=dev)  # [R]
    has_k = k < vocab  # [R]
    vals, idx = x.topk(c, dim=-1)  # [R, C], descending
    kth = vals.gather(1, (k.clamp(max=c) - 1)[:, None])  # [R, 1]
    vals = vals.masked_fill(has_k[:, None] & (vals < kth), float("-inf"))  # ties with the k-th survive
    # top-p is on the distribution after top-k: renormalised over the k kept, else over the vocabulary.
    # Only top-p rows without top-k need the vocabulary's log-sum-exp, and only they can reach past C.
    open_rows = any(not 0 < q.top_k < vocab and q.top_p < 1.0 for q in params)
    lse = torch.logsumexp(vals, dim=-1)  # [R]
    if open_rows:
        lse = torch.where(has_k, lse, torch.logsumexp(x, dim=-1))
    probs = (vals - lse[:, None]).exp()  # [R, C]
    if open_rows and bool((~has_k & (p < 1.0) & (probs.sum(dim=-1) < p)).any()):
        return _top_k_top_p_sorted(x, params)
    keep = (probs.cumsum(dim=-1) - probs) < p[:, None]  # the better tokens hold less than top_p
    keep[:, 0] = True  # always keep the best token
    keep |= (p >= 1.0)[:, None]
    out = torch.full_like(x, float("-inf")).scatter_(1, idx, vals.masked_fill(~keep, float("-inf")))
    truncated = has_k | (p < 1.0)  # [R]; rows with neither keep every logit
    return torch.where(truncated[:, None], out, x)


def _top_k_top_p_sorted(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x: [R, V] -> [R, V] with top-k then top-p (on the top-k renormalised distribution) applied."""
    vocab = x.shape[1]
    k = _top_k_values(params, vocab, x.device)  # [R]
    p = torch.tensor([p.top_p for p in params], device=x.device)  # [R]
    x_sorted, idx = x.sort(dim=-1)  # [R, V] ascending, so the kept tokens are a suffix
    kth = x_sorted.gather(1, (vocab - k)[:, None])  # [R, 1]
    x_sorted.masked_fill_(x_sorted < kth, float("-inf"))
    cum = x_sorted.softmax(dim=-1).cumsum(dim=-1)  # [R, V], mass of this token and all worse ones
    drop = cum <= (1.0 - p)[:, None]  # tokens whose removal still leaves >= top_p of the mass
    drop[:, -1] = False  # always keep the best token
    x_sorted.masked_fill_(drop, float("-inf"))
    return x.scatter_(1, idx, x_sorted)


def no_top_logprobs(params: list[SamplingParams]) -> list | None:
    """The top-logprobs column of rows that asked for none: [] for `logprobs=0` (the sampled token's own
    logprob only), None where no row asked at all."""
    if not any(p.logprobs == 0 for p in params):
        return None
    return [[] if p.logprobs == 0 else None for p in params]
