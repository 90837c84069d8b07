"""The engine is token-identical to Hugging Face `generate(do_sample=False)` on every supported
architecture, whatever the batching: mixed prompt lengths in one batch, chunked prefill that splits
blocks, prefix-cache hits, and preemption under a tiny KV budget. Logprobs match HF's
log_softmax(logits) to 1e-4.
"""
import pytest
import torch

from tests.models import (ARCHITECTURES, assert_engine_clean, hf_greedy, hf_greedy_batch, hf_model, prompts_of_lengths,
                          tiny_model)
from tandem import LLM, SamplingParams

LENGTHS = [1, 2, 4, 5, 8, 11, 17, 26]  # 1 token up to several blocks of 4 (and of 8)
MAX_NEW = 10
VOCAB = 300
ATOL = 1e-4


@pytest.fixture
def make_llm():
    made = []

    def make(path, **kw):
        kw = {"dtype": "float32", "device": "cpu", "show_progress": False, "block_size": 4, **kw}
        llm = LLM(model=path, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_engine_clean(llm)


def greedy(n=MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def check_against_hf(path, prompts, outputs, n=MAX_NEW, check_logprobs=True):
    """Tokens and logprobs equal HF's batched greedy `generate` (EOS ignored, like the engine's ignore_eos)."""
    assert len(outputs) == len(prompts)
    for prompt, out, (ref, ref_lp) in zip(prompts, outputs, hf_greedy_batch(path, prompts, n)):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverges from HF"
        assert out.finish_reason == "length"
        if check_logprobs:
            assert out.logprobs is not None and len(out.logprobs) == len(ref)
            for step, (entry, tok) in enumerate(zip(out.logprobs, ref)):
                assert abs(entry[tok] - ref_lp[step, tok].item()) < ATOL
                for other, lp in entry.items():  # the top-n alternatives too
                    assert abs(lp - ref_lp[step, other].item()) < ATOL


def _hf_eos(path) -> list[int]:
    import json
    import os

    with open(os.path.join(path, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return [eos] if isinstance(eos, int) else list(eos)


def _top_ids_ok(entry: dict, lp_row: torch.Tensor, n: int) -> None:
    """The n alternatives reported are HF's n best (ties aside)."""
    nth = lp_row.topk(n).values[-1].item()
    best = sorted(entry.values(), reverse=True)[:n]
    assert all(v >= nth - ATOL for v in best)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_matches_hf(make_llm, arch):
    path = tiny_model(arch)
    prompts = prompts_of_lengths(LENGTHS, VOCAB, seed=1)
    block_size = 8 if arch in ("llama3_rope", "qwen2", "mixtral", "qwen3_moe_nonorm") else 4
    llm = make_llm(path, block_size=block_size)
    outputs = llm.generate(prompts, greedy(logprobs=3))  # one call: all prompts batched together
    check_against_hf(path, prompts, outputs)
    for out, (_, ref_lp) in zip(outputs, hf_greedy_batch(path, prompts, MAX_NEW)):
        for step, entry in enumerate(out.logprobs):
            assert 3 <= len(entry) <= 4
            _top_ids_ok(entry, ref_lp[step], 3)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("chunk", [5, 7])
def test_chunked_prefill_matches_hf(make_llm, arch, chunk):
    path = tiny_model(arch)
    prompts = prompts_of_lengths(LENGTHS, VOCAB, seed=1)
    llm = make_llm(path, block_size=4, max_num_batched_tokens=chunk)
    steps = []
    schedule = llm.llm_engine.scheduler.schedule

    def spy(*args, **kwargs):
        sched_out = schedule(*args, **kwargs)
        steps.append([(s.start_pos, s.num_tokens) for s in sched_out.seqs])
        return sched_out

    llm.llm_engine.scheduler.schedule = spy
    outputs = llm.generate(prompts, greedy(logprobs=0))
    check_against_hf(path, prompts, outputs)
    assert max(sum(n for _, n in st) for st in steps) <= chunk
    # Prefill chunks really did start and end inside blocks.
    chunks = [(start, n) for st in steps for start, n in st if n > 1]
    assert any(start % 4 for start, _ in chunks) and any((start + n) % 4 for start, n in chunks)


def test_prefix_cache_hits_match_hf_and_uncached_run(make_llm):
    path = tiny_model("llama")
    system = prompts_of_lengths([14], VOCAB, seed=7)[0]  # 3.5 blocks of 4
    tails1 = prompts_of_lengths([1, 3, 6], VOCAB, seed=8)
    tails2 = prompts_of_lengths([2, 5, 9], VOCAB, seed=9)
    batch1 = [system + t for t in tails1]
    batch2 = [system + t for t in tails2] + [batch1[1], system[:12], system[:13]]  # incl. exact repeats / block edges

    cached = make_llm(path, block_size=4, enable_prefix_caching=True)
    out1 = cached.generate(batch1, greedy(logprobs=0))
    # A follow-up turn: a prompt that extends an earlier prompt with its output.
    batch2.append(batch1[0] + out1[0].token_ids + [5, 6, 7])
    hits_before = cached.llm_engine.block_manager.hit_tokens
    out2 = cached.generate(batch2, greedy(logprobs=0))
    hits = cached.llm_engine.block_manager.hit_tokens - hits_before
    assert hits > 0
    assert all(o.num_cached_tokens > 0 for o in out2)
    assert out2[-1].num_cached_tokens >= 16  # reused blocks that hold generated tokens

    plain = make_llm(path, block_size=4, enable_prefix_caching=False)
    ref2 = plain.generate(batch2, greedy(logprobs=0))
    assert plain.llm_engine.block_manager.hit_tokens == 0
    assert [o.token_ids for o in out2] == [o.token_ids for o in ref2]
    for a, b in zip(out2, ref2):
        assert all(abs(x[t] - y[t]) < ATOL for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
    check_against_hf(path, batch1, out1)
    check_against_hf(path, batch2, out2)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_tiny_kv_budget_matches_hf(make_llm, prefix_caching):
    path = tiny_model("qwen2")
    prompts = prompts_of_lengths([5, 9, 13, 6, 3, 11], VOCAB, seed=3)
    n = 16
    # 10 blocks of 4 = 40 tokens of KV for 6 sequences that want up to 29 each.
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=10, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(prompts, greedy(n, logprobs=0))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_against_hf(path, prompts, outputs, n)


def test_chunking_prefix_cache_and_preemption_together_match_hf(make_llm):
    path = tiny_model("mixtral")
    system = prompts_of_lengths([9], VOCAB, seed=11)[0]
    prompts = [system + t for t in prompts_of_lengths([1, 4, 7, 2, 10], VOCAB, seed=12)] + prompts_of_lengths([6, 15], VOCAB, seed=13)
    n = 12
    llm = make_llm(path, block_size=4, num_gpu_blocks_override=14, max_num_batched_tokens=7, enable_prefix_caching=True)
    outputs = llm.generate(prompts, greedy(n, logprobs=0))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.block_manager.hit_tokens > 0
    check_against_hf(path, prompts, outputs, n)


@pytest.mark.parametrize("min_tokens", [0, 6])
def test_eos_and_min_tokens_match_hf(make_llm, tmp_path, min_tokens):
    """Without ignore_eos the engine stops where HF stops; min_tokens bans EOS like HF's min_new_tokens."""
    import json
    import shutil

    src = tiny_model("llama")
    prompts = prompts_of_lengths([3, 7, 12], VOCAB, seed=21)
    # Make a generated token an EOS too (besides the real one), so that stopping really happens: in
    # the ignore-EOS run of some prompt k, the first token new at an index j >= min_tokens, with no real
    # EOS before it (banning that token before j changes nothing, as it was not the argmax there).
    real_eos = _hf_eos(src)

    def pick(run):
        for j in range(max(min_tokens, 2), 12):
            if run[j] not in run[:j] and not set(run[: j + 1]) & set(real_eos):
                return j
        return None

    runs = [hf_greedy(src, p, 12)[0] for p in prompts]
    k = next(k for k, run in enumerate(runs) if pick(run) is not None)
    free_run, j = runs[k], pick(runs[k])
    extra_eos = free_run[j]
    path = shutil.copytree(src, tmp_path / "llama-eos")
    gen = json.loads((path / "generation_config.json").read_text())
    eos_ids = [gen["eos_token_id"], extra_eos]
    gen["eos_token_id"] = eos_ids
    (path / "generation_config.json").write_text(json.dumps(gen))

    llm = make_llm(str(path), block_size=4)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=min_tokens, logprobs=0))
    stopped = 0
    for prompt, out in zip(prompts, outputs):
        ref, ref_lp = hf_greedy(str(path), prompt, 12, ignore_eos=False, min_new_tokens=min_tokens, eos_token_id=eos_ids)
        assert out.token_ids == ref
        assert len(ref) >= min_tokens
        if ref[-1] in eos_ids:
            assert out.finish_reason == "stop" and out.stop_reason is None
            stopped += 1
        else:
            assert out.finish_reason == "length"
        for step, (entry, tok) in enumerate(zip(out.logprobs, ref)):
            assert abs(entry[tok] - ref_lp[step, tok].item()) < ATOL
    assert stopped >= 1
    assert outputs[k].token_ids == free_run[: j + 1] and outputs[k].finish_reason == "stop"


def test_repetition_penalty_matches_hf(make_llm):
    """HF's RepetitionPenaltyLogitsProcessor over prompt + output, greedy: the same tokens."""
    path = tiny_model("llama")
    model = hf_model(path)
    prompts = prompts_of_lengths([3, 9, 14], VOCAB, seed=31)
    llm = make_llm(path, block_size=4, max_num_batched_tokens=6)
    # min_tokens bans EOS like HF's min_new_tokens
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, repetition_penalty=1.8, logprobs=0))
    unpenalised = [ref for ref, _ in hf_greedy_batch(path, prompts, 12)]
    assert [o.token_ids for o in outs] != unpenalised  # the penalty changes something
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                           repetition_penalty=1.8, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert out.token_ids == g.sequences[0, len(prompt):].tolist()
        lp = torch.log_softmax(torch.stack(g.logits)[:, 0].float(), dim=-1)
        assert all(abs(e[t] - lp[i, t].item()) < ATOL for i, (e, t) in enumerate(zip(out.logprobs, out.token_ids)))


def test_mistral_runs_up_to_its_sliding_window(make_llm):
    """Sliding-window attention is full attention while the sequence fits the window, so the engine
    caps max_model_len there and matches HF to the last position."""
    from tests.models import MISTRAL_WINDOW

    path = tiny_model("mistral")
    llm = make_llm(path, block_size=8)
    assert llm.llm_engine.max_model_len == MISTRAL_WINDOW
    prompt = prompts_of_lengths([30], VOCAB, seed=41)[0]
    out = llm.generate([prompt], greedy(64, logprobs=0))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == MISTRAL_WINDOW
    check_against_hf(path, [prompt], [out], n=MISTRAL_WINDOW - len(prompt))
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(path, max_model_len=MISTRAL_WINDOW + 1)
