"""Speculative decoding on a GPU (issue 16): verification steps replay their CUDA graphs
(workers/spec_decode/graphs.py), whose attention is the split-context kernel (parallel/kernels/verify_attention.py)
and whose all-greedy steps read only the replay's argmax rows (`verify_greedy`); n-gram greedy output is
token-identical to plain decoding in fp32, batched and at batch 1; in bf16 the graphs pass their start-up
check against the eager path (a failed check would leave verification eager, about 3x slower)."""
from __future__ import annotations

from pathlib import Path

from tandem import LLM, SamplingParams

TINY = str(Path(__file__).resolve().parents[2] / "models" / "tandem-tiny")  # trained: its greedy text repeats
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 numbers: 0 1 2 3",
           "def fibonacci(n):", "class LRUCache:\n    def __init__(self, capacity):",
           "The quick brown fox jumps over the lazy dog. " * 25 + "The quick"]  # ~530 tokens: split contexts


def _engine(dtype: str) -> LLM:
    return LLM(TINY, device="cuda", dtype=dtype, block_size=16, num_gpu_blocks_override=512, max_num_seqs=8,
               enable_prefix_caching=False, show_progress=False, speculative_config=NGRAM)


def test_ngram_greedy_in_verification_graphs_is_token_identical():
    llm = _engine("float32")
    eng = llm.llm_engine
    runner = eng.executor.runner
    try:
        graphs = runner.verify_graphs
        assert graphs is not None, "verification graphs were not captured (or failed their check)"
        replays = []
        run = graphs.run
        graphs.run = lambda out: replays.append(len(out.seqs)) or run(out)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        prompts = PROMPTS
        spec = eng.spec_decoder
        batched = llm.generate(prompts, params)
        single = [llm.generate([p], params)[0] for p in prompts]
        stats = spec.metrics()
        eng.spec_decoder = None  # the same engine, plain decoding
        plain = llm.generate(prompts, params)
    finally:
        eng.shutdown()
    assert [o.token_ids for o in batched] == [o.token_ids for o in plain]
    assert [o.token_ids for o in single] == [o.token_ids for o in plain]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert 1 in replays and max(replays) > 1, replays  # batch-1 and batched verification steps were graphed
    print(f"\n{len(replays)} graphed verification steps; acceptance {stats['spec_decode_acceptance_rate']:.2f}, "
          f"{stats['spec_decode_mean_accepted_length']:.2f} tokens per speculating step")


def test_bf16_verification_graphs_pass_their_start_up_check():
    llm = _engine("bfloat16")
    try:
        assert llm.llm_engine.executor.runner.verify_graphs is not None
        out = llm.generate(PROMPTS[-1:], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        assert len(out[0].token_ids) == 32
    finally:
        llm.llm_engine.shutdown()
