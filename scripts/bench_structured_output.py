#!/usr/bin/env python3
"""Structured output's cost per step: the grammar bitmask applied to a batch of full-vocabulary
logits (workers/structured_output.py) before the sampler, and the engine-side fill of that bitmask
from xgrammar matchers (engine/grammar.py).

    python scripts/bench_structured_output.py                     # batch 256, vocab 128256, on CUDA if present
    python scripts/bench_structured_output.py --dry-run           # tiny CPU run (the unit test's)

Measured, in ms per step (median of --iters after a warm-up):
- torch_ms: the torch bit expansion + masked_fill over the constrained rows (the CPU / fallback path);
- xgrammar_ms: xgrammar's fused apply_token_bitmask_inplace kernel (CUDA/Triton on a GPU, C++ on CPU);
- step_ms: what a step pays on the rank: the host bitmask copied to the device, then the kernel
  (xgrammar where installed, else torch) via apply_token_bitmask;
- sampler_ms / sampler_masked_ms: the whole Sampler call on the same logits, without and with the mask;
- fill_ms: host side, one JSON-schema matcher per row filling its bitmask row, over a synthetic
  byte-level vocabulary of --vocab tokens (what GrammarManager.bitmask does each step).
`exact` checks the xgrammar kernel against the torch path (True where xgrammar is missing).
Prints a table and, last, one JSON line; writes the JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.sampler import Sampler  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.scheduler_output import ScheduledSeq, TokenBitmask  # noqa: E402
from workers.structured_output import apply_bitmask_xgrammar, apply_bitmask_torch, apply_token_bitmask  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def _median_ms(fn, device: str, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _random_bitmask(batch: int, vocab: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(batch, -(-vocab // 32) * 32, generator=g) < density  # [B, 32 W]
    weights = (1 << torch.arange(32, dtype=torch.int64))
    words = (allowed.view(batch, -1, 32).long() * weights).sum(-1)  # [B, W] as unsigned
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _fill_ms(batch: int, vocab: int, iters: int) -> float | None:
    """Host: GrammarManager-style fill of `batch` rows from JSON-schema matchers, each a few tokens in."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    g = torch.Generator().manual_seed(0)
    alphabet = [chr(c) for c in range(32, 127)]
    vocab_strs = [bytes([b]).decode("latin-1") if b >= 32 else f"<0x{b:02X}>" for b in range(256)]
    while len(vocab_strs) < vocab:  # multi-character tokens, like a BPE vocabulary's
        n = int(torch.randint(2, 9, (1,), generator=g))
        vocab_strs.append("".join(alphabet[int(i)] for i in torch.randint(0, len(alphabet), (n,), generator=g)))
    info = xgr.TokenizerInfo(vocab_strs[:vocab], vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for m in matchers:
        m.accept_string('{"name": "ab')  # inside a string: many tokens allowed, the costly case
    bitmask = torch.zeros(batch, -(-vocab // 32), dtype=torch.int32)

    def fill():
        for k, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, k)

    return _median_ms(fill, "cpu", iters)


def run(device: str, batch: int, vocab: int, iters: int, density: float, dtype: str = "float32") -> dict:
    torch.manual_seed(0)
    logits = (torch.randn(batch, vocab, device=device) * 4).to(getattr(torch, dtype))
    host_mask = _random_bitmask(batch, vocab, density, seed=1)
    dev_mask = host_mask.to(device)
    rows = list(range(batch))
    seqs = [ScheduledSeq(str(i), [0], 0, [], True, SamplingParams(temperature=0.0), 1) for i in range(batch)]
    mask = TokenBitmask([s.seq_id for s in seqs], host_mask)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "batch": batch,
                    "vocab": vocab, "dtype": dtype, "allowed_fraction": density}

    work = logits.clone()
    result["torch_ms"] = _median_ms(lambda: apply_bitmask_torch(work.copy_(logits), dev_mask, rows), device, iters)
    reference = logits.clone()
    apply_bitmask_torch(reference, dev_mask, rows)
    result["xgrammar_ms"], result["exact"] = None, True
    if apply_bitmask_xgrammar(work.copy_(logits), host_mask, rows):
        result["exact"] = bool(torch.equal(work, reference))
        result["xgrammar_ms"] = _median_ms(lambda: apply_bitmask_xgrammar(work.copy_(logits), host_mask, rows), device, iters)
    copy_ms = _median_ms(lambda: work.copy_(logits), device, iters)
    result["copy_ms"] = copy_ms  # the logits copy each timed call above includes
    result["step_ms"] = _median_ms(lambda: apply_token_bitmask(work.copy_(logits), seqs, mask), device, iters)
    sampler = Sampler([0], seed=0)
    result["sampler_ms"] = _median_ms(lambda: sampler(logits, seqs), device, iters)
    result["sampler_masked_ms"] = _median_ms(
        lambda: sampler(apply_token_bitmask(work.copy_(logits), seqs, mask) or work, seqs), device, iters)
    result["fill_ms"] = _fill_ms(batch, vocab, max(2, iters // 4))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--allowed-fraction", type=float, default=0.5, help="share of the vocabulary each row allows")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="of the logits")
    p.add_argument("--dry-run", action="store_true", help="batch 4, vocab 1000, 3 iterations, on the CPU")
    p.add_argument("--out", default="bench_results/bench_structured_output.json")
    a = p.parse_args()
    if a.dry_run:
        a.device, a.batch, a.vocab, a.iters = "cpu", 4, 1000, 3
    result = {"benchmark": "structured_output", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              **run(a.device, a.batch, a.vocab, a.iters, a.allowed_fraction, a.dtype)}
    print(f"{result['device']}: batch {a.batch}, vocab {a.vocab}, {a.dtype} logits, ms per step (median of {a.iters})")
    for key in ("torch_ms", "xgrammar_ms", "copy_ms", "step_ms", "sampler_ms", "sampler_masked_ms", "fill_ms"):
        value = result[key]
        print(f"  {key:<18} {'n/a' if value is None else f'{value:.4f}'}")
    if not a.dry_run:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
