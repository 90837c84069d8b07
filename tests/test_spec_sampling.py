"""Speculative sampling keeps the target's distribution (issue 16).

Two levels, each also run with a wrong sampler that, on rejection, resamples from p instead of the
residual norm(max(0, p - q)): the tests must tell it apart (else they could not fail).
* the verifier alone, on fixed target and draft distributions: the emitted token's frequencies against
  p itself (chi-square goodness of fit);
* the whole engine with a draft close to but different from the target: many seeded samples of a short
  continuation, speculative against plain, compared position by position (chi-square two-sample test).
Everything is seeded, so the verdicts are deterministic, not flaky.
"""
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models import tiny_model
from tests.test_spec_decode import perturbed_copy
from tandem import LLM, SamplingParams
from workers.sampler import Sampler
from workers.sampling_params import SamplingParams as SP
from workers.scheduler_output import ScheduledSeq
from workers.spec_decode import verify as verify_mod

ALPHA = 1e-3  # the correct sampler must pass at this level; the wrong one must fail it by far


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]]).double()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chi2_sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1)


def two_sample(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples of token ids come from one distribution (rare ids pooled)."""
    ids = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(t) for t in ids], dtype=torch.float64)
    cb = torch.tensor([b.count(t) for t in ids], dtype=torch.float64)
    common = (ca + cb) >= 20
    ca = torch.cat([ca[common], ca[~common].sum()[None]])
    cb = torch.cat([cb[common], cb[~common].sum()[None]])
    if ca[-1] + cb[-1] == 0:
        ca, cb = ca[:-1], cb[:-1]
    table = torch.stack([ca, cb])  # [2, bins]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return chi2_sf(stat, table.shape[1] - 1)


def wrong_residual(p, q):
    return p  # the classic mistake: ignores what the draft already covered


# ---- the verifier alone ----
V = 12


def _verify_first_tokens(spec_probs: bool, n: int = 20000) -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(2, V, generator=g) * 1.5  # row 0 verifies the draft, row 1 gives the bonus
    p = target_logits[0].softmax(-1)
    q = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist() if spec_probs else [int(p.argmax())] * n
    params = SP(temperature=1.0, max_tokens=8)
    seqs = [ScheduledSeq(f"s{i}", [1, d], 10, [0], True, params, 3, spec_token_ids=[d],
                         spec_probs=q[None] if spec_probs else None) for i, d in enumerate(drafts)]
    out = verify_mod.verify(Sampler([0], seed=1), target_logits.repeat(n, 1), seqs)
    first = torch.tensor([toks[0].token_id for toks in out])
    accepted = sum(len(toks) == 2 for toks in out) / n
    return torch.bincount(first, minlength=V).double(), p, accepted


@pytest.mark.parametrize("draft_probs", [True, False], ids=["draft-model-q", "one-hot-q"])
def test_verifier_emits_the_target_distribution(draft_probs, monkeypatch):
    counts, p, accepted = _verify_first_tokens(draft_probs)
    assert goodness_of_fit(counts, p) > ALPHA
    assert 0.05 < accepted < 0.95  # rejections happen, so the residual matters
    monkeypatch.setattr(verify_mod, "residual", wrong_residual)
    counts, p, _ = _verify_first_tokens(draft_probs)
    assert goodness_of_fit(counts, p) < 1e-6


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    counts, p, accepted = _verify_first_tokens(True)
    g = torch.Generator().manual_seed(0)
    torch.randn(2, V, generator=g)
    q = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    overlap = float(torch.minimum(p, q).sum())  # P(accept) = sum_x min(p(x), q(x))
    assert abs(accepted - overlap) < 0.015


# ---- the engine: speculative vs plain ----
N = 1500
PROMPT = "Once upon a time there was"
TEMPERATURE = 0.4  # a peaked target: the wrong sampler's bias lands on a few well-populated tokens


def sharper_draft(target: str, dst) -> str:
    """A draft close to the target but different: its weights perturbed a little, and its logits 1.6x
    sharper (the final norm scaled), so it over-proposes the target's favourite tokens: p != q both ways."""
    path = perturbed_copy(target, dst, 0.1, seed=3)
    weights = load_file(f"{path}/model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.6
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


def seed_sampler(llm: LLM, seed: int) -> None:
    """Unseeded requests draw from the runner's shared generator: seed it, so the test is deterministic."""
    runner = llm.llm_engine.executor.runner
    runner.sampler = Sampler(runner.sampler.eos_token_ids, seed=seed)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    target = tiny_model("llama")
    draft = sharper_draft(target, tmp_path_factory.mktemp("draft") / "m")
    kw = {"dtype": "float32", "device": "cpu", "show_progress": False, "max_num_seqs": N, "max_num_batched_tokens": 8192}
    plain = LLM(target, **kw)
    spec = LLM(target, speculative_config={"model": draft, "num_speculative_tokens": 2, "disable_by_batch_size": 10 * N},
               **kw)
    return plain, spec


def _samples(llm: LLM, seed: int) -> list[list[int]]:
    seed_sampler(llm, seed)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True)
    return [o.token_ids for o in llm.generate([PROMPT] * N, params)]


def test_speculative_samples_match_plain_samples(engines, monkeypatch):
    plain, spec = engines
    ref = _samples(plain, 1)
    out = _samples(spec, 2)
    m = spec.get_metrics()
    assert 0.25 < m["spec_decode_acceptance_rate"] < 0.75, m  # close to, but not the same as, the target
    for pos in (1, 2):  # the positions a verification step emits
        assert two_sample([t[pos] for t in ref], [t[pos] for t in out]) > ALPHA, pos

    monkeypatch.setattr(verify_mod, "residual", wrong_residual)
    wrong = _samples(spec, 2)
    assert two_sample([t[1] for t in ref], [t[1] for t in wrong]) < 1e-8
