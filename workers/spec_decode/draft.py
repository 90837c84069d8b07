"""A draft model that proposes tokens for the target to verify, run in the engine's own process.

The draft is a `ModelRunner` of its own (one rank: its weights and its own KV cache memory) whose
cache has as many blocks as the target's, so it uses the target's block tables: the scheduler's
block ids address both caches, and the slots the scheduler reserved for a step's drafts hold the
draft's KV too. Only what the draft computed for a sequence itself is trusted (`_done`): a sequence
catches up lazily, in the first pass of its next speculating step (its prompt the first time, else
the tokens the target accepted past the draft's own), so prefix-cache hits, preemption and steps
that did not speculate need no special case. A wrong draft KV could only lower acceptance: every
draft is verified by the target.

One step: pass 1 runs each speculating sequence's catch-up tokens (usually its last token, or two
after a fully accepted run) and samples draft 1 at the last; passes 2..k run one token each (a CUDA
graph replay where the draft runner captured them). Greedy requests take the draft's argmax; sampled
ones draw from the draft's distribution q after the request's own processing (temperature, top-k,
top-p, min-p, penalties), and q travels with the drafts for the rejection sampler.

When every sequence of the step is plain greedy (`Sampler.is_plain_greedy`: no penalties, logprobs or
min_tokens to apply on the host), a pass's argmax stays on the device and is the next pass's input token;
the step's drafts reach the host in one fetch after the last pass, not one per drafted token.
"""
from __future__ import annotations

import torch

from workers.attention import forward_context
from workers.config import EngineConfig
from workers.host_fetch import host_lists
from workers.loader import load_hf_config
from workers.model_runner import ModelRunner
from workers.sampler import Sampler
from workers.scheduler_output import ScheduledSeq, SchedulerOutput
from workers.spec_decode.config import SpeculativeConfig

# Separates the draft's random draws from the target's at the same output index (seeded requests).
DRAFT_SALT = 0xD7AF7


class DraftProposer:
    def __init__(self, target: EngineConfig, spec: SpeculativeConfig, num_blocks: int, max_model_len: int,
                 eos_token_ids: list[int]):
        """A draft runner over `num_blocks` blocks (the target's count: same block ids)."""
        self.k = spec.num_speculative_tokens
        self.hf_config = load_hf_config(spec.model)
        self.max_model_len = min(max_model_len, spec.max_model_len or getattr(self.hf_config, "max_position_embeddings",
                                                                              max_model_len))
        cfg = EngineConfig.from_kwargs(
            model=spec.model, dtype=target.model.dtype, device=target.model.device, load_format=target.model.load_format,
            seed=target.model.seed, attention_backend=target.model.attention_backend,
            enforce_eager=target.model.enforce_eager, block_size=target.cache.block_size,
            num_gpu_blocks_override=num_blocks, enable_prefix_caching=False,
            max_num_seqs=target.scheduler.max_num_seqs, max_num_batched_tokens=target.scheduler.max_num_batched_tokens)
        self.runner = ModelRunner(cfg, self.hf_config, self.max_model_len, eos_token_ids, show_progress=False)
        self.sampler = Sampler(eos_token_ids, seed=target.model.seed + 1)
        self._done: dict[str, int] = {}  # seq_id -> leading positions whose draft KV this draft computed

    def forget(self, seq_ids: list[str]) -> None:
        """Finished or preempted sequences: their blocks may go to others."""
        for seq_id in seq_ids:
            self._done.pop(seq_id, None)

    def kv_bytes(self) -> int:
        return self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()

    @torch.inference_mode()
    def propose(self, seqs: list[ScheduledSeq], history: dict[str, list[int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each scheduled sequence (decode + `num_lookahead` reserved slots) and its known tokens in
        `history`: its drafts and, for a sampled request, their q [len(drafts), V] (None for greedy)."""
        if not seqs:
            return []
        views: list[ScheduledSeq] = []
        for s in seqs:
            tokens = history[s.seq_id]
            start = min(self._done.get(s.seq_id, 0), s.start_pos)  # trust only what this draft computed
            views.append(ScheduledSeq(s.seq_id, tokens[start:], start, s.block_table, True, s.sampling_params,
                                      s.num_output_tokens, s.prompt_token_ids, list(s.output_token_ids)))
        if all(Sampler.is_plain_greedy(v) for v in views):
            return [(d, None) for d in self._propose_greedy(seqs, views)]
        k = max(s.num_lookahead for s in seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for j in range(k):
            logits = self._forward([views[i] for i in active])  # [len(active), V]
            tokens, q = self._draw(logits, [views[i] for i in active])
            still = []
            for row, i in enumerate(active):
                v = views[i]
                drafts[i].append(tokens[row])
                if q is not None and not v.sampling_params.greedy:
                    probs[i].append(q[row])
                self._done[v.seq_id] = v.context_len
                # the next pass feeds this draft at the next position
                v.start_pos, v.token_ids = v.context_len, [tokens[row]]
                v.num_output_tokens += 1
                if v.sampling_params.needs_token_history:
                    v.output_token_ids.append(tokens[row])
                if len(drafts[i]) < seqs[i].num_lookahead:
                    still.append(i)
            active = still
            if not active:
                break
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _propose_greedy(self, seqs: list[ScheduledSeq], views: list[ScheduledSeq]) -> list[list[int]]:
        """`propose` for a step of plain greedy sequences: each pass feeds the last one's argmax from the device
        (`_forward`'s `tokens`); one host fetch for all passes at the end."""
        passes: list[tuple[list[int], torch.Tensor]] = []  # (indices into seqs, their drafts [len] on the device)
        active, tokens = list(range(len(seqs))), None
        while active:
            tokens = self._forward([views[i] for i in active], tokens).argmax(dim=-1)
            passes.append((active, tokens))
            for i in active:
                v = views[i]
                self._done[v.seq_id] = v.context_len
                # The next pass feeds this draft at the next position: its value is on the device (`tokens`).
                v.start_pos, v.token_ids = v.context_len, [0]
                v.num_output_tokens += 1
            keep = [row for row, i in enumerate(active) if len(passes) < seqs[i].num_lookahead]
            if 0 < len(keep) < len(active):
                tokens = tokens[_index(keep, tokens.device)]
            active = [active[row] for row in keep]
        drafts: list[list[int]] = [[] for _ in seqs]
        for (rows, _), values in zip(passes, host_lists(*(t for _, t in passes))):
            for i, token in zip(rows, values):
                drafts[i].append(token)
        return drafts

    def _forward(self, views: list[ScheduledSeq], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits at each view's last token, in the order given. tokens: each view's one input token on the
        device (their `token_ids` are then placeholders), or None to read them from the views."""
        runner = self.runner
        out = SchedulerOutput(views)
        graphs = runner.cuda_graphs
        if graphs is not None and graphs.with_head and graphs.can_run(out):
            return graphs.run(out, tokens)[0]
        order = sorted(range(len(views)), key=lambda i: views[i].num_tokens != 1)  # decodes first (attention)
        batch = [views[i] for i in order]
        token_ids, positions, meta, sample_rows = runner.prepare(SchedulerOutput(batch))
        if tokens is not None:  # one token per view: the flat step's tokens are the views' in `order`
            token_ids = tokens[_index(order, tokens.device)].to(token_ids.dtype)
        with forward_context(meta):
            hidden, _ = runner.model(token_ids, positions, None, None)
        logits = runner.model.lm_head.compute_logits(hidden[sample_rows])
        back = torch.empty(len(order), dtype=torch.long, device=logits.device)
        back[_index(order, logits.device)] = torch.arange(len(order), device=logits.device)
        return logits[back]

    def _draw(self, logits: torch.Tensor, views: list[ScheduledSeq]) -> tuple[list[int], torch.Tensor | None]:
        """The next draft of each view, and q [len(views), V] when some request samples."""
        if all(Sampler.is_plain_greedy(v) for v in views):
            return host_lists(logits.argmax(dim=-1))[0], None
        x = self.sampler.process(logits, views)
        tokens = x.argmax(dim=-1)
        rows = [i for i, v in enumerate(views) if not v.sampling_params.greedy]
        q = None
        if rows:
            q = torch.zeros_like(x)
            q[rows] = self.sampler.probs(x[rows], [views[i] for i in rows])
            tokens[rows] = self.sampler.draw(q[rows].clone(), [views[i] for i in rows], salt=DRAFT_SALT)
        return host_lists(tokens)[0], q


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """rows as an index tensor on `device`. On a GPU through pinned memory: a copy from pageable memory first
    waits for the stream's queued work, the host round trip the greedy draft loop avoids."""
    index = torch.tensor(rows, dtype=torch.long)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index
