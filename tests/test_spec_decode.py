"""Speculative decoding (issue 16): config validation, the n-gram proposer, greedy outputs token-identical
to plain decoding (n-gram and draft model, batched, with stops, max_tokens, logprobs, preemption and
prefix caching inside speculative runs), mixed batches, the counters, and the scheduler's lookahead
slots. The sampled distribution is tested in tests/test_spec_sampling.py."""
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models import assert_engine_clean, tiny_model
from tandem import LLM, SamplingParams
from workers.spec_decode.ngram import propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts (a list, a quoted sentence) and plain ones, of different lengths.
PROMPTS = [
    "numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 numbers: 0 1 2 3",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps",
    "Hello world!",
    "Paged attention keeps the KV cache in fixed-size blocks. Paged attention keeps the",
]


def perturbed_copy(src: str, dst, noise: float, seed: int = 0) -> str:
    """A draft close to the target: its folder with every weight w -> w + noise * std(w) * N(0, 1)."""
    path = Path(shutil.copytree(src, dst))
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, w in weights.items():
        if noise and w.numel() > 1:
            weights[name] = w + noise * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def make(path=None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "show_progress": False, "block_size": 4, **kw}
    return LLM(model=path or tiny_model("llama"), **kw)


def greedy(n=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **{"ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def plain():
    return make()


@pytest.fixture(scope="module")
def same_draft(tmp_path_factory):
    """The target's own weights as the draft: every greedy draft is accepted, so runs are k+1 long and
    every stop condition lands inside one."""
    return make(speculative_config={"model": perturbed_copy(tiny_model("llama"), tmp_path_factory.mktemp("d") / "m", 0.0),
                                    "num_speculative_tokens": 4})


def check_same(ref, out):
    for a, b in zip(ref, out):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)


# ---- config ----
@pytest.mark.parametrize("cfg, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2}, "give a method"),
    ({"model": "/nowhere", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2"),
])
def test_bad_config_is_a_value_error_naming_the_problem(cfg, message):
    from workers.config import EngineArgs, EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(model=tiny_model("llama"), speculative_config=cfg)
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=cfg)  # the served app's and the CLI's config too


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    from workers.config import EngineConfig

    other = tiny_model("llama", vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target 300"):
        EngineConfig.from_kwargs(model=tiny_model("llama"), speculative_config={"model": other, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="no config.json in the draft model folder"):
        EngineConfig.from_kwargs(model=tiny_model("llama"), speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})


def test_cli_flag_parses_json():
    from tandem.cli import build_parser

    ns = build_parser().parse_args(["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


# ---- n-gram proposer ----
def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert propose_ngram([1, 2, 9, 7, 1, 2, 8, 6, 1, 2], 2, 1, 2) == [8, 6]  # most recent occurrence
    assert propose_ngram([4, 5, 6, 1, 5, 6], 3, 1, 2) == [1, 5, 6]  # the 2-gram (5, 6) beats the 1-gram
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    assert propose_ngram([7, 8, 7, 9], 2, 2, 3) == []  # only a 1-gram matches, below prompt_lookup_min
    assert propose_ngram([5, 6, 5, 6], 4, 1, 3) == [5, 6]  # fewer than k where the context ends


def test_ngram_matches_a_brute_force_search_and_token_arrays_track_appends():
    import random

    import numpy as np

    from workers.spec_decode.ngram import TokenArrays

    def brute(tokens, k, lo, hi):
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            hits = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
            if hits:
                return tokens[hits[-1] + n:hits[-1] + n + k]
        return []

    rng = random.Random(0)
    arrays = TokenArrays()
    grown: list[int] = []
    for _ in range(1500):
        toks = [rng.randrange(rng.choice([3, 6, 20])) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        k, hi = rng.randrange(1, 6), lo + rng.randrange(0, 3)
        assert propose_ngram(toks, k, lo, hi) == brute(toks, k, lo, hi), (toks, k, lo, hi)
        grown.extend(toks[:3])
        assert np.array_equal(arrays.get("s", grown), grown)


# ---- greedy: token-identical ----
def test_ngram_greedy_is_token_identical_batched(plain):
    spec = make(speculative_config=NGRAM)
    params = [greedy(24), greedy(17, logprobs=2), greedy(30), greedy(9)]
    ref = plain.generate(PROMPTS, params)
    out = spec.generate(PROMPTS, params)
    check_same(ref, out)
    for lp_ref, lp in zip(ref[1].logprobs, out[1].logprobs):  # logprobs of every emitted token
        assert lp.keys() == lp_ref.keys()
        assert all(abs(lp[t] - lp_ref[t]) < 1e-4 for t in lp)
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    assert sum(m["spec_decode_num_accepted_tokens_per_pos"]) == m["spec_decode_num_accepted_tokens"]
    assert m["spec_decode_num_accepted_tokens_per_pos"][0] >= m["spec_decode_num_accepted_tokens_per_pos"][-1]
    assert_engine_clean(spec)


def test_draft_model_greedy_is_token_identical(plain, tmp_path):
    draft = perturbed_copy(tiny_model("llama"), tmp_path / "draft", 0.3)
    spec = make(speculative_config={"model": draft, "num_speculative_tokens": 3})
    params = [greedy(20), greedy(26), greedy(13), greedy(20, logprobs=1)]
    check_same(plain.generate(PROMPTS, params), spec.generate(PROMPTS, params))
    m = spec.get_metrics()
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]  # some rejected, some kept
    assert_engine_clean(spec)


def test_greedy_draft_steps_fetch_their_drafts_once(plain, tmp_path, monkeypatch):
    """Plain greedy sequences: each draft pass's argmax feeds the next pass from the device, and a step's drafts
    reach the host in one fetch, not one per drafted token (k = 4 here); the output still equals plain decoding."""
    import workers.spec_decode.draft as draft_module

    spec = make(speculative_config={"model": perturbed_copy(tiny_model("llama"), tmp_path / "draft", 0.3),
                                    "num_speculative_tokens": 4})
    calls = {"fetch": 0, "propose": 0}
    fetch, propose = draft_module.host_lists, draft_module.DraftProposer.propose

    def counted_fetch(*tensors):
        calls["fetch"] += 1
        return fetch(*tensors)

    def counted_propose(self, seqs, history):
        calls["propose"] += bool(seqs)
        return propose(self, seqs, history)

    monkeypatch.setattr(draft_module, "host_lists", counted_fetch)
    monkeypatch.setattr(draft_module.DraftProposer, "propose", counted_propose)
    params = [greedy(20), greedy(26), greedy(13)]
    check_same(plain.generate(PROMPTS[:3], params), spec.generate(PROMPTS[:3], params))
    assert calls["propose"] > 5 and calls["fetch"] == calls["propose"]
    assert spec.get_metrics()["spec_decode_num_draft_tokens"] > 3 * calls["propose"]  # most steps drafted 4
    assert_engine_clean(spec)


def test_stops_inside_accepted_runs(plain, same_draft):
    ref = plain.generate(PROMPTS[:2], greedy(30))
    assert same_draft.get_metrics()["spec_decode_acceptance_rate"] in (0.0, 1.0)
    for r in ref:
        toks = r.token_ids
        for n in (1, 2, 3, 6, 7, 11):  # max_tokens at every offset of a run of 5
            check_same(plain.generate(r.prompt_token_ids, greedy(n)), same_draft.generate(r.prompt_token_ids, greedy(n)))
        for j in (3, 7, 12):  # a stop token, an EOS-like stop, min_tokens past an earlier occurrence
            stop = toks[j]
            for kw in ({"stop_token_ids": [stop]}, {"stop_token_ids": [stop], "min_tokens": j + 1}):
                p = greedy(30, **kw)
                check_same(plain.generate(r.prompt_token_ids, p), same_draft.generate(r.prompt_token_ids, p))
        text = r.text
        for cut in (len(text) // 3, len(text) // 2):
            stop = text[cut:cut + 3]
            if not stop.strip():
                continue
            for inc in (False, True):
                p = greedy(30, stop=[stop], include_stop_str_in_output=inc, logprobs=0)
                a, b = plain.generate(r.prompt_token_ids, p), same_draft.generate(r.prompt_token_ids, p)
                check_same(a, b)
                assert len(b[0].logprobs) == len(b[0].token_ids)
    m = same_draft.get_metrics()
    assert m["spec_decode_acceptance_rate"] == 1.0 and m["spec_decode_num_draft_tokens"] > 50
    assert_engine_clean(same_draft)


def test_preemption_and_prefix_caching_with_speculation():
    """A cache of 40 blocks of 4 tokens for 6 sequences of up to 60 tokens: sequences are preempted and
    recomputed (their draft slots too), and the repeated prompts hit the prefix cache."""
    prompts = PROMPTS + PROMPTS[:2]
    params = greedy(40)
    ref = make(num_gpu_blocks_override=40, max_model_len=100).generate(prompts, params)
    spec = make(speculative_config=NGRAM, num_gpu_blocks_override=40, max_model_len=100)
    out = spec.generate(prompts, params)
    check_same(ref, out)
    stats = spec.get_metrics()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    spec.llm_engine.block_manager.check_invariants()
    assert_engine_clean(spec)


def test_mixed_batch_greedy_sampled_and_opted_out(plain, tmp_path):
    """Greedy, seeded sampled (with penalties) and opted-out requests share steps; greedy and opted-out
    ones equal plain decoding, seeded ones are reproducible."""
    draft = perturbed_copy(tiny_model("llama"), tmp_path / "draft", 0.2)
    spec = make(speculative_config={"model": draft, "num_speculative_tokens": 3})
    eng = spec.llm_engine
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.2, logprobs=1)

    def run():
        eng.add_request("g", PROMPTS[0], greedy(20))
        eng.add_request("s", PROMPTS[1], sampled)
        eng.add_request("o", PROMPTS[2], greedy(20), speculate=False)
        eng.add_request("q", PROMPTS[3], greedy(20, frequency_penalty=0.5, min_tokens=5))
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        return done

    first, second = run(), run()
    ref = plain.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], [greedy(20), greedy(20), greedy(20, frequency_penalty=0.5, min_tokens=5)])
    assert first["g"].token_ids == ref[0].token_ids
    assert first["o"].token_ids == ref[1].token_ids
    assert first["q"].token_ids == ref[2].token_ids
    assert first["s"].token_ids == second["s"].token_ids and len(first["s"].token_ids) == 20  # seeded: reproducible
    assert len(first["s"].logprobs) == 20
    assert eng.spec_decoder.metrics()["spec_decode_num_accepted_tokens"] > 0
    assert_engine_clean(spec)


def test_speculation_turns_off_at_large_batches(plain):
    spec = make(speculative_config={**NGRAM, "disable_by_batch_size": 3})
    ref = plain.generate(PROMPTS, greedy(12))
    check_same(ref, spec.generate(PROMPTS, greedy(12)))  # 4 running: never speculates
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] == 0 and m["spec_decode_num_steps_disabled"] > 0
    check_same(ref[:2], spec.generate(PROMPTS[:2], greedy(12)))  # 2 running: speculates
    assert spec.get_metrics()["spec_decode_num_draft_tokens"] > 0


# ---- scheduler lookahead ----
def test_lookahead_slots_are_reserved_and_rejected_ones_freed():
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from workers.config import SchedulerConfig
    from workers.scheduler_output import ModelRunnerOutput, SampledToken

    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(), bm)
    seq = Sequence("a", list(range(1, 8)), SamplingParams(max_tokens=50))
    sched.add(seq)
    out = sched.schedule(lambda s: 5)  # prefill: no lookahead
    assert out.seqs[0].num_lookahead == 0 and len(seq.block_table) == 2
    sched.update(out, ModelRunnerOutput({"a": SampledToken(9, 0.0)}))  # 8 tokens, 7 computed
    out = sched.schedule(lambda s: 5)
    s = out.seqs[0]
    assert s.num_lookahead == 5 and len(seq.block_table) == 4  # positions 7..12: blocks 0-3
    s.spec_token_ids = [1, 2, 3, 4, 5]
    s.token_ids = s.token_ids + s.spec_token_ids
    # the verifier kept one draft and corrected the second: 2 tokens emitted
    toks = [SampledToken(1, 0.0), SampledToken(7, 0.0)]
    sched.update(out, ModelRunnerOutput({"a": toks[0]}, {"a": toks}))
    sched.accept(seq, 7)
    assert seq.num_computed_tokens == 9 and seq.token_ids[-2:] == [1, 7]
    assert len(seq.block_table) == 3  # 10 tokens need 3 blocks: the 4th (rejected drafts' slots) is free again
    assert bm.num_free_blocks == 13
    bm.check_invariants()


# ---- multi-rank transport ----
def test_drafts_and_verified_runs_cross_the_rank_channel():
    """What a Ray executor sends its ranks (workers/step_delta.py): drafts and q per step, forgotten the
    step after; several tokens per sequence back."""
    from workers.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
    from workers.step_delta import StepDecoder, StepEncoder, pack_output, unpack_output

    enc, dec = StepEncoder(), StepDecoder()
    p = SamplingParams(temperature=0.7, max_tokens=9)
    q = torch.rand(2, 300)
    first = SchedulerOutput([ScheduledSeq("a", [5, 6, 7], 10, [0, 1, 2], True, p, 3, spec_token_ids=[6, 7], spec_probs=q),
                             ScheduledSeq("b", [9], 4, [3], True, p, 1)])
    got = dec.decode(enc.encode(first))
    assert got.seqs[0].spec_token_ids == [6, 7] and torch.equal(got.seqs[0].spec_probs, q)
    assert got.seqs[1].spec_token_ids == [] and got.seqs[1].spec_probs is None
    second = SchedulerOutput([ScheduledSeq("a", [8], 13, [0, 1, 2], True, p, 6), ScheduledSeq("b", [2, 4], 5, [3], True, p, 2,
                                                                                              spec_token_ids=[4])])
    got = dec.decode(enc.encode(second))
    assert got.seqs[0].spec_token_ids == [] and got.seqs[0].spec_probs is None  # last step's drafts are gone
    assert got.seqs[1].spec_token_ids == [4] and got.seqs[1].spec_probs is None
    # a rejection freed "b"'s tail block and the next step regrew the table with another id: the ranks follow
    third = SchedulerOutput([ScheduledSeq("b", [8], 7, [3, 6], True, p, 4)])
    dec.decode(enc.encode(third))
    fourth = SchedulerOutput([ScheduledSeq("b", [9], 8, [3, 7], True, p, 5)])
    assert dec.decode(enc.encode(fourth)).seqs[0].block_table == [3, 7]
    result = ModelRunnerOutput({"a": SampledToken(1, -0.5), "b": SampledToken(4, -0.1, [(4, -0.1)])},
                               {"b": [SampledToken(4, -0.1, [(4, -0.1)]), SampledToken(8, -1.0, [(8, -1.0)])]})
    back = unpack_output(pack_output(result, second), second)
    assert back.sampled["a"].token_id == 1 and [t.token_id for t in back.spec["b"]] == [4, 8]
    assert back.sampled["b"].token_id == 4 and back.spec["b"][1].top_logprobs == [(8, -1.0)]


# ---- disaggregation: the decode side of a handoff ----
def test_decode_replica_speculates_after_a_kv_handoff(plain):
    """A prefill engine hands a prompt's KV and first token to a speculating decode engine (the KV copied
    block by block, as the transfer does): the continuation equals plain decoding."""
    from workers.scheduler_output import SampledToken

    params = greedy(24)
    prompt = plain.llm_engine.tokenize(PROMPTS[0])
    ref = plain.generate(prompt, params)[0]
    prefill, decode = make().llm_engine, make(speculative_config=NGRAM).llm_engine
    prefill.add_request("r", prompt, params, handoff=True)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.finished), None)
    assert first.finish_reason == "handoff" and first.token_ids == ref.token_ids[:1]
    blocks, cached = decode.reserve("r", prompt, params)
    src = prefill.held_block_ids("r")
    for s, d in list(zip(src, blocks))[cached:]:
        decode.executor.runner.kv_cache[:, :, d] = prefill.executor.runner.kv_cache[:, :, s]
    prefill.release("r")
    decode.start("r", SampledToken(first.token_ids[0], 0.0))
    out = None
    while out is None:
        out = next((o for o in decode.step() if o.finished), None)
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert decode.spec_decoder.metrics()["spec_decode_num_accepted_tokens"] > 0
    assert_engine_clean(decode)
    assert_engine_clean(prefill)


def test_speculation_next_to_chunked_prefill(plain):
    """A 12-token step budget: prompts arrive in chunks while earlier requests speculate in the same steps."""
    spec = make(speculative_config=NGRAM, max_num_batched_tokens=12)
    eng = spec.llm_engine
    ref = plain.generate(PROMPTS, greedy(20))
    eng.add_request("early", PROMPTS[0], greedy(20))
    for _ in range(8):  # its prompt in chunks, then its first speculative steps
        eng.step()
    for i, p in enumerate(PROMPTS[1:]):
        eng.add_request(f"late{i}", p, greedy(20))
    done = {}
    mixed = False
    while eng.has_unfinished_requests():
        running = eng.scheduler.running
        mixed |= any(s.num_uncomputed_tokens > 1 for s in running) and any(s.num_uncomputed_tokens == 1 for s in running)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert mixed
    assert [done[k].token_ids for k in ("early", "late0", "late1", "late2")] == [r.token_ids for r in ref]
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert_engine_clean(spec)


# ---- verification CUDA graphs: what a replay reads (the replay itself needs a GPU) ----
def test_verify_graph_inputs_pad_to_k_plus_1_and_pick_the_eager_rows(monkeypatch):
    """The host side of workers/spec_decode/graphs.py: real tokens at their slots, padding tokens and rows
    with slot -1 (no KV write) and no context, positions valid, and the rows the eager path would sample."""
    from types import SimpleNamespace

    from workers.scheduler_output import ScheduledSeq, SchedulerOutput
    from workers.spec_decode import graphs as vg

    replayed = []
    monkeypatch.setattr(vg.VerifyGraphs, "_capture", lambda self: self.graphs.update(
        {bs: SimpleNamespace(replay=lambda bs=bs: replayed.append(bs)) for bs in self.batch_sizes}) or self.outputs.update(
        {bs: torch.arange(bs * self.q) for bs in self.batch_sizes}))
    runner = SimpleNamespace(device=torch.device("cpu"), block_size=4, max_model_len=64)
    g = vg.VerifyGraphs(runner, q=4, batch_sizes=[1, 2, 4])
    p = SamplingParams(temperature=0.0)
    big = SchedulerOutput([ScheduledSeq(f"x{i}", [1, 2, 3, 4], 20, [0, 1, 2, 3, 4, 5], True, p, 2, spec_token_ids=[2, 3, 4])
                           for i in range(4)])
    g.run(big)  # leaves real values in every row
    seqs = [ScheduledSeq("a", [7, 8, 9], 10, [5, 6, 7, 8], True, p, 3, spec_token_ids=[8, 9]),  # 2 drafts
            ScheduledSeq("b", [5], 62, [9] * 16, True, p, 4),  # plain decode at the end of max_model_len
            ScheduledSeq("c", [3, 4], 30, [1] * 8, True, p, 0)]  # a prompt's final chunk
    assert g.can_run(SchedulerOutput(seqs)) and not g.can_run(SchedulerOutput(seqs[1:]))
    out, rows = g.run(SchedulerOutput(seqs))
    assert replayed == [4, 4] and rows == [0, 1, 2, 4, 9]
    t, n, h = 4 * 4, 4, g.host_np
    assert list(h[0:3]) == [7, 8, 9] and h[3] == 9  # padding repeats a real id
    assert list(h[t:t + 4]) == [10, 11, 12, 12] and list(h[t + 4:t + 8]) == [62, 62, 62, 62]  # positions < 64
    assert list(h[2 * t:2 * t + 4]) == [7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0, -1]  # slots of positions 10, 11, 12
    assert list(h[2 * t + 4:2 * t + 8]) == [9 * 4 + 2, -1, -1, -1]
    assert list(h[2 * t + 12:2 * t + 16]) == [-1] * 4  # the padding row writes nothing...
    assert list(h[3 * t:3 * t + n]) == [14, 66, 34, 4]  # ...and has no context (seq_len = q)


# ---- greedy verification from the (argmax, logprob) rows the verification graph computes ----
def _greedy_step(logits):
    """Sequences over logits' rows: drafts that all match, that fail at the first and at the third
    position, a plain decode, and one that asks for logprobs=0 (top-n empty, still plain greedy)."""
    from workers.scheduler_output import ScheduledSeq

    top = logits.argmax(-1).tolist()
    p, p0 = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)
    wrong = lambda t: (t + 1) % logits.shape[1]  # noqa: E731
    specs = [(p, top[0:3]), (p, [wrong(top[4])] + top[5:7]), (p, [top[8], top[9], wrong(top[10]), top[11]]),
             (p, []), (p0, [top[14]])]
    seqs, row = [], 0
    for i, (params, drafts) in enumerate(specs):
        seqs.append(ScheduledSeq(f"s{i}", [1] + drafts, 10, [0, 1, 2, 3], True, params, 3, spec_token_ids=drafts))
        row += len(drafts) + 1
    assert row == logits.shape[0]
    return seqs


def test_greedy_verification_from_packed_rows_equals_verify():
    """`verify_greedy` on `Sampler.greedy_pack` rows (what the graph's replay computes) emits what `verify`
    emits from the full logits: tokens, logprobs and top-n, also when the rows are spread over a padded
    layout as the graph's are."""
    from workers.sampler import Sampler
    from workers.spec_decode.verify import verify, verify_greedy

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 50, generator=g)
    seqs = _greedy_step(logits)
    want = verify(Sampler([0]), logits, seqs)
    got = verify_greedy(Sampler.greedy_pack(logits), list(range(16)), seqs)
    assert [[t.token_id for t in toks] for toks in got] == [[t.token_id for t in toks] for toks in want]
    assert [len(toks) for toks in got] == [4, 1, 3, 1, 2]  # all kept + bonus, first wrong, third wrong, plain, one
    for g_toks, w_toks in zip(got, want):
        for a, b in zip(g_toks, w_toks):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.top_logprobs == b.top_logprobs
    padded = torch.randn(48, 50, generator=g)  # the same rows at other places, garbage between them
    rows = [3 * i + 1 for i in range(16)]
    padded[rows] = logits
    again = verify_greedy(Sampler.greedy_pack(padded), rows, seqs)
    assert [[t.token_id for t in toks] for toks in again] == [[t.token_id for t in toks] for toks in got]
    with pytest.raises(ValueError, match="needs 16 rows"):
        verify_greedy(Sampler.greedy_pack(padded), rows + [0], seqs)


def test_graphed_verification_of_a_greedy_step_reads_only_the_packed_rows(plain):
    """The runner's verification-graph path (CUDA graphs replaced by a stand-in on CPU): an all-greedy step
    takes its tokens from the replay's (argmax, logprob) rows and never reads the logits; a step with a
    sampled sequence verifies from the logits. Both emit what the eager verification does."""
    from types import SimpleNamespace

    from workers.sampler import Sampler
    from workers.scheduler_output import SchedulerOutput

    runner = plain.llm_engine.executor.runner
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, runner.model.lm_head.weight.shape[0], generator=g)
    seqs = _greedy_step(logits)
    want = runner._verify_logits(logits, seqs, None)

    class Poisoned:  # the logits of the graph: reading them fails the test
        def __getitem__(self, rows):
            raise AssertionError("an all-greedy verification read the logits")

    stand_in = SimpleNamespace(can_run=lambda out: True, run=lambda out: ((Poisoned(), Sampler.greedy_pack(logits)),
                                                                         list(range(16))))
    saved, runner.verify_graphs = runner.verify_graphs, stand_in
    try:
        got = runner.execute(SchedulerOutput(seqs))
        assert {k: [t.token_id for t in v] for k, v in got.spec.items()} == \
               {k: [t.token_id for t in v] for k, v in want.spec.items()}
        assert set(got.spec) == {"s0", "s1", "s2", "s4"}
        assert {k: t.token_id for k, t in got.sampled.items()} == {k: t.token_id for k, t in want.sampled.items()}
        seqs[3].sampling_params = SamplingParams(temperature=0.7, seed=1)  # a sampled plain row: the logits path
        stand_in.run = lambda out: ((logits, Sampler.greedy_pack(logits)), list(range(16)))
        mixed = runner.execute(SchedulerOutput(seqs))
        assert {k: [t.token_id for t in v] for k, v in mixed.spec.items()} == \
               {k: [t.token_id for t in v] for k, v in want.spec.items()}
    finally:
        runner.verify_graphs = saved


def test_a_grammar_holds_in_steps_that_verify_other_sequences_drafts():
    """A constrained request never speculates, but shares steps with one that does: its row in those
    verification steps still takes the grammar's mask."""
    import re

    from workers.sampling_params import StructuredOutputs

    llm = make(str(Path(__file__).resolve().parents[1] / "models" / "tandem-tiny"), speculative_config=NGRAM)
    so = StructuredOutputs(kind="regex", spec=r"[a-c]{3}-\d{2}")
    outs = llm.generate([PROMPTS[0], "Hello", "def f(x):"],
                        [greedy(40), SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so),
                         SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=so)])
    for out in outs[1:]:
        assert out.finish_reason == "stop" and re.fullmatch(r"[a-c]{3}-\d{2}", out.text), out.text
    assert llm.get_metrics()["spec_decode_num_drafts"] >= 6  # drafts were verified while the grammars ran
    assert_engine_clean(llm)
