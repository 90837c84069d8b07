"""The multi-rank step path without Ray tasks: step deltas rebuild every step exactly, and the step
channel reports a rank's error, death or silence by rank, fast."""
from __future__ import annotations

import pickle
import random
import socket
import sys
import struct
import threading
import time

import pytest

from cluster.step_channel import RankFailure, StepChannel, run_rank_loop
from workers.sampling_params import SamplingParams
from workers.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from workers.step_delta import StepDecoder, StepEncoder, pack_output, unpack_output


def _random_schedules(steps: int, seed: int = 0):
    """Steps as a scheduler makes them: admissions (whole prompts or chunks), decodes with growing
    tables, preemptions (dropped, then back with a new table), finishes."""
    rng = random.Random(seed)
    live: dict[str, dict] = {}
    next_block, n = 0, 0
    for _ in range(steps):
        dropped = []
        for seq_id in list(live):
            if rng.random() < 0.08:
                dropped.append(seq_id)
                del live[seq_id]
        while rng.random() < 0.5:
            n += 1
            params = SamplingParams(max_tokens=8, temperature=rng.choice([0.0, 0.7]), seed=n)
            live[f"s{n}"] = {"params": params, "table": [], "pos": 0, "out": 0}
        seqs = []
        for seq_id, st in live.items():
            if rng.random() < 0.2:
                continue  # not scheduled this step
            k = rng.choice([1, 1, 1, 5, 9])
            st["pos"] += k
            while len(st["table"]) * 4 < st["pos"]:
                st["table"].append(next_block)
                next_block += 1
            sample = rng.random() < 0.8
            seqs.append(ScheduledSeq(seq_id, [rng.randrange(100) for _ in range(k)], st["pos"] - k, list(st["table"]),
                                     sample, st["params"], st["out"]))
            st["out"] += sample
        # A preempted sequence may come back at once with a fresh table (the drop is in the same step).
        if dropped and rng.random() < 0.5:
            seq_id = dropped[0]
            live[seq_id] = {"params": SamplingParams(max_tokens=4), "table": [next_block], "pos": 3, "out": 0}
            next_block += 1
            seqs.append(ScheduledSeq(seq_id, [1, 2, 3], 0, [next_block - 1], True, live[seq_id]["params"], 0))
        yield SchedulerOutput(seqs=seqs, finished_seq_ids=dropped)


def test_deltas_rebuild_every_step_exactly():
    encoder, decoder = StepEncoder(), StepDecoder()
    for out in _random_schedules(400):
        got = decoder.decode(encoder.encode(out))
        assert got == out
    assert decoder.num_held > 0


def test_deltas_send_less_than_the_whole_step():
    params = SamplingParams(max_tokens=64)
    tables = {f"s{i}": list(range(i * 40, i * 40 + 40)) for i in range(64)}
    step = lambda pos: SchedulerOutput([ScheduledSeq(k, [5], pos, t, True, params, pos - 100) for k, t in tables.items()])  # noqa: E731
    encoder = StepEncoder()
    first = encoder.encode(step(100))
    later = encoder.encode(step(101))
    assert len(later) < len(first) / 4 < len(pickle.dumps(step(101))) / 4


def _decode_heavy_schedules(steps: int, seed: int = 0):
    """Mostly plain decodes (the compact part of a step), mixed with admissions, prefill chunks, finishes,
    preemptions that come back at once with a new table, tables that grow, a tail block replaced (a
    speculative rejection's trim and regrowth), drafts and token history; some stretches where the same
    sequences all decode."""
    rng = random.Random(seed)
    live: dict[str, dict] = {}
    next_block, n = 0, 0

    def admit():
        nonlocal n, next_block
        n += 1
        params = SamplingParams(max_tokens=64, temperature=rng.choice([0.0, 0.7]), seed=n,
                                repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.2]))
        prompt = [rng.randrange(100) for _ in range(rng.randrange(2, 9))]
        live[f"s{n}"] = {"params": params, "table": [], "pos": 0, "out": 0, "prompt": prompt, "todo": list(prompt)}

    for _ in range(3):
        admit()
    for step in range(steps):
        steady = step % 20 >= 12  # every live sequence decodes one token, nothing else happens
        dropped = []
        if not steady:
            for seq_id in list(live):
                if rng.random() < 0.05:
                    dropped.append(seq_id)
                    del live[seq_id]
            while rng.random() < 0.3:
                admit()
        seqs = []
        for seq_id, st in live.items():
            if not steady and rng.random() < 0.1:
                continue  # not scheduled this step
            history = st["params"].needs_token_history
            drafts = []
            if st["todo"]:  # prefill: the whole rest of the prompt or a chunk of it
                k = len(st["todo"]) if rng.random() < 0.6 else 1 + rng.randrange(len(st["todo"]))
                tokens, st["todo"] = st["todo"][:k], st["todo"][k:]
                sample = not st["todo"]
            else:
                tokens, sample = [rng.randrange(100)], True
                if not steady and rng.random() < 0.1:
                    drafts = [rng.randrange(100) for _ in range(rng.randrange(1, 4))]
                    tokens = tokens + drafts
            start = st["pos"]
            if not steady and st["table"] and rng.random() < 0.05:
                st["table"][-1] = next_block  # trimmed and regrown with another block
                next_block += 1
            while len(st["table"]) * 4 < start + len(tokens):
                st["table"].append(next_block)
                next_block += 1
            seq = ScheduledSeq(seq_id, tokens, start, list(st["table"]), sample, st["params"], st["out"],
                               list(st["prompt"]) if history else [],
                               [7] * st["out"] if history else [], spec_token_ids=drafts)
            seqs.append(seq)
            # A verification step keeps some of its drafts; any other moves on by its tokens.
            gained = 1 + rng.randrange(len(drafts) + 1) if drafts else len(tokens)
            st["pos"] += gained
            st["out"] += (gained if drafts else 1) if sample else 0
        if dropped and not steady and rng.random() < 0.5:  # preempted, and back at once with a new table
            seq_id = dropped[0]
            live[seq_id] = {"params": SamplingParams(max_tokens=4), "table": [next_block], "pos": 3, "out": 1,
                            "prompt": [1, 2], "todo": []}
            next_block += 1
            seqs.append(ScheduledSeq(seq_id, [1, 2, 3], 0, [next_block - 1], True, live[seq_id]["params"], 0))
        yield SchedulerOutput(seqs=seqs, finished_seq_ids=dropped)


def test_compact_decodes_rebuild_every_step_exactly():
    """The compact part of a step (plain decodes: only their slots and tokens, or only the tokens when the
    step has the last step's sequences) rebuilds the same SchedulerOutput as sending each sequence."""
    encoder, decoder = StepEncoder(), StepDecoder()
    mixed = all_compact = same_slots = grown = 0
    for out in _decode_heavy_schedules(600):
        payload = encoder.encode(out)
        _, _, new, known, _, compact, _ = pickle.loads(payload)
        if compact is not None:
            others = bool(new or known)
            mixed += others
            all_compact += not others
            same_slots += not others and compact[0] is None and compact[1] is None
            grown += bool(compact[3])
        got = decoder.decode(payload)
        assert got == out
        assert [s.spec_token_ids for s in got.seqs] == [s.spec_token_ids for s in out.seqs]
        sampled = [s.seq_id for s in out.seqs if s.sample]  # the answer's order, handed on while the same
        assert out.sample_seq_ids() == sampled and got.sample_seq_ids() == sampled
    assert min(mixed, all_compact, same_slots, grown) > 0, (mixed, all_compact, same_slots, grown)


def test_a_steady_decode_step_sends_only_its_tokens():
    params = SamplingParams(max_tokens=64)
    tables = {f"s{i}": list(range(i * 40, i * 40 + 40)) for i in range(64)}
    step = lambda pos: SchedulerOutput([ScheduledSeq(k, [pos % 50], pos, list(t), True, params, pos - 100)  # noqa: E731
                                        for k, t in tables.items()])
    encoder, decoder = StepEncoder(), StepDecoder()
    sizes = []
    for pos in range(100, 106):
        if pos == 104:  # one table grows: still compact, the new block travels beside the tokens
            tables["s3"].append(9999)
        payload = encoder.encode(step(pos))
        assert decoder.decode(payload) == step(pos)
        sizes.append(len(payload))
    assert sizes[2] < sizes[1] < sizes[0] / 4  # whole, then slots and tokens, then tokens only
    _, _, new, known, _, compact, _ = pickle.loads(payload)
    assert not new and not known and compact == (None, None, [105 % 50] * 64, [])


def _step_of(seq_ids: list[str], sample: list[bool]) -> SchedulerOutput:
    params = SamplingParams(max_tokens=8)
    return SchedulerOutput([ScheduledSeq(i, [1], 5, [0], s, params, 1) for i, s in zip(seq_ids, sample)])


def test_answers_travel_as_columns_and_become_the_same_tokens_on_the_driver():
    """A runner's columns go out as they are (no object per token on the rank) and come back as the same
    `sampled` dict a runner's dict would give; columns that are not the step's sampled sequences in order
    go keyed, so nothing is matched to the wrong sequence."""
    out = _step_of(["a", "b", "c"], [True, False, True])
    tops = [[(4, -0.1)], None]
    columns = ModelRunnerOutput.from_columns(["a", "c"], [7, 9], [-0.5, -1.5], tops)
    packed = pack_output(columns, out)
    assert packed == ("ordered", [7, 9], [-0.5, -1.5], tops)
    got = unpack_output(pickle.loads(pickle.dumps(packed)), out)
    assert got.columns is not None  # the driver makes the SampledTokens when the engine reads them
    expected = {"a": SampledToken(7, -0.5, [(4, -0.1)]), "c": SampledToken(9, -1.5)}
    assert got.token_ids_by_seq() == {"a": 7, "c": 9} and got.sampled == expected and got.columns is None
    assert got == ModelRunnerOutput(expected)
    # The runner answered in another order: put in the step's order by id, never zipped onto the wrong sequences.
    swapped = ModelRunnerOutput.from_columns(["c", "a"], [9, 7], [-1.5, -0.5], [None, [(4, -0.1)]])
    packed = pack_output(swapped, out)
    assert packed[:2] == ("ordered", [7, 9]) and unpack_output(packed, out).sampled == expected
    other = ModelRunnerOutput.from_columns(["a", "x"], [7, 3], [-0.5, -0.2])  # not the step's sequences: by id
    packed = pack_output(other, out)
    assert packed[0] == "keyed" and unpack_output(packed, out).token_ids_by_seq() == {"a": 7, "x": 3}
    with pytest.raises(ValueError, match="2 sequences, 1 tokens"):
        ModelRunnerOutput.from_columns(["a", "c"], [7], [-0.5, -1.5])
    # With prompt logprobs, the tokens inside still go as columns.
    columns.prompt_logprobs = {"a": [(0, -2.0, [])]}
    packed = pack_output(columns, out)
    assert packed[0] == "prompt" and packed[1][0] == "ordered"
    got = unpack_output(packed, out)
    assert got.sampled == expected and got.prompt_logprobs == {"a": [(0, -2.0, [])]}


def _channel(handlers, spin_s: float = 0.0):
    channel = StepChannel("127.0.0.1", len(handlers), spin_s=spin_s)
    threads = [run_rank_loop(channel.address, rank, h, spin_s) for rank, h in enumerate(handlers)]
    channel.accept(timeout_s=10)
    return channel, threads


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
def test_same_node_ranks_connect_over_the_local_socket_beside_tcp_ones_and_die_loudly():
    """Rank 0 takes the driver's local socket, rank 1 TCP (as a rank on another node would), rank 2 a
    local path that does not exist here (another node's) and falls back to TCP; steps and a death work alike."""
    channel = StepChannel("127.0.0.1", 3)
    assert channel.local_path is not None and channel.local_path.startswith("\0")
    run_rank_loop(channel.address, 0, lambda m: ("local", m[1]), local_path=channel.local_path)
    run_rank_loop(channel.address, 1, lambda m: ("tcp", m[1]))
    run_rank_loop(channel.address, 2, lambda m: ("fallback", m[1]), local_path="\0tandem-steps-elsewhere")
    channel.accept(timeout_s=10)
    try:
        families = {r: sock.family for r, sock in channel._socks.items()}
        assert families == {0: socket.AF_UNIX, 1: socket.AF_INET, 2: socket.AF_INET}
        for i in range(3):
            channel.broadcast(("step", i))
            assert channel.gather(5) == {0: ("local", i), 1: ("tcp", i), 2: ("fallback", i)}
    finally:
        channel.close()
    channel = StepChannel("127.0.0.1", 2)
    run_rank_loop(channel.address, 0, lambda m: None, local_path=channel.local_path)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # rank 1, local: connects, then "dies"
    dead.connect(channel.local_path)
    dead.sendall(struct.pack("<I", 1))
    channel.accept(timeout_s=10)
    try:
        channel.broadcast(("step", 0))
        dead.close()
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as e:
            channel.gather(30)
        assert e.value.rank == 1 and "died" in e.value.what and time.monotonic() - t0 < 2
    finally:
        channel.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.2], ids=["blocking", "spinning"])
def test_channel_round_trip_and_a_raising_rank(spin_s):
    def rank1(message):
        if message[1] == "boom":
            raise ValueError("bad step")
        return None

    channel, _ = _channel([lambda m: ("rank0 saw", m[1]), rank1], spin_s)
    try:
        channel.broadcast(("step", 1))
        assert channel.gather(5) == {0: ("rank0 saw", 1), 1: None}
        time.sleep(0.3)  # the rank loops have stopped spinning and block: the next step still reaches them
        channel.broadcast(("step", 2))
        assert channel.gather(5) == {0: ("rank0 saw", 2), 1: None}
        channel.broadcast(("step", "boom"))
        with pytest.raises(RankFailure) as e:
            channel.gather(5)
        assert e.value.rank == 1 and "ValueError('bad step')" in e.value.what
    finally:
        channel.close()


@pytest.mark.parametrize("spin_s", [0.0, 5.0], ids=["blocking", "spinning"])
def test_channel_names_a_dead_rank_at_once_and_a_silent_one_at_the_deadline(spin_s):
    """A spinning wait notices a death as fast, and never spins past the step deadline."""
    stuck = threading.Event()
    channel = StepChannel("127.0.0.1", 3, spin_s=spin_s)
    run_rank_loop(channel.address, 0, lambda m: stuck.wait())  # never answers in time
    run_rank_loop(channel.address, 1, lambda m: None)
    dead = socket.create_connection(channel.address)  # rank 2: connects, then its process "dies"
    dead.sendall(struct.pack("<I", 2))
    channel.accept(timeout_s=10)
    try:
        channel.broadcast(("step", 0))
        dead.close()
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as e:
            channel.gather(30)
        assert e.value.rank == 2 and "died" in e.value.what and time.monotonic() - t0 < 2
    finally:
        channel.close()
    channel = StepChannel("127.0.0.1", 2, spin_s=spin_s)
    run_rank_loop(channel.address, 0, lambda m: stuck.wait())
    run_rank_loop(channel.address, 1, lambda m: None)
    channel.accept(timeout_s=10)
    try:
        channel.broadcast(("step", 0))
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as e:
            channel.gather(0.5)
        assert e.value.late == [0] and "did not answer" in e.value.what and time.monotonic() - t0 < 2
    finally:
        stuck.set()
        channel.close()


def test_start_lags_match_steps_by_order_across_ranks():
    from workers.rank_profile import RankProfile, start_lags

    profiles = [RankProfile(r) for r in range(3)]
    for p in profiles:
        for kind in ("mixed", "decode", "decode", "decode"):
            p.step(kind, 0.0, 0.0, lambda: None)
    # Rewrite the recorded starts: rank 1 starts every decode 2 ms after rank 0, rank 2 the first decode 6 ms early.
    for p, shifts in zip(profiles, ([0, 0, 0, 0], [1e-3, 2e-3, 2e-3, 2e-3], [0, -6e-3, 0, 0])):
        for row, n, shift in zip(p.rows, range(4), shifts):
            row["start"] = 100.0 + n + shift
    ranks = [p.summary(starts=True) for p in profiles]
    assert ranks[0]["decode"]["execute_starts"] == [[1, 101.0], [2, 102.0], [3, 103.0]]
    assert "execute_starts" not in profiles[0].summary()  # the logged windows leave them out
    lags = start_lags(ranks)
    assert lags["mixed"] == {"steps": 1, "ms_mean": [0.0, pytest.approx(1.0), 0.0], "ms_p50": [0.0, pytest.approx(1.0), 0.0]}
    d = lags["decode"]
    assert d["steps"] == 3
    assert d["ms_mean"] == pytest.approx([2.0, 4.0, 0.0])  # step 1: 6, 8, 0 ms; steps 2 and 3: 0, 2, 0
    assert d["ms_p50"] == pytest.approx([0.0, 2.0, 0.0])
    assert start_lags(ranks[:1]) == {}


@pytest.fixture(scope="module")
def private_ray(shared_ray):
    return shared_ray  # the session's local Ray (tests/conftest.py), which the executor joins


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"distributed_executor_backend": "ray"}, {"tensor_parallel_size": 2}, {}])
def test_every_rank_profiles_its_steps(layout, private_ray, tmp_path, monkeypatch):
    """Through the rank actors at world size 1 and 2, and in-process: each rank's idle, dispatch and
    execute time per step kind; the sampled steps also give communication time where ranks talk."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from step_profile import StepProfile
    from tandem import LLM, SamplingParams
    from tests.models import tiny_model

    monkeypatch.setenv("TANDEM_PROFILE_TRACE_DIR", str(tmp_path))  # the rank actors see it too
    llm = LLM(tiny_model("llama", num_hidden_layers=2), device="cpu", show_progress=False, **layout)
    try:
        prof = StepProfile(llm.llm_engine, gpu_every=1)
        llm.generate([[1, 2, 3, 4, 5] * 4] * 3, SamplingParams(max_tokens=6, ignore_eos=True))
        summary, table = prof.summary(), prof.table()
    finally:
        llm.shutdown()
    ranks = summary["ranks"]
    assert len(ranks) == layout.get("tensor_parallel_size", 1)
    for by_kind in ranks:
        assert by_kind["mixed"]["steps"] == 1 and by_kind["decode"]["steps"] == 5
        assert by_kind["decode"]["ms_execute"] > 0 and by_kind["decode"]["sampled_steps"] == 5
        assert (by_kind["decode"]["ms_comm"] > 0) == (len(ranks) > 1)
        # what the sampled steps spent their time on, by op, and how many tokens they carried
        assert by_kind["mixed"]["sampled_tokens"] == [60] and set(by_kind["decode"]["sampled_tokens"]) == {3}
        top = by_kind["mixed"]["ms_top_host"]
        assert 0 < len(top) <= 8 and any("linear" in name or "mm" in name for name in top), top
        for kind in ("mixed", "decode"):  # eager steps (CPU: no graphs): input building, launches, sampling
            phases = by_kind[kind]["ms_host_phases"]
            assert set(phases) == {"prepare", "forward", "sample"} and min(phases.values()) >= 0, phases
            assert phases["forward"] > 0 and sum(phases.values()) <= by_kind[kind]["ms_execute"] + 1e-6
    host = summary["host"]["decode"]
    assert host["steps"] == 5 and 0 < host["ms_step_p50"] <= 5 * host["ms_step"]  # the median of five steps
    assert "rank kind" in table and "host time by phase" in table
    # Each rank's execute start behind the earliest rank's, per step (matched by order number): with 5 decode
    # steps one rank is earliest in at least 3, so its median lag is 0; the raw start times stay out of the JSON.
    lags = summary["start_lag"]
    if len(ranks) > 1:
        assert lags["decode"]["steps"] == 5 and lags["mixed"]["steps"] == 1
        for d in lags.values():
            assert len(d["ms_mean"]) == len(d["ms_p50"]) == 2 and min(d["ms_p50"]) == 0
            assert all(0 <= m < 5000 for m in d["ms_mean"])
        assert "execute start behind the earliest rank" in table
    else:
        assert lags == {}
    assert not any("execute_starts" in d for by_kind in ranks for d in by_kind.values())
    # chrome traces: two per rank and step kind at most (one mixed step here), Python frames included
    traces = sorted(p.name for p in tmp_path.iterdir())
    want = [f"rank{r}-{kind}-step{i}-{n}tok.json.gz" for r in range(len(ranks))
            for kind, i, n in (("decode", 1, 3), ("decode", 2, 3), ("mixed", 0, 60))]
    assert traces == sorted(want), traces
    import gzip, json
    events = json.load(gzip.open(tmp_path / want[-1]))["traceEvents"]
    assert any(e.get("cat") == "python_function" for e in events)
    from trace_gaps import analyze  # scripts/: what the trace says (no GPU here: nothing was busy on one)

    result = analyze(str(tmp_path / want[-1]))
    assert result["span_ms"] > 0 and result["gpu_busy_ms"] == 0 and result["host_self_ms"]
