import pytest
import torch

from workers.sampler import Sampler
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ScheduledSeq

EOS = 7


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def device(request) -> str:
    return request.param


def make_seq(params: SamplingParams, num_output_tokens: int = 0, prompt=(), output=(), seq_id: str = "s") -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=seq_id,
        token_ids=[0],
        start_pos=0,
        block_table=[],
        sample=True,
        sampling_params=params,
        num_output_tokens=num_output_tokens,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
    )


def sample(logits: torch.Tensor, params_list, sampler: Sampler | None = None, device: str = "cpu", **seq_kwargs):
    sampler = sampler or Sampler([EOS], seed=0)
    return sampler(logits.to(device), [make_seq(p, **seq_kwargs) for p in params_list])


def token_ids(out) -> list[int]:
    return [t.token_id for t in out]


def draw_counts(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Token histogram of n unseeded draws from one row (batched as n identical rows)."""
    sampler = Sampler([EOS], seed=seed)
    out = sampler(logits_row.to(device).expand(n, -1), [make_seq(params)] * n)
    return torch.bincount(torch.tensor(token_ids(out)), minlength=logits_row.shape[-1])


# ---- greedy and logprobs ----


def test_greedy_is_argmax(device):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6, device=device)
    assert token_ids(out) == logits.argmax(-1).tolist()


def test_greedy_ties_pick_lowest_index(device):
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]])
    assert token_ids(sample(logits, [SamplingParams(temperature=0.0)], device=device)) == [1]


def test_low_precision_logits_are_accepted(device):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 3, device=device)
    ref = torch.log_softmax(logits.float(), -1)
    for i, t in enumerate(out):
        assert t.token_id == ref[i].argmax().item()
        assert t.logprob == pytest.approx(ref[i].max().item(), abs=1e-5)


def test_logprobs_come_from_raw_logits(device):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 50, generator=g) * 3
    params = SamplingParams(
        temperature=0.3, top_k=10, top_p=0.9, repetition_penalty=1.7, presence_penalty=1.0,
        frequency_penalty=0.5, logprobs=5,
    )
    out = sample(logits, [params, params], prompt=[1, 2, 3], output=[4, 4, 5], num_output_tokens=3, device=device)
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out):
        assert t.logprob == pytest.approx(ref[i, t.token_id].item(), abs=1e-5)
        vals, ids = ref[i].topk(5)
        assert [tid for tid, _ in t.top_logprobs] == ids.tolist()
        assert [lp for _, lp in t.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-5)


def test_top_logprobs_order_and_size(device):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, logprobs=n) for n in (None, 0, 1, 20)]
    out = sample(logits, params, device=device)
    assert out[0].top_logprobs is None
    assert out[1].top_logprobs == []
    assert out[1].logprob == pytest.approx(torch.log_softmax(logits[1], -1).max().item(), abs=1e-5)
    assert len(out[2].top_logprobs) == 1
    assert out[2].top_logprobs[0][0] == out[2].token_id
    top = out[3].top_logprobs
    assert len(top) == 20
    lps = [lp for _, lp in top]
    assert lps == sorted(lps, reverse=True)
    assert [tid for tid, _ in top] == logits[3].topk(20).indices.tolist()


# ---- truncation ----


def test_top_k_1_equals_greedy(device):
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(4))
    for seed in range(5):
        out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8, sampler=Sampler([EOS], seed=seed), device=device)
        assert token_ids(out) == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy(device):
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(5))
    for seed in range(5):
        out = sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8, sampler=Sampler([EOS], seed=seed), device=device)
        assert token_ids(out) == logits.argmax(-1).tolist()


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 + 0.3 >= 0.7, 0.5 alone is not
        (SamplingParams(top_p=0.81), {0, 1, 2}),
        (SamplingParams(min_p=0.4), {0, 1}),  # keeps p >= 0.4 * 0.5
        (SamplingParams(min_p=0.2), {0, 1, 2}),
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}),  # top-p on the renormalised top-3
    ],
)
def test_truncation_keeps_exactly_the_expected_tokens(params, allowed, device):
    counts = draw_counts(PROBS.log(), params, n=2000, device=device)
    assert {i for i, c in enumerate(counts.tolist()) if c > 0} == allowed


def test_mixed_truncation_in_one_batch(device):
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.5)] * 300  # interleaved rows
    logits = PROBS.log().to(device).expand(len(params), -1)
    out = Sampler([EOS], seed=0)(logits, [make_seq(p) for p in params])
    seen = [{t.token_id for t in out[i::3]} for i in range(3)]
    assert seen == [{0}, {0, 1, 2, 3}, {0}]


# ---- penalties and min_tokens ----


LARGE_VOCAB_PARAMS = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=40), SamplingParams(top_k=3000, top_p=0.97),
                      SamplingParams(top_k=100), SamplingParams(), SamplingParams(top_p=0.99), SamplingParams(top_p=0.2)]


def _kept(x: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in x]


def test_top_p_without_full_sort_keeps_the_sorted_set(device, monkeypatch):
    """Over a 32k vocabulary the top-k/top-p cut works on the best 1,024 (or k) logits and keeps exactly the
    tokens the full sort keeps; a flat row whose top-p set reaches past them falls back to the sort."""
    import workers.sampler as sampler_mod

    torch.manual_seed(0)
    logits = (torch.randn(21, 32000) * 6).to(device)  # peaked: 1,024 logits hold >= 99.7% of the mass
    params = LARGE_VOCAB_PARAMS * 3
    want = sampler_mod._top_k_top_p_sorted(logits.clone(), params)
    sorted_calls = []
    real_sorted = sampler_mod._top_k_top_p_sorted
    monkeypatch.setattr(sampler_mod, "_top_k_top_p_sorted", lambda *a: sorted_calls.append(1) or real_sorted(*a))
    got = sampler_mod._top_k_top_p(logits.clone(), params)
    assert not sorted_calls  # the partial selection held every row's answer
    assert _kept(got) == _kept(want)
    assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])
    assert len(_kept(got)[4]) == 32000  # no top-k, no top-p: every token stays
    all_top_k = [SamplingParams(top_k=40, top_p=0.5), SamplingParams(top_k=3000, top_p=0.97), SamplingParams(top_k=7)] * 6
    got = sampler_mod._top_k_top_p(logits[:18].clone(), all_top_k)  # no row can reach past the candidates
    assert not sorted_calls and _kept(got) == _kept(real_sorted(logits[:18].clone(), all_top_k))

    flat = torch.randn(2, 32000, device=device) * 0.01  # 1,024 logits hold ~3% of the mass
    got = sampler_mod._top_k_top_p(flat.clone(), [SamplingParams(top_p=0.9), SamplingParams(top_k=50)])
    assert sorted_calls
    assert _kept(got) == _kept(real_sorted(flat.clone(), [SamplingParams(top_p=0.9), SamplingParams(top_k=50)]))
    assert abs(len(_kept(got)[0]) - 0.9 * 32000) < 400


def test_penalties_match_hand_computation(device):
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, 1.0], [2.0, -1.0, 3.0, 0.5, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    seqs = [make_seq(p, prompt=[0, 1], output=[2, 2, 3]), make_seq(SamplingParams())]
    x = logits.to(device)
    Sampler._apply_penalties(x, seqs)
    x = x.cpu()
    # repetition over {0,1,2,3}: 2/2, -1*2, 3/2, 0.5/2; then output counts {2: 2, 3: 1}:
    # token 2: 1.5 - 2*0.5 - 0.25, token 3: 0.25 - 1*0.5 - 0.25
    expected = torch.tensor([1.0, -2.0, 0.25, -0.5, 1.0])
    torch.testing.assert_close(x[0], expected)
    torch.testing.assert_close(x[1], logits[1])  # rows without penalties are untouched


def test_presence_and_frequency_skip_prompt_tokens(device):
    x = torch.zeros(1, 4, device=device)
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    Sampler._apply_penalties(x, [make_seq(p, prompt=[0, 1], output=[1, 3, 3, 3])])
    torch.testing.assert_close(x[0].cpu(), torch.tensor([0.0, -2.0, 0.0, -4.0]))


def test_penalty_changes_greedy_choice(device):
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert token_ids(sample(logits, [p], prompt=[0], device=device)) == [1]  # 3/2 < 2
    assert token_ids(sample(logits, [p], prompt=[2], device=device)) == [0]


def test_min_tokens_masks_eos_and_stop_token_ids(device):
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 3], logits[0, 5] = 10.0, 9.0, 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], max_tokens=10)
    assert token_ids(sample(logits, [p], num_output_tokens=0, device=device)) == [5]
    assert token_ids(sample(logits, [p], num_output_tokens=1, device=device)) == [5]
    assert token_ids(sample(logits, [p], num_output_tokens=2, device=device)) == [EOS]
    p_ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    assert token_ids(sample(logits, [p_ignore], num_output_tokens=0, device=device)) == [EOS]
    # the logprob still reports the raw distribution
    out = sample(logits, [p], num_output_tokens=0, device=device)[0]
    assert out.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[5].item(), abs=1e-6)


def test_min_tokens_with_sampling_never_draws_eos(device):
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 2.0
    p = SamplingParams(min_tokens=5, stop_token_ids=[1], max_tokens=10)
    counts = draw_counts(logits[0], p, n=500, device=device)
    assert counts[EOS] == 0 and counts[1] == 0
    out_of_vocab = SamplingParams(min_tokens=5, stop_token_ids=[10_000], max_tokens=10)
    sample(logits, [out_of_vocab], device=device)  # ignored, not an index error


# ---- seeds and distribution ----


def test_seeded_row_is_independent_of_batch(device):
    g = torch.Generator().manual_seed(6)
    vocab = 1000
    target = torch.randn(vocab, generator=g).to(device)
    others = torch.randn(4, vocab, generator=g).to(device)
    seeded = [SamplingParams(seed=s, temperature=1.0) for s in range(20)]
    unseeded, other_seed = SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, seed=99, top_k=5)
    for p in seeded:
        alone = Sampler([EOS], seed=0)(target[None], [make_seq(p, num_output_tokens=3)])
        batch = torch.stack([others[0], others[1], target, others[2]])
        mixed = Sampler([EOS], seed=1)(
            batch,
            [make_seq(unseeded), make_seq(other_seed), make_seq(p, num_output_tokens=3), make_seq(unseeded)],
        )
        assert mixed[2].token_id == alone[0].token_id
    # and the seed matters: 20 seeds over a flat-ish distribution don't all agree
    tokens = {Sampler([EOS])(target[None], [make_seq(p, num_output_tokens=3)])[0].token_id for p in seeded}
    assert len(tokens) > 5


def test_seeded_stream_varies_with_step(device):
    logits = torch.zeros(1, 50, device=device)
    p = SamplingParams(seed=1234)
    tokens = [Sampler([EOS])(logits, [make_seq(p, num_output_tokens=n)])[0].token_id for n in range(30)]
    assert len(set(tokens)) > 10
    # reproducible
    again = [Sampler([EOS])(logits, [make_seq(p, num_output_tokens=n)])[0].token_id for n in range(30)]
    assert tokens == again


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_unseeded_sampling_follows_distribution(temperature, device):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    n = 20_000
    counts = draw_counts(logits, SamplingParams(temperature=temperature), n=n, seed=7, device=device).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001
    assert chi2 < 24.3, (counts, expected)


def test_empty_batch():
    assert Sampler([EOS])(torch.empty(0, 10), []) == []


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, 10), [make_seq(SamplingParams())])
