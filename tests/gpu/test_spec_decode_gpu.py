"""Speculative decoding on a GPU (issue 16): verification steps replay their CUDA graphs
(workers/spec_decode/graphs.py), whose attention is the split-context kernel (parallel/kernels/verify_attention.py)
and whose all-greedy steps read only the replay's argmax rows (`verify_greedy`); n-gram greedy output is
token-identical to plain decoding in fp32 (but for a near-tie, see `_same_but_for_a_near_tie`), batched and
at batch 1; in bf16 the graphs pass their start-up
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
        eng.spec_decoder = None  # the same engine, plain decoding, with each position's top two
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2))
    finally:
        eng.shutdown()
    for outs in (batched, single):
        for got, want in zip(outs, plain):
            _same_but_for_a_near_tie(got.token_ids, want)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert 1 in replays and max(replays) > 1, replays  # batch-1 and batched verification steps were graphed
    print(f"\n{len(replays)} graphed verification steps; acceptance {stats['spec_decode_acceptance_rate']:.2f}, "
          f"{stats['spec_decode_mean_accepted_length']:.2f} tokens per speculating step")


def _same_but_for_a_near_tie(got: list[int], want) -> None:
    """Token-identical, or parted where plain decoding's two best tokens were within 1e-3 nats: the
    attention kernels' tl.dot runs fp32 inputs as TF32 (decode and verification kernels alike), so a
    verification step and a decode step may round a near-tie differently."""
    i = next((j for j, (a, b) in enumerate(zip(got, want.token_ids)) if a != b), None)
    if i is None:
        assert len(got) == len(want.token_ids)
        return
    top = sorted(want.logprobs[i].values(), reverse=True)
    assert top[0] - top[1] < 1e-3, (i, got[i], want.token_ids[i], want.logprobs[i])


def test_bf16_verification_graphs_pass_their_start_up_check():
    llm = _engine("bfloat16")
    try:
        assert llm.llm_engine.executor.runner.verify_graphs is not None
        out = llm.generate(PROMPTS[-1:], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        assert len(out[0].token_ids) == 32
    finally:
        llm.llm_engine.shutdown()


def test_draft_model_greedy_feeds_its_drafts_from_the_device():
    """A draft model (tandem-tiny drafting for itself) on a GPU: the greedy draft loop replays the draft's decode
    graphs with each pass's argmax as the next input, straight from the device, and fetches a step's drafts once;
    every draft of the model's own weights is accepted, and the output equals plain decoding (fp32, near-ties aside)."""
    import workers.spec_decode.draft as draft_module

    llm = LLM(TINY, device="cuda", dtype="float32", block_size=16, num_gpu_blocks_override=512, max_num_seqs=8,
              enable_prefix_caching=False, show_progress=False,
              speculative_config={"model": TINY, "num_speculative_tokens": 4})
    eng = llm.llm_engine
    draft = eng.spec_decoder.draft
    assert draft.runner.cuda_graphs is not None, "the draft runner captured no decode graphs"
    fed, fetches = [], []
    run, fetch = draft.runner.cuda_graphs.run, draft_module.host_lists
    draft.runner.cuda_graphs.run = lambda out, tokens=None: fed.append(tokens is not None) or run(out, tokens)
    draft_module.host_lists = lambda *t: fetches.append(len(t)) or fetch(*t)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        spec_out = llm.generate(PROMPTS, params)
        stats = eng.spec_decoder.metrics()
        eng.spec_decoder = None
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2))
    finally:
        draft_module.host_lists = fetch
        eng.shutdown()
    for got, want in zip(spec_out, plain):
        _same_but_for_a_near_tie(got.token_ids, want)
    assert any(fed) and max(fetches) > 1  # graphed passes fed from the device; one fetch held several passes
    assert stats["spec_decode_acceptance_rate"] > 0.9
