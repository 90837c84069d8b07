"""Multi-rank `LLM(...)` over NCCL (one Ray actor per GPU) against one GPU and Hugging Face.

The CPU suite (tests/test_multirank_llm.py) checks the same layouts over gloo; here the tensors move
over NCCL, headers over the gloo CPU groups. float32 keeps greedy tokens comparable across reduction
orders. Skipped below 2 GPUs; the TP x PP layout needs 4.
"""
from __future__ import annotations

import time

import pytest
import ray
import torch

from tests.models import hf_greedy_argmax, prompts_of_lengths, tiny_model
from workers.executor import ExecutorError
from engine.llm import LLM
from workers.sampling_params import SamplingParams

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")]

MODELS = {
    "llama": dict(num_hidden_layers=3, vocab_size=301),
    "qwen3": dict(num_key_value_heads=1),
}
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}
# A fixed block count: no memory profiling, and the one-GPU reference leaves room for the ranks.
ENGINE_ARGS = dict(device="cuda", dtype="float32", num_gpu_blocks_override=256, block_size=16, max_num_batched_tokens=24,
                   max_num_seqs=8, show_progress=False)
MAX_TOKENS = 8
PROMPTS = prompts_of_lengths([5, 17, 9, 30, 3], vocab_size=290, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
FULL_LOGITS = [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11),
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_gpus=NUM_GPUS, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    refs = {}
    for name, overrides in MODELS.items():
        path = tiny_model(name, **overrides)
        llm = LLM(path, **ENGINE_ARGS)
        refs[name] = dict(path=path, hf=hf_greedy_argmax(path, PROMPTS, MAX_TOKENS, device="cuda"), greedy=llm.generate(PROMPTS, GREEDY),
                          full=llm.generate(PROMPTS, FULL_LOGITS))
        llm.shutdown()
        del llm
    torch.cuda.empty_cache()
    return refs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_layout_matches_one_gpu_and_hf(name: str, layout: str, references):
    args = LAYOUTS[layout]
    if args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1) > NUM_GPUS:
        pytest.skip(f"{layout} needs more than {NUM_GPUS} GPUs")
    ref = references[name]
    llm = LLM(ref["path"], **args, **ENGINE_ARGS)
    try:
        # every rank replays decode CUDA graphs: TP ranks all of the step, pipeline stages their part of it
        # (steps are pipelined, one micro-batch a step, by default), the activations passed between replays
        graph_sizes = ray.get([w.cuda_graph_sizes.remote() for w in llm.llm_engine.executor.workers])
        assert all(graph_sizes), graph_sizes
        greedy = llm.generate(PROMPTS, GREEDY)
        full = llm.generate(PROMPTS, FULL_LOGITS)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in greedy] == ref["hf"]
    assert [o.token_ids for o in greedy] == [o.token_ids for o in ref["greedy"]]
    for got, want in zip(greedy, ref["greedy"]):
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids)], abs=1e-3)
    assert [o.token_ids for o in full] == [o.token_ids for o in ref["full"]]


def test_killed_rank_fails_fast(references):
    llm = LLM(references["llama"]["path"], tensor_parallel_size=2, **ENGINE_ARGS)
    workers = list(llm.llm_engine.executor.workers)
    llm.generate(PROMPTS[:1], GREEDY)
    ray.kill(workers[1])
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"rank 1 \(pp=0, sp=0, tp=1\) died"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - start < 60
