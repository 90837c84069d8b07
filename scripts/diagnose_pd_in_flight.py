#!/usr/bin/env python3
"""Issue 24, item 2: where several KV transfers in flight on one prefill/decode pair go wrong on GPUs.

With 4 transfers in flight per pair (the decode replica's `kv_transfers_in_flight`), tests/gpu/test_disagg_gpu.py
[whole] decoded other tokens than the single-GPU engine for one prompt in one run and hung in the next (2 x H200);
on 2 x H100 (2026-11-27) `--in-flight 4 --rounds 3` gave PASS (engine/disagg.py, at TRANSFERS_IN_FLIGHT_DEFAULT, says
what is known). This runs that test's scenario (models/tandem-tiny, bf16, one prefill and one decode replica at TP=1
as Ray rank actors on GPUs 0 and 1, NCCL, its four prompts at once) for --rounds rounds, each round's prompts made
distinct by a first line of its own, and:
- after every transfer, before its request joins the decode batch, reads the blocks it moved on both ranks
  (Ray's `__ray_call__` on the rank actors) and compares them bit for bit: whole blocks, and the last block's slots
  up to the prompt's end (the rest is not the prompt's KV);
- logs each transfer's start and end (number on the pair, request, blocks), so a stuck one is named;
- compares every request's tokens with a single-GPU `LLM` run of the same round's four prompts (the test's reference).

Verdict (last line): TRANSPORT when a transfer's blocks differ (the agent, NCCL or the stream order delivered wrong
bytes); else NEAR-TIE when tokens differ only where the reference's own top two were within NEAR_TIE nats (bf16
rounding in another batch composition: the test's exact comparison, not the handoff); ENGINE when a departure is
wider (the decode side's admission, steps or scheduling of requests that arrive together); PASS when nothing differs.
`--dtype float32` settles a NEAR-TIE: it should then PASS. A run that outlives --budget-s dumps every driver thread's
stack and exits (code 1): "start" lines without their "end" name the stuck transfers.

    python scripts/diagnose_pd_in_flight.py --in-flight 4 --rounds 3
    python scripts/diagnose_pd_in_flight.py --in-flight 1          # the served default, as a control
    python scripts/diagnose_pd_in_flight.py --device cpu --rounds 1  # the same over gloo: a check of the script itself
Needs 2 CUDA GPUs (but with --device cpu).
"""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import functools
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = str(ROOT / "models" / "tandem-tiny")
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Tree:\n    def __init__(self, root):\n" * 4,
           "def walk(tree):\n    for node in tree:\n        yield node\n" * 12)  # tests/gpu/test_disagg_gpu.py's
ENGINE = dict(model=MODEL, device="cuda", dtype="bfloat16", block_size=16, num_gpu_blocks_override=256)
TOP_N = 20  # log-probabilities the reference returns per token
# A departure whose two tokens were this close in the reference's log-probabilities is a near-tie: bf16 rounding in
# another batch composition (a request decoded at batch 1 runs other kernels than at batch 4) flips such choices
# (tests/gpu/test_two_gpu_bf16.py, the same tolerance), so it says nothing about the transfer.
NEAR_TIE = 0.1


def _read_blocks(worker, block_ids: list[int]):
    """Inside a rank actor (`__ray_call__`): those blocks of its KV cache, on the host."""
    worker._bind_device()
    return worker.kv_agent.kv_cache[:, :, block_ids].cpu()


def _compare(src, dst, positions: list[int], prompt_len: int, block_size: int) -> list[str]:
    """Wrong blocks of a transfer (by position in the sequence), each with the share of its prompt slots that differ."""
    import torch

    bad = []
    for j, pos in enumerate(positions):
        slots = max(0, min(block_size, prompt_len - pos * block_size))  # a block past the prompt holds none of it
        a, b = src[:, :, j, :slots].view(torch.int16), dst[:, :, j, :slots].view(torch.int16)
        if not torch.equal(a, b):
            bad.append(f"block {pos}: {(a != b).float().mean().item():.1%} of its prompt slots differ")
    return bad


def _departure(mine: list[int] | str, ref) -> tuple[str, float | None]:
    """Where a request's tokens leave the reference's ("" if they do not), and the reference's own log-probability gap
    there between its token and ours (None: a failed request, or our token not in its top TOP_N)."""
    if isinstance(mine, str):
        return mine, None
    theirs = ref.token_ids
    if mine == theirs:
        return "", None
    k = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    if k >= min(len(mine), len(theirs)):
        return f"{len(mine)} tokens where the single-GPU run has {len(theirs)}", None
    lps = ref.logprobs[k]
    gap = lps[theirs[k]] - lps[mine[k]] if mine[k] in lps else None
    where = "not in its top-20" if gap is None else f"{gap:.4f} nats below its token there"
    return f"departs from the single-GPU run at generated token {k + 1} (ours {where})", gap


class TransferLog:
    """Every transfer's start, end and block check, printed as they happen (a hang leaves its "start" unmatched)."""

    def __init__(self, prompt_lens: dict[str, int], block_size: int):
        self.prompt_lens, self.block_size = prompt_lens, block_size
        self.wrong: list[str] = []
        self.failed: list[str] = []
        self._t0, self._lock = time.monotonic(), threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            print(f"[{time.monotonic() - self._t0:7.3f}s] {text}", flush=True)

    def wrap(self, original):
        """DecodeReplica._transfer_blocking, then the check of the blocks it moved."""
        import ray

        @functools.wraps(original)
        def checked(replica, spec, state, seq, peer, plan, res, num_blocks, piece):
            what = f"transfer {seq} (request {res.request_id}, {num_blocks} blocks)"
            self.say(f"start {what}")
            try:
                stats = original(replica, spec, state, seq, peer, plan, res, num_blocks, piece)
            except BaseException as e:
                self.failed.append(f"{what}: {e!r}")
                self.say(f"FAILED {what}: {e!r}")
                raise
            if len(peer.rank_handles) != 1 or len(replica.executor.workers) != 1:
                raise RuntimeError("this check reads one rank a side (TP=1 both)")
            positions = sorted({i for t in plan for i in t.blocks})
            src = ray.get(peer.rank_handles[0].__ray_call__.remote(_read_blocks, [peer.block_ids[i] for i in positions]))
            dst = ray.get(replica.executor.workers[0].__ray_call__.remote(_read_blocks, [res.block_ids[i] for i in positions]))
            bad = _compare(src, dst, positions, self.prompt_lens[res.request_id], self.block_size)
            self.wrong += [f"{what}: {b}" for b in bad]
            self.say(f"end {what} in {stats.seconds * 1e3:.1f} ms: " + ("blocks equal" if not bad else "WRONG " + "; ".join(bad)))
            return stats

        return checked


def _replicas(transfer_timeout_s: float, engine: dict, in_flight: int):
    from engine import LLMEngine
    from engine.disagg import DecodeReplica, PrefillReplica
    from workers.config import EngineConfig

    kwargs = dict(engine, distributed_executor_backend="ray", kv_transfer_timeout_seconds=transfer_timeout_s)
    prefill = PrefillReplica(LLMEngine(EngineConfig.from_kwargs(**kwargs), show_progress=False))
    decode = DecodeReplica(LLMEngine(EngineConfig.from_kwargs(**kwargs), show_progress=False), prefill.prefill,
                           kv_transfers_in_flight=in_flight)
    return prefill, decode


async def _rounds(decode, rounds: list[list[list[int]]], params, log: TransferLog) -> list[list[list[int]]]:
    """Each round's prompts at once (as the test's four), one round after the other."""
    async def one(rid: str, prompt: list[int]) -> list[int] | str:
        try:
            return [t async for out in decode.generate(rid, prompt, params) for t in out.new_token_ids]
        except Exception as e:  # noqa: BLE001 - reported with the tokens
            log.say(f"request {rid} FAILED: {e!r}")
            return f"failed: {e!r}"

    got = []
    for r, prompts in enumerate(rounds):
        log.say(f"round {r}: {len(prompts)} prompts")
        got.append(await asyncio.gather(*(one(f"r{r}-{i}", p) for i, p in enumerate(prompts))))
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in-flight", type=int, default=4, help="the decode replica's kv_transfers_in_flight (per pair) for this run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the test's four prompts, each with a line of its own")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", help="the test's; on CPU bf16 tokens vary with the batch, float32 not")
    ap.add_argument("--transfer-timeout-s", type=float, default=20.0, help="kv_transfer_timeout_seconds (a stuck one fails)")
    ap.add_argument("--budget-s", type=float, default=100.0, help="then every driver stack is dumped and the run exits")
    args = ap.parse_args(argv)

    import ray
    import torch

    import engine.disagg as disagg
    from engine import LLM, SamplingParams

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA GPUs")
    engine = dict(ENGINE, device=args.device, dtype=args.dtype)
    faulthandler.dump_traceback_later(args.budget_s, exit=True)  # a hang: the stacks, then exit (code 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    try:
        prefill, decode = _replicas(args.transfer_timeout_s, engine, args.in_flight)
        tok = decode.llm_engine.tokenizer
        rounds = [[tok.encode(f"# round {r}\n" + p) for p in PROMPTS] for r in range(args.rounds)]
        log = TransferLog({f"r{r}-{i}": len(p) for r, ps in enumerate(rounds) for i, p in enumerate(ps)}, engine["block_size"])
        disagg.DecodeReplica._transfer_blocking = log.wrap(disagg.DecodeReplica._transfer_blocking)
        got = asyncio.run(_rounds(decode, rounds, params, log))
        leaked = (decode.llm_engine.block_manager.num_used_blocks, prefill.llm_engine.block_manager.num_used_blocks)
        for executor in (prefill.executor, decode.executor):
            executor.shutdown()
    finally:
        ray.shutdown()
    llm = LLM(MODEL, **{k: v for k, v in engine.items() if k != "model"}, show_progress=False)
    # The reference runs each round's four prompts together, as the test's does, with the top log-probabilities: where
    # a request departs from it, how far apart its two tokens were there says rounding (a near-tie) from a wrong input.
    refs = [llm.generate(prompts, params.model_copy(update={"logprobs": TOP_N})) for prompts in rounds]
    differ, wide = [], 0
    for r in range(len(rounds)):
        for i, (mine, ref) in enumerate(zip(got[r], refs[r])):
            line, gap = _departure(mine, ref)
            if line:
                differ.append(f"request r{r}-{i}: {line}")
                wide += gap is None or gap > NEAR_TIE
    print("\n".join(log.failed + log.wrong + differ + [f"blocks still used (decode, prefill): {leaked}"]))
    verdict = "TRANSPORT" if log.wrong else "ENGINE" if wide else "NEAR-TIE" if differ else "PASS"
    print(f"VERDICT {verdict}: in flight {args.in_flight}, {args.rounds} rounds, {len(log.failed)} transfers failed, "
          f"{len(log.wrong)} wrong blocks, {len(differ)} requests with other tokens ({wide} not at a near-tie)")
    faulthandler.cancel_dump_traceback_later()
    return 0 if verdict == "PASS" and not log.failed else 1


if __name__ == "__main__":
    sys.exit(main())
