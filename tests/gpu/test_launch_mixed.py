"""TANDEM_LAUNCH_MIXED=1 on one GPU (workers/executor.py, `ModelRunner.launch_mixed`): the in-process engine launches
plain greedy steps with prefill chunks in them and plans the next step while they run, instead of running them whole.
Chunked prefill (a small max_num_batched_tokens) makes mixed steps of decodes and prompt chunks, some chunks not the
prompt's last (they sample nothing), and piecewise CUDA graphs replay some of them. float32: the launched steps run
the same forward as whole ones, so the greedy tokens must be identical, and most mixed steps must have been launched."""
from __future__ import annotations

from tests.models import TOKENIZER_VOCAB_SIZE, prompts_of_lengths, tiny_model
from tandem import LLM, SamplingParams
from workers.launched_step import LAUNCH_MIXED_ENV

LLAMA = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512, num_hidden_layers=3)


def _run(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    llm = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=160, max_num_seqs=8, show_progress=False)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        return [o.token_ids for o in outs], dict(llm.llm_engine.executor.launches)
    finally:
        llm.llm_engine.shutdown()


def test_launched_mixed_steps_match_whole_ones(monkeypatch):
    path = tiny_model("llama", max_position_embeddings=1024, **LLAMA)
    prompts = prompts_of_lengths([5, 40, 130, 300, 17, 64, 1, 220], TOKENIZER_VOCAB_SIZE)
    monkeypatch.setenv(LAUNCH_MIXED_ENV, "0")
    whole, counts_whole = _run(path, prompts)
    monkeypatch.setenv(LAUNCH_MIXED_ENV, "1")
    launched, counts = _run(path, prompts)
    assert launched == whole
    assert counts_whole["mixed"] == 0 and counts["mixed"] >= 5, (counts_whole, counts)
