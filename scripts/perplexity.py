#!/usr/bin/env python3
"""Perplexity of a model and of quantized copies of it, on held-out text (issue 15: quality measured).

Each variant is written by scripts/quantize.py (with `--dequantized-out`: the same weights as a plain
float checkpoint, which the CPU tests show Tandem runs token for token like the quantized folder) and
scored by Hugging Face transformers in float32 over non-overlapping windows of the held-out text:
    ppl = exp(mean negative log-likelihood of every token after the first of each window)
For the shipped models/tandem-tiny (trained on the Python 3.11 standard library, every 25th file held
out) the default text is exactly that held-out set, and GPTQ's calibration windows come from the
training files; `--text FILE` / `--calibration-text FILE` take any local text instead.

    python scripts/perplexity.py --model models/tandem-tiny --out bench_results/perplexity.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from parallel.quant.rtn import Options  # noqa: E402
from quantize import calibration_samples, quantize_folder  # noqa: E402

# name -> (options, calibrated): 4-bit per group of 64 (704, tandem-tiny's MLP width, is no multiple of 128)
# and per channel, where GPTQ's error compensation matters most; 8 bit and FP8 for scale.
VARIANTS: dict[str, tuple[Options | None, bool]] = {
    "bf16": (None, False),
    "fp8-channel (RTN)": (Options("fp8", fp8_scale="channel"), False),
    "int8-g64 (RTN)": (Options("gptq", bits=8, group_size=64), False),
    "int4-g64 (RTN)": (Options("gptq", bits=4, group_size=64), False),
    "int4-g64 (GPTQ)": (Options("gptq", bits=4, group_size=64), True),
    "int4-g64-act (GPTQ)": (Options("gptq", bits=4, group_size=64, desc_act=True), True),
    "int4-channel (RTN)": (Options("gptq", bits=4, group_size=-1), False),
    "int4-channel (GPTQ)": (Options("gptq", bits=4, group_size=-1), True),
    "int4-channel-act (GPTQ)": (Options("gptq", bits=4, group_size=-1, desc_act=True), True),
    # The LM head quantized too (GPTQ `lm_head: true`; a tied head is first written untied: the same model)
    "int4-g64 + head (RTN)": (Options("gptq", bits=4, group_size=64, lm_head=True), False),
    "int4-g64 + head (GPTQ)": (Options("gptq", bits=4, group_size=64, lm_head=True), True),
}


def untied_copy(src: str, dst: str) -> str:
    """`src` with its LM head stored apart from the embeddings (`lm_head.weight`, a copy; tie_word_embeddings
    false): the same model, whose head scripts/quantize.py --lm-head can then quantize. `src` itself when untied."""
    import shutil

    from safetensors.torch import load_file, save_file

    cfg = json.loads(Path(src, "config.json").read_text())
    if not cfg.get("tie_word_embeddings"):
        return src
    if os.path.isdir(dst):  # written already by this run
        return dst
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"untying a tied head reads one safetensors file; {src} has {len(files)}")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(os.path.join(src, files[0]))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, os.path.join(dst, files[0]), metadata={"format": "pt"})
    Path(dst, "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}, indent=2))
    return dst


def stdlib_split() -> tuple[str, str]:
    """tandem-tiny's corpus split (scripts/train_tiny_model.py): (training text, held-out text)."""
    from train_tiny_model import gather_corpus

    train, val, _, _ = gather_corpus(int(24.0 * 1e6), 200 * 1000, 25)
    return "\n".join(t for _, t in train[:60]), "\n".join(t for _, t in val)


@torch.no_grad()
def perplexity(model_dir: str, ids: list[int], seqlen: int, batch: int = 8) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windows = torch.tensor(ids[: len(ids) // seqlen * seqlen]).view(-1, seqlen)
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch]
        logits = model(x).logits[:, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "tandem-tiny"))
    p.add_argument("--text", help="held-out text file (default: tandem-tiny's held-out stdlib files)")
    p.add_argument("--calibration-text", help="GPTQ calibration text (default: tandem-tiny's training files)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--max-tokens", type=int, default=65536, help="held-out tokens scored")
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--nsamples", type=int, default=32, help="GPTQ calibration windows of --seqlen tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench_results/perplexity.json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    from transformers import AutoTokenizer

    if a.text and a.calibration_text:
        held_out, calib_text = Path(a.text).read_text(encoding="utf-8"), Path(a.calibration_text).read_text(encoding="utf-8")
    else:
        calib_text, held_out = stdlib_split()
        held_out = Path(a.text).read_text(encoding="utf-8") if a.text else held_out
        calib_text = Path(a.calibration_text).read_text(encoding="utf-8") if a.calibration_text else calib_text
    ids = AutoTokenizer.from_pretrained(a.model)(held_out)["input_ids"][: a.max_tokens]
    calib = calibration_samples(a.model, calib_text, a.nsamples, a.seqlen)
    report = {"model": a.model, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "held_out_tokens": len(ids) // a.seqlen * a.seqlen, "seqlen": a.seqlen,
              "calibration": f"{a.nsamples} x {a.seqlen} tokens", "results": {}}
    work = tempfile.mkdtemp()
    for name in variants:
        opts, calibrated = VARIANTS[name]
        t0 = time.perf_counter()
        if opts is None:
            ref = a.model
        else:
            ref = os.path.join(work, f"ref-{len(report['results'])}")
            src = untied_copy(a.model, os.path.join(work, "untied")) if opts.lm_head else a.model
            quantize_folder(src, os.path.join(work, f"q-{len(report['results'])}"), opts, ref,
                            calib if calibrated else None)
        ppl = perplexity(ref, ids, a.seqlen)
        report["results"][name] = {"perplexity": ppl, "seconds": time.perf_counter() - t0}
        print(f"{name:<26} ppl {ppl:8.3f}   ({time.perf_counter() - t0:.1f} s)", flush=True)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
