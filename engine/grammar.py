"""Structured output's grammar side, on xgrammar: compile a request's `StructuredOutputs` to a
grammar over this model's vocabulary, keep one matcher per constrained request, and each step turn
the matchers of the sequences that sample into one `TokenBitmask` for the ranks
(workers/structured_output.py applies it to the logits).

- Compiling (the expensive, tokenizer-dependent part) runs on a background thread, started when the
  request is added (or, on a decode replica, reserved) and cached by spec (LRU): a step never compiles.
  A step that needs a grammar whose compile has not finished yet waits for that one compile only.
- Every emitted token advances its request's matcher (`accept`); the grammar admits EOS only in an
  accept state, and a terminated matcher ends the request ("stop").
- A decode replica (disaggregated serving) compiles from the request's params and advances over the
  first token, which the prefill replica sampled under the same grammar: only the params travel.
- `check_structured_outputs` builds the grammar without the tokenizer (cheap) and raises
  `GrammarError` saying why a spec cannot be honoured: the front ends answer that with a 400.
"""
from __future__ import annotations

import functools
import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from workers.sampling_params import StructuredOutputs
from workers.scheduler_output import ScheduledSeq, TokenBitmask

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (by spec)
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: ".
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A structured-output spec this engine cannot honour (its message says why)."""


def _clean(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e).strip()).strip()


def _build(so: StructuredOutputs):
    import xgrammar as xgr

    if so.kind == "json":
        # Compact JSON (no free whitespace): a model cannot stall in endless blanks, and the output is
        # what json.dumps(separators=(",", ":")) would write.
        return xgr.Grammar.from_json_schema(so.spec, any_whitespace=False, strict_mode=True)
    if so.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if so.kind == "regex":
        return xgr.Grammar.from_regex(so.spec)
    if so.kind == "grammar":
        return xgr.Grammar.from_ebnf(so.spec)
    choices = json.loads(so.spec)  # choice: EBNF string literals (JSON escapes are EBNF escapes)
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


@functools.lru_cache(maxsize=CACHE_SIZE)
def check_structured_outputs(so: StructuredOutputs) -> None:
    """Raise GrammarError naming why `so` cannot be honoured (cached: a repeated spec costs nothing)."""
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            raise GrammarError("choice must be a list of strings") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
    try:
        _build(so)
    except Exception as e:  # xgrammar raises RuntimeError for every unsupported or malformed spec
        raise GrammarError(f"the {so.kind} constraint cannot be honoured: {_clean(e)}") from None


@dataclass
class _State:
    compiled: Future
    matcher: object | None = None  # xgrammar.GrammarMatcher once the compile is done
    broken: bool = False  # compile failed or a token was rejected: only EOS is allowed from now on


class GrammarManager:
    """One engine's grammars: compile cache, per-request matchers, the per-step bitmask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None  # made on the compile thread at first use (reads the whole vocabulary)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar")
        self._compiled: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self._states: dict[str, _State] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    @property
    def active(self) -> bool:
        return bool(self._states)

    # ---- compile (background thread) ----
    def _compile_now(self, so: StructuredOutputs):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(_build(so))

    def compile(self, so: StructuredOutputs) -> Future:
        """The compiled grammar of `so`, compiling on the background thread unless cached."""
        future = self._compiled.get(so)
        if future is None or (future.done() and future.exception() is not None):
            future = self._compiled[so] = self._pool.submit(self._compile_now, so)
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(so)
        return future

    # ---- requests ----
    def add(self, request_id: str, so: StructuredOutputs) -> None:
        """A constrained request arrived (or was reserved): validate now, compile in the background."""
        check_structured_outputs(so)
        self._states[request_id] = _State(self.compile(so))

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _matcher(self, request_id: str, state: _State):
        if state.matcher is None and not state.broken:
            import xgrammar as xgr

            try:
                state.matcher = xgr.GrammarMatcher(state.compiled.result())
            except Exception:  # noqa: BLE001 - validated at add; the request ends rather than the engine
                log.exception("request %s: compiling its grammar failed; it is ended", request_id)
                state.broken = True
        return state.matcher

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's grammar over an emitted token; True when the grammar has terminated."""
        state = self._states.get(request_id)
        if state is None:
            return False
        matcher = self._matcher(request_id, state)
        if matcher is None:
            return True
        if not matcher.accept_token(token):
            log.error("request %s: token %d is outside its grammar; the request is ended", request_id, token)
            state.broken = True
            return True
        return matcher.is_terminated()

    def bitmask(self, seqs: list[ScheduledSeq]) -> TokenBitmask | None:
        """The allowed tokens of the constrained sequences that sample this step, one row each."""
        ids = [s.seq_id for s in seqs if s.sample and s.seq_id in self._states]
        if not ids:
            return None
        words = -(-self.vocab_size // 32)
        bitmask = torch.zeros(len(ids), words, dtype=torch.int32)
        for k, request_id in enumerate(ids):
            state = self._states[request_id]
            matcher = self._matcher(request_id, state)
            if matcher is None:  # broken: EOS only, so that the request ends at once
                for t in self.eos_token_ids:
                    bitmask[k, t // 32] |= _bit(t % 32)
            else:
                matcher.fill_next_token_bitmask(bitmask, k)
        return TokenBitmask(ids, bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int torch accepts (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j
