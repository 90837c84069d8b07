"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, vLLM-style."""
from __future__ import annotations

import itertools
from typing import Sequence as Seq

from tqdm.auto import tqdm

from workers.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from workers.sampling_params import SamplingParams


class LLM:
    """Accepts the flat engine arguments of `EngineConfig` (model, dtype, device, max_model_len,
    block_size, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, tensor_parallel_size, ...)."""

    def __init__(self, model: str, **kwargs):
        show_progress = kwargs.pop("show_progress", True)
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = self._make_engine(self.config, show_progress)
        self._ids = itertools.count()

    @staticmethod
    def _make_engine(config: EngineConfig, show_progress: bool) -> LLMEngine:
        return LLMEngine(config, show_progress)

    def shutdown(self) -> None:
        """Stop the engine's ranks (the Ray actors of a multi-rank layout). The LLM is unusable afterwards."""
        self.llm_engine.shutdown()

    def get_metrics(self) -> dict:
        """The engine's counters and gauges: KV blocks, queue, prefix-cache hits, preemptions, and speculative
        decoding's (spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens, per draft position
        spec_decode_num_accepted_tokens_per_pos; zeros without speculation)."""
        return self.llm_engine.stats()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams (vLLM's name): the model's
        generation_config.json defaults with generation_config="auto", else SamplingParams()."""
        return SamplingParams(**self.llm_engine.default_sampling_fields)

    def generate(self, prompts: str | list[int] | dict | Seq[str | list[int] | dict], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Seq[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Given params are used as they are, as vLLM's LLM does: the model's defaults fill no field of them.
        params = [p.as_given() for p in params]
        priority = list(priority) if priority is not None else [0] * len(prompts)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p, prio in zip(ids, prompts, params, priority):
                self.llm_engine.add_request(rid, prompt, p, prio)
        except Exception:
            for rid in ids:
                self.llm_engine.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        self.llm_engine.drain()
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One conversation through the model's chat template."""
        # return_dict=False: transformers 5 returns a BatchEncoding by default, which list() would turn into its keys.
        token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        return self.generate([list(token_ids)], sampling_params)[0]


def _prompt_of(prompt: str | list[int] | dict) -> str | list[int]:
    """A prompt as the engine takes it; vLLM's prompt dicts too: {"prompt": text} or {"prompt_token_ids": ids}."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) & {"prompt", "prompt_token_ids"}
    if len(keys) != 1 or set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}:
        raise ValueError(f"a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids', got keys {sorted(prompt)}")
    if prompt.get("multi_modal_data"):
        raise ValueError("multi_modal_data is not supported: Tandem serves text models")
    return prompt[keys.pop()]
