"""Engine behaviour through the offline API: seeded sampling, stop conditions, aborts, priorities and
argument validation. Every engine a test builds must end clean: no request left, no KV block owned."""
import json
import shutil

import pytest

from tests.models import assert_engine_clean, hf_greedy, prompts_of_lengths, tiny_model
from tandem import LLM, SamplingParams
from engine.sequence import SeqStatus

VOCAB = 300


@pytest.fixture
def make_llm():
    made = []

    def make(path=None, **kw):
        kw = {"dtype": "float32", "device": "cpu", "show_progress": False, "block_size": 4, **kw}
        llm = LLM(model=path or tiny_model("llama"), **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_engine_clean(llm)


@pytest.fixture(scope="module")
def llm():
    """One shared engine for the tests that only read outputs (checked clean after each use)."""
    return LLM(model=tiny_model("llama"), dtype="float32", device="cpu", show_progress=False, block_size=4)


@pytest.fixture
def shared(llm):
    yield llm
    assert_engine_clean(llm)


def greedy(n=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **{"ignore_eos": True, **kw})


def first_new_token_index(tokens: list[int], start: int = 2) -> int:
    """An index j >= start whose token does not occur before it."""
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


def with_extra_eos(src: str, dst, eos_id: int) -> str:
    """Copy of a model folder whose generation_config lists `eos_id` as an EOS token too."""
    path = shutil.copytree(src, dst)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], eos_id]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


# ---- seeded sampling ----

SAMPLED = [
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=1.0, top_k=20, seed=12, max_tokens=12, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.8, seed=13, max_tokens=12, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=1.0, seed=14, max_tokens=12, ignore_eos=True, logprobs=0),
]


def test_seeded_sampling_is_reproducible_across_batches_and_orders(make_llm):
    path = tiny_model("qwen3")
    prompts = prompts_of_lengths([3, 8, 13, 5], VOCAB, seed=5)
    llm = make_llm(path)
    together = llm.generate(prompts, SAMPLED)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, SAMPLED)]
    backwards = llm.generate(prompts[::-1], SAMPLED[::-1])[::-1]
    # Other engine settings and other requests in the batch: unseeded sampling and greedy.
    other = make_llm(path, block_size=8, max_num_batched_tokens=6, enable_prefix_caching=False, max_num_seqs=3)
    extra = prompts_of_lengths([4, 9], VOCAB, seed=6)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = other.generate([extra[0], prompts[0], prompts[1], extra[1], prompts[2], prompts[3]],
                           [unseeded, SAMPLED[0], SAMPLED[1], greedy(), SAMPLED[2], SAMPLED[3]])
    mixed = [mixed[1], mixed[2], mixed[4], mixed[5]]
    for run in (alone, backwards, mixed):
        assert [o.token_ids for o in run] == [o.token_ids for o in together]
        for a, b in zip(run, together):
            assert all(abs(x[t] - y[t]) < 1e-4 for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
    # It is sampling: not the greedy tokens, and another seed gives other tokens.
    greedy_out = llm.generate(prompts, greedy())
    assert [o.token_ids for o in greedy_out] != [o.token_ids for o in together]
    reseeded = llm.generate(prompts, [sp.model_copy(update={"seed": sp.seed + 100}) for sp in SAMPLED])
    assert [o.token_ids for o in reseeded] != [o.token_ids for o in together]


def test_seeded_sampling_survives_preemption(make_llm):
    path = tiny_model("qwen3")
    prompts = prompts_of_lengths([3, 8, 13, 5], VOCAB, seed=5)
    roomy = make_llm(path).generate(prompts, SAMPLED)
    tight = make_llm(path, num_gpu_blocks_override=9, max_num_batched_tokens=5)  # 36 tokens of KV for 4 x up to 25
    outs = tight.generate(prompts, SAMPLED)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_sampling_respects_top_k_one_and_tiny_top_p(shared):
    prompts = prompts_of_lengths([4, 9], VOCAB, seed=2)
    ref = shared.generate(prompts, greedy())
    top1 = shared.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True))
    tiny_p = shared.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in top1] == [o.token_ids for o in ref]
    assert [o.token_ids for o in tiny_p] == [o.token_ids for o in ref]


# ---- stop conditions ----


def test_max_tokens_finishes_with_length(shared):
    outs = shared.generate(prompts_of_lengths([1, 6, 10], VOCAB, seed=4), greedy(7))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 7 and o.stop_reason is None for o in outs)


def test_stop_token_ids(shared):
    prompt = prompts_of_lengths([6], VOCAB, seed=30)[0]
    full = shared.generate([prompt], greedy(16))[0]
    j = first_new_token_index(full.token_ids)
    stop_tok = full.token_ids[j]
    before = shared.generate([prompt], greedy(j))[0]  # the text of the tokens before the stop token
    upto = shared.generate([prompt], greedy(j + 1))[0]

    out = shared.generate([prompt], greedy(16, stop_token_ids=[stop_tok, 299 if stop_tok != 299 else 298]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == full.token_ids[: j + 1]  # the stop token is in token_ids
    assert out.text == before.text  # but not in the text
    inc = shared.generate([prompt], greedy(16, stop_token_ids=[stop_tok], include_stop_str_in_output=True))[0]
    assert inc.token_ids == full.token_ids[: j + 1] and inc.text == upto.text

    # min_tokens: the stop token cannot end the output before min_tokens tokens.
    late = shared.generate([prompt], greedy(16, stop_token_ids=[stop_tok], min_tokens=j + 2))[0]
    assert len(late.token_ids) >= j + 2
    assert stop_tok not in late.token_ids[: j + 2]
    assert late.token_ids[:j] == full.token_ids[:j]
    if late.finish_reason == "stop":
        assert late.token_ids[-1] == stop_tok


def _stop_candidates(text: str, start: int) -> list[str]:
    """2-char substrings of `text` first occurring at or after `start`, without replacement characters
    (random tiny models emit random bytes, so the text is mostly not printable)."""
    out = []
    for i in range(start, len(text) - 1):
        s = text[i : i + 2]
        if "\ufffd" not in s and text.index(s) == i and s not in out:
            out.append(s)
    return out


def test_stop_strings_truncate_text(shared):
    prompts = ["The quick brown fox", "Paged attention keeps", "Hello world!"]
    fulls = shared.generate(prompts, greedy(24))
    checked = 0
    for prompt, full in zip(prompts, fulls):
        candidates = _stop_candidates(full.text, 4)
        if not candidates:
            continue
        stop = candidates[0]
        cut = full.text.index(stop)
        out = shared.generate([prompt], greedy(24, stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full.text[:cut]
        assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
        inc = shared.generate([prompt], greedy(24, stop=[stop], include_stop_str_in_output=True))[0]
        assert inc.text == full.text[: cut + len(stop)] and inc.token_ids == out.token_ids
        # Several stop strings: the one that appears first in the text wins.
        later = [c for c in candidates if full.text.index(c) > cut + len(stop)]
        if later:
            both = shared.generate([prompt], greedy(24, stop=[later[-1], stop]))[0]
            assert both.stop_reason == stop and both.text == out.text
        checked += 1
    assert checked >= 2


def test_streamed_text_never_leaks_a_stop_string(make_llm):
    llm = make_llm()
    full = llm.generate(["Once upon a time"], greedy(24))[0]
    stop = _stop_candidates(full.text, 6)[0]
    e = llm.llm_engine
    e.add_request("s", "Once upon a time", greedy(24, stop=[stop]))
    streamed, last = "", None
    while e.has_unfinished_requests():
        for out in e.step():
            streamed += out.new_text
            assert stop not in streamed
            last = out
    assert last.finished and streamed == last.text == full.text[: full.text.index(stop)]


def test_eos_stops_unless_ignore_eos_and_min_tokens_delays_it(make_llm, tmp_path):
    src = tiny_model("llama")
    prompt = prompts_of_lengths([7], VOCAB, seed=40)[0]
    free = hf_greedy(src, prompt, 16)[0]
    j = first_new_token_index(free)
    path = with_extra_eos(src, tmp_path / "eos-model", free[j])
    llm = make_llm(path)
    assert free[j] in llm.llm_engine.eos_token_ids

    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids == free[: j + 1]
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == free
    delayed = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=j + 3))[0]
    assert len(delayed.token_ids) >= j + 3 and free[j] not in delayed.token_ids[: j + 3]
    assert delayed.token_ids[:j] == free[:j]
    # With ignore_eos, min_tokens does not ban EOS (vLLM semantics): the free run again.
    both = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=j + 3, ignore_eos=True))[0]
    assert both.token_ids == free


def test_min_tokens_with_stop_string(shared):
    full = shared.generate(["Hello world!"], greedy(24))[0]
    stop = _stop_candidates(full.text, 2)[0]
    early = shared.generate(["Hello world!"], greedy(24, stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 20
    out = shared.generate(["Hello world!"], greedy(24, stop=[stop], min_tokens=20))[0]
    assert len(out.token_ids) >= 20 and out.token_ids[:20] == full.token_ids[:20]
    assert out.text.startswith(full.text[: full.text.index(stop) + len(stop)])  # the early match did not stop it


# ---- aborts ----


def test_abort_mid_prefill_mid_decode_and_waiting_frees_every_block(make_llm):
    llm = make_llm(block_size=4, max_num_batched_tokens=6, enable_prefix_caching=True, max_num_seqs=4)
    e = llm.llm_engine
    system = prompts_of_lengths([8], VOCAB, seed=50)[0]
    prompts = [system + t for t in prompts_of_lengths([9, 13, 2, 6, 11, 5], VOCAB, seed=51)]
    sp = greedy(10)
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, sp)
    aborted: dict[str, str] = {}
    finished: dict[str, list[int]] = {}
    for _ in range(500):
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        seqs = list(e.scheduler.seqs.values())
        running = [s for s in seqs if s.status == SeqStatus.RUNNING]
        if "prefill" not in aborted:
            mid = [s for s in running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
            if mid:
                aborted["prefill"] = mid[0].seq_id
        if "decode" not in aborted:
            mid = [s for s in running if s.num_output_tokens >= 2 and s.seq_id not in aborted.values()]
            if mid:
                aborted["decode"] = mid[-1].seq_id
        if "waiting" not in aborted:
            waiting = [s for s in seqs if s.status == SeqStatus.WAITING]
            if waiting:
                aborted["waiting"] = waiting[-1].seq_id
        for kind, rid in aborted.items():
            if rid in e.requests:
                out = e.abort(rid)
                assert out.finish_reason == "abort" and out.request_id == rid
                assert e.abort(rid) is None  # twice is a no-op
                e.block_manager.check_invariants()
    assert set(aborted) == {"prefill", "decode", "waiting"}
    assert len(set(aborted.values())) == 3
    assert not set(aborted.values()) & set(finished)
    assert len(finished) == len(prompts) - 3
    # The survivors are unaffected by the aborts (and by the blocks they shared with aborted ones).
    ref = make_llm(block_size=4).generate([prompts[int(r[1:])] for r in finished], sp)
    assert list(finished.values()) == [o.token_ids for o in ref]


def test_abort_everything_while_running(make_llm):
    llm = make_llm(max_num_batched_tokens=8, num_gpu_blocks_override=12)
    e = llm.llm_engine
    for i, p in enumerate(prompts_of_lengths([5, 12, 3, 9], VOCAB, seed=52)):
        e.add_request(f"x{i}", p, greedy(20))
    for _ in range(4):
        e.step()
    assert e.block_manager.num_used_blocks > 0
    for rid in list(e.requests):
        e.abort(rid)
    assert e.step() == []
    # The engine still works afterwards.
    out = llm.generate(prompts_of_lengths([5], VOCAB, seed=52), greedy(4))[0]
    assert len(out.token_ids) == 4


def test_sequence_longer_than_the_kv_cache_finishes_instead_of_hanging(make_llm):
    """Regression: with max_model_len beyond the cache, a lone sequence that outgrew the cache preempted
    itself and then waited forever (LLM.generate spun). max_model_len is now capped at the cache size."""
    llm = make_llm(num_gpu_blocks_override=4, block_size=4)
    e = llm.llm_engine
    assert e.max_model_len == 16
    e.add_request("long", prompts_of_lengths([10], VOCAB, seed=53)[0], greedy(20))
    out = None
    for _ in range(50):  # step by hand: a regression must fail, not hang the suite
        for o in e.step():
            out = o
        if not e.has_unfinished_requests():
            break
    assert out is not None and out.finish_reason == "length" and len(out.token_ids) == 6
    assert e.scheduler.num_preemptions == 0


def test_start_up_logs_the_cache_size_and_the_longest_prompt(make_llm, caplog):
    """At start the engine says how long a prompt may be and how many full-length requests fit (issue 25
    item 5), and the line is true: a prompt of exactly that length runs, one token more is refused."""
    from engine.llm_engine import capacity_line

    with caplog.at_level("INFO", logger="engine.llm_engine"):
        llm = make_llm(num_gpu_blocks_override=8, block_size=4, max_model_len=24)
    line = capacity_line(8, 4, 1, 24)
    assert line in caplog.text
    assert "32 tokens" in line and "longest prompt 23 tokens" in line and "1.33x" in line
    assert "over 2 sequence-parallel ranks (8 blocks each)" in capacity_line(16, 4, 2, 24)
    e = llm.llm_engine
    longest = prompts_of_lengths([24], VOCAB, seed=3)[0]
    assert len(llm.generate([longest[:23]], greedy(1))[0].token_ids) == 1
    with pytest.raises(ValueError, match="max_model_len=24"):
        e.add_request("too-long", longest, greedy(1))


# ---- priority ----


def test_priority_with_one_slot_serves_lower_value_first(make_llm):
    llm = make_llm(max_num_seqs=1)
    e = llm.llm_engine
    prompts = prompts_of_lengths([5, 6, 7, 8], VOCAB, seed=60)
    e.add_request("early-low", prompts[0], greedy(3), priority=2)
    e.add_request("early-mid", prompts[1], greedy(3), priority=1)
    e.add_request("late-high", prompts[2], greedy(3), priority=0)
    e.add_request("later-mid", prompts[3], greedy(3), priority=1)
    order, first_tokens = [], []
    while e.has_unfinished_requests():
        outs = e.step()
        assert len(outs) <= 1
        for out in outs:
            if len(out.token_ids) == 1:
                first_tokens.append(out.request_id)
            if out.finished:
                order.append(out.request_id)
    assert order == first_tokens == ["late-high", "early-mid", "later-mid", "early-low"]


def test_generate_accepts_priorities(make_llm):
    llm = make_llm(max_num_seqs=1)
    prompts = prompts_of_lengths([5, 6, 7], VOCAB, seed=61)
    outs = llm.generate(prompts, greedy(3), priority=[3, 1, 2])
    assert [o.prompt_token_ids for o in outs] == prompts  # results stay in input order


# ---- argument validation ----


def test_bad_engine_arguments(tmp_path):
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path / "missing"), device="cpu")
    with pytest.raises(ValueError, match="unknown engine argument 'no_such_option'"):
        LLM(model=path, device="cpu", no_such_option=1)
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=path, device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=path, device="cpu", block_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=path, device="cpu", max_model_len=10_000)  # beyond the model's positions
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=path, device="cpu", num_gpu_blocks_override=2, block_size=4, max_model_len=64)  # beyond the KV cache


def test_bad_sampling_params():
    for bad in [dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5),
                dict(min_tokens=5, max_tokens=2), dict(stop=[""]), dict(logprobs=-1), dict(no_such_param=1)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_bad_prompts_raise_and_leave_the_engine_clean(make_llm):
    llm = make_llm(max_model_len=16)
    ok = prompts_of_lengths([4], VOCAB, seed=70)[0]
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(2))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([ok + [VOCAB]], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[-1, 5]], greedy(2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 19))], greedy(2))  # 16 tokens: no room for output
    with pytest.raises(ValueError, match="list of token ids"):
        llm.generate([[1.5, 2]], greedy(2))
    with pytest.raises(ValueError, match="sampling params for"):
        llm.generate([ok, ok], [greedy(2)])
    # A bad prompt after good ones in the same call: the good ones are withdrawn, nothing leaks.
    with pytest.raises(ValueError, match="empty"):
        llm.generate([ok, ok, []], greedy(2))
    assert_engine_clean(llm)
    # The longest valid prompt runs, and stops at max_model_len.
    out = llm.generate([list(range(3, 18))], greedy(8))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    e = llm.llm_engine
    e.add_request("dup", ok, greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("dup", ok, greedy(2))
    e.abort("dup")


def test_logprobs_off_by_default_and_top_n_when_asked(shared):
    prompt = prompts_of_lengths([5], VOCAB, seed=80)[0]
    plain = shared.generate([prompt], greedy(4))[0]
    assert plain.logprobs is None
    top = shared.generate([prompt], greedy(4, logprobs=5))[0]
    assert len(top.logprobs) == 4
    for entry, tok in zip(top.logprobs, top.token_ids):
        assert tok in entry and 5 <= len(entry) <= 6
        assert entry[tok] == max(entry.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in entry.values())


def test_mixed_steps_put_decodes_first_and_still_match_hf(make_llm):
    """A high-priority prompt that prefills in chunks while another request decodes: the scheduler
    lists it first, the runner must hand attention the decode rows first (`num_decodes` of them),
    and the tokens must still be HF's."""
    llm = make_llm(max_num_batched_tokens=16)
    runner = llm.llm_engine.executor.runner
    seen = []
    forward = runner.backend.forward

    def recording(q, k, v, kv_cache, meta, scale):
        if len(seen) < 10_000:
            seen.append((list(meta.query_lens_cpu), meta.num_decodes))
        return forward(q, k, v, kv_cache, meta, scale)

    runner.backend.forward = recording
    for layer in runner.attn_layers:
        layer.backend = runner.backend
    path = tiny_model("llama")
    short, long = prompts_of_lengths([5, 60], VOCAB, seed=3)
    eng = llm.llm_engine
    eng.add_request("short", short, greedy(20))
    eng.step()  # the short prompt is prefilled and decodes from now on
    eng.add_request("long", long, greedy(4), priority=-1)  # scheduled before "short" while it prefills
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    mixed = [(q, d) for q, d in seen if 1 in q and any(n > 1 for n in q)]
    assert mixed, "no step mixed a prefill chunk with a decode"
    for q_lens, d in seen:
        assert all(n == 1 for n in q_lens[:d]) and all(n > 1 for n in q_lens[d:]), (q_lens, d)
    assert all(d >= 1 for _, d in mixed)
    assert outs["short"] == hf_greedy(path, short, 20)[0]
    assert outs["long"] == hf_greedy(path, long, 4)[0]


def test_async_stream_coalesces_outputs_a_slow_consumer_missed(shared):
    """Tokens that queue while the consumer is busy go out as one item with all their deltas, never lost
    or repeated; the first item is always alone."""
    import asyncio

    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(shared.llm_engine)
    (prompt,) = prompts_of_lengths([9], VOCAB, seed=21)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def consume() -> list:
        items = []
        async for out in engine.generate("coalesce-1", prompt, params):
            items.append((list(out.new_token_ids), out.new_text, list(out.token_ids), out.text, out.finish_reason))
            await asyncio.sleep(0.05)  # slower than the engine's steps
        return items

    items = asyncio.run(consume())
    asyncio.run(engine.close())
    tokens, text = items[-1][2], items[-1][3]
    assert len(tokens) == 24 and items[-1][4] == "length"
    assert [t for it in items for t in it[0]] == tokens and "".join(it[1] for it in items) == text
    assert len(items[0][0]) == 1 and len(items) < 24  # merged after the first
    assert tokens == hf_greedy(shared.llm_engine.config.model.model, prompt, 24)[0]


def test_a_paced_stream_sends_fewer_items_with_every_token_and_the_first_and_last_at_once(shared):
    """Under a replica's item budget (`StreamPace`) a fast consumer still gets fewer items than tokens: each
    carries the steps made during its gap, with every delta once and in order; the first item is alone and
    the finished one is not held. Unpaced, the same request streams one item per token."""
    import asyncio
    import time

    from engine.async_engine import AsyncEngine, StreamPace

    (prompt,) = prompts_of_lengths([9], VOCAB, seed=22)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(pace: StreamPace | None) -> tuple[list, list[float]]:
        engine = AsyncEngine(shared.llm_engine, stream_pace=pace)

        async def consume() -> tuple[list, list[float]]:
            items, times = [], []
            async for out in engine.generate(f"paced-{pace is not None}", prompt, params):
                items.append((list(out.new_token_ids), out.new_text, list(out.token_ids), out.text, out.finish_reason))
                times.append(time.monotonic())
            return items, times

        try:
            return asyncio.run(consume())
        finally:
            asyncio.run(engine.close())

    pace = StreamPace(items_per_s=20.0)  # one stream: an item every 50 ms at most
    paced, times = run(pace)
    plain, _ = run(None)
    assert pace.open_streams == 0  # the stream left the budget when it ended
    tokens = paced[-1][2]
    assert tokens == plain[-1][2] == hf_greedy(shared.llm_engine.config.model.model, prompt, 24)[0]
    assert [t for it in paced for t in it[0]] == tokens and "".join(it[1] for it in paced) == paced[-1][3]
    assert len(paced[0][0]) == 1 and paced[-1][4] == "length"
    assert len(paced) < len(plain) == 24
    gaps = [b - a for a, b in zip(times[1:-1], times[2:-1])]  # between held items (not the first, not the last)
    assert all(g >= 0.045 for g in gaps), gaps


def test_merged_outputs_keep_the_stamps_of_the_earlier_when_the_later_has_none():
    """Stamps ride on tokens 1 and 2 and the last output only: a paced item that merges token 2's output with token
    3's keeps token 2's stamps; a later output's own stamps win."""
    from engine.async_engine import _merged
    from engine.llm_engine import RequestOutput

    two = RequestOutput("r", [1], token_ids=[5, 6], new_token_ids=[6], new_text="b", timeline={"first_decode_step": 1.0})
    three = RequestOutput("r", [1], token_ids=[5, 6, 7], new_token_ids=[7], new_text="c")
    merged = _merged(two, three)
    assert merged.timeline == {"first_decode_step": 1.0} and merged.new_token_ids == [6, 7] and merged.new_text == "bc"
    last = RequestOutput("r", [1], token_ids=[5, 6, 7], new_token_ids=[7], finish_reason="length", timeline={"end": 2.0})
    assert _merged(two, last).timeline == {"end": 2.0}


def test_a_stream_pace_needs_a_positive_budget():
    from engine.async_engine import StreamPace

    with pytest.raises(ValueError, match="items_per_s"):
        StreamPace(0)


def test_async_engine_used_from_a_second_event_loop_while_the_first_lives(shared):
    """One engine, requests from two event loops that both stay alive (two TestClients: a module-scoped
    client fixture and a test's own, as in tests/test_hardening.py, where a CI run hung once): every request
    completes, from either loop, with the same tokens. A guard for `_StreamQueue` and the superseded step
    task; this test did not reproduce that hang on the old code in one run (it is timing-dependent)."""
    import asyncio
    import threading

    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(shared.llm_engine, lease_check_interval_s=0.005)  # the old loop's task wakes often
    (prompt,) = prompts_of_lengths([9], VOCAB, seed=23)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = asyncio.new_event_loop()
    thread = threading.Thread(target=first.run_forever, daemon=True)
    thread.start()

    async def one(rid: str) -> list[int]:
        out = None
        async for out in engine.generate(rid, prompt, params):
            pass
        return list(out.token_ids)

    try:
        want = asyncio.run_coroutine_threadsafe(one("loop-a"), first).result(60)
        for i in range(3):  # a new loop each time, the first one still running
            assert asyncio.run(asyncio.wait_for(one(f"loop-b{i}"), 30)) == want
        assert asyncio.run_coroutine_threadsafe(one("loop-a2"), first).result(60) == want
    finally:
        asyncio.run_coroutine_threadsafe(engine.close(), first).result(10)
        first.call_soon_threadsafe(first.stop)
        thread.join(10)


def test_vllm_prompt_dicts_are_prompts_and_bad_ones_are_refused(shared):
    """vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts, alone or in a list, run as their content
    (a dict used to be iterated into its keys and generated from the key's text)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = shared.generate("def area(r):", params)[0]
    outs = shared.generate([{"prompt": "def area(r):"}, {"prompt_token_ids": ref.prompt_token_ids}], params)
    assert [o.token_ids for o in outs] == [ref.token_ids] * 2
    assert shared.generate({"prompt": "def area(r):"}, params)[0].token_ids == ref.token_ids
    for bad in ({"text": "x"}, {"prompt": "x", "prompt_token_ids": [1]}):
        with pytest.raises(ValueError, match="exactly one of 'prompt' and 'prompt_token_ids'"):
            shared.generate(bad, params)
