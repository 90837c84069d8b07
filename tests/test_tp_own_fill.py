"""A TP-only replica's ranks fill a step sent ahead themselves after an all plain greedy step.

Under TP, a plain greedy step's (max, id, log-sum-exp) per rank are all-gathered (`ParallelLMHead.greedy_tokens(
everywhere=True)`), so every rank picks the same tokens and fills the next step's placeholders from its own result,
as the only rank of a replica does: no "fill" message and no round trip rank 0 -> driver -> ranks (~1 ms of a TP=2
decode step on 2 x H100). Every other step (a seeded draw, logprobs top-n, PP, SP) keeps the driver's fill. Output
must equal one rank's exactly; a rank told to fill itself without the tokens must fail loudly, naming itself.
"""
from __future__ import annotations

import pytest

from engine.llm import LLM
from parallel.config import ParallelConfig
from tests.models import prompts_of_lengths, tiny_model
from workers.executor import ExecutorError
from workers.sampling_params import SamplingParams
from workers.scheduler_output import PLACEHOLDER_TOKEN, ModelRunnerOutput, ScheduledSeq
from workers.step_delta import StepDecoder, StepEncoder, decode_own, tp_own_fill_enabled

ENGINE_ARGS = dict(max_num_batched_tokens=24, max_num_seqs=8, block_size=8, cpu_kv_cache_bytes=256 * 1024,
                   show_progress=False, dtype="float32", device="cpu")
PROMPTS = prompts_of_lengths([5, 17, 9, 30], vocab_size=290, seed=5)


def test_only_a_tp_only_replica_fills_its_own_steps(monkeypatch):
    from cluster.ray_executor import tp_ranks_fill_own

    assert tp_ranks_fill_own(ParallelConfig(tensor_parallel_size=2), 1)
    assert tp_ranks_fill_own(ParallelConfig(tensor_parallel_size=4), 1)
    assert not tp_ranks_fill_own(ParallelConfig(), 1)  # one rank: filled its own steps before (world size 1)
    assert not tp_ranks_fill_own(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), 1)
    assert not tp_ranks_fill_own(ParallelConfig(tensor_parallel_size=2, sequence_parallel_size=2), 1)
    assert not tp_ranks_fill_own(ParallelConfig(tensor_parallel_size=2), 2)
    monkeypatch.setenv("TANDEM_TP_OWN_FILL", "0")
    assert not tp_own_fill_enabled() and not tp_ranks_fill_own(ParallelConfig(tensor_parallel_size=2), 1)


def test_a_rank_without_the_tokens_refuses_to_fill_by_name():
    encoder, decoder = StepEncoder(), StepDecoder()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = ScheduledSeq("a", [5, 6, 7], 0, [0], True, params, 0)
    decoder.decode(encoder.encode(_out([first])))
    ahead = ScheduledSeq("a", [PLACEHOLDER_TOKEN], 3, [0], True, params, 1)
    with pytest.raises(RuntimeError, match="rank 1 was told to fill .* lacks the step before's token of 1 of its 1"):
        decode_own(decoder, encoder.encode(_out([ahead])), ModelRunnerOutput({}), None, "rank 1")
    decoder.decode(encoder.encode(_out([first])))  # no result kept at all (None): the same refusal
    again = ScheduledSeq("a", [PLACEHOLDER_TOKEN], 3, [0], True, params, 1)
    with pytest.raises(RuntimeError, match="rank 3 was told"):
        decode_own(decoder, encoder.encode(_out([again])), None, None, "rank 3")
    # With the token, the placeholder is filled from it.
    decoder.decode(encoder.encode(_out([first])))
    filled = ScheduledSeq("a", [PLACEHOLDER_TOKEN], 3, [0], True, params, 1)
    out = decode_own(decoder, encoder.encode(_out([filled])), ModelRunnerOutput.from_columns(["a"], [42], [0.0]),
                     None, "rank 1")
    assert out.seqs[0].token_ids == [42]


def _out(seqs):
    from workers.scheduler_output import SchedulerOutput

    return SchedulerOutput(seqs=seqs)


def _count_messages(executor) -> dict[str, int]:
    """Counts what the driver broadcasts: "fill" frames, and steps sent `own` (filled by the ranks themselves)."""
    counts = {"fill": 0, "own": 0}
    broadcast = executor.channel.broadcast

    def counted(message):
        counts["fill"] += message[0] == "fill"
        counts["own"] += message[0] == "step" and bool(message[2]) and bool(message[3])
        return broadcast(message)

    executor.channel.broadcast = counted
    return counts


@pytest.fixture(scope="module")
def model() -> str:
    return tiny_model("llama", num_hidden_layers=2, vocab_size=301)  # odd vocabulary: padded under TP


@pytest.fixture(scope="module")
def one_rank(model):
    llm = LLM(model, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_tp2_fills_greedy_steps_itself_and_matches_one_rank(model, one_rank, shared_ray):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    # A seeded draw for a few tokens among greedy requests: its steps take the fill, the greedy ones after it don't.
    mixed = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    want_greedy = one_rank.generate(PROMPTS, greedy, use_tqdm=False)
    want_mixed = one_rank.generate(PROMPTS, mixed, use_tqdm=False)
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=True, **ENGINE_ARGS)
    try:
        executor = llm.llm_engine.executor
        counts = _count_messages(executor)
        got = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want_greedy]
        for g, w in zip(got, want_greedy):
            assert [lp[t] for lp, t in zip(g.logprobs, g.token_ids)] == pytest.approx(
                [lp[t] for lp, t in zip(w.logprobs, w.token_ids)], abs=1e-4)
        assert counts["fill"] == 0, "an all-greedy run sent fill messages"
        assert counts["own"] >= 8 and executor.own_fills == counts["own"], counts

        counts.update(fill=0, own=0)
        got = llm.generate(PROMPTS, mixed, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want_mixed]
        assert counts["fill"] > 0 and counts["own"] > 0, counts  # both paths, in one run

        # The driver claiming a seeded step's tokens are on every rank: rank 1 (not the output rank) lacks them.
        import cluster.ray_executor as ray_executor

        ray_executor.sampled_on_every_tp_rank, real = (lambda out: True), ray_executor.sampled_on_every_tp_rank
        try:
            with pytest.raises(ExecutorError, match=r"rank 1 .*told to fill a step sent ahead from its own tokens"):
                llm.generate(PROMPTS[:2], mixed[1], use_tqdm=False)
        finally:
            ray_executor.sampled_on_every_tp_rank = real
    finally:
        llm.shutdown()
