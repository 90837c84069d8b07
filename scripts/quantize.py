"""Write a quantized copy of a Hugging Face model folder, in the published checkpoint layouts Tandem
loads from config.json alone (parallel/quant): GPTQ (RTN), AWQ (RTN, GEMM packing) and FP8.

    python scripts/quantize.py SRC DST --method gptq --bits 4 --group-size 128 [--asym] [--desc-act]
    python scripts/quantize.py SRC DST --method awq --group-size 128
    python scripts/quantize.py SRC DST --method fp8 [--block 128 128 | --fp8-scale tensor | --fp8-scale channel]
        [--activation-scheme static --calibration-text FILE]   (tensor/channel: static activation scales)
    ... --dequantized-out REF      also write REF: the same model with every quantized weight replaced by
                                   its dequantized float32 value, as a plain checkpoint (the reference that
                                   Hugging Face transformers runs in the tests)

Only the decoder's linear layers are quantized (q/k/v/o, gate/up/down); embeddings, norms and the LM
head are copied unchanged, unless `--lm-head` (GPTQ): the LM head is then quantized as the decoder's
linears are and config.json says `"lm_head": true`, as GPTQModel writes it (an untied head only, with a
vocabulary that packs: a multiple of 32 / bits). The dequantized reference is computed from the integer codes before they
are packed, so a packing bug in this tool or an unpacking bug in the loader shows up as a mismatch.

Without calibration data this is round-to-nearest (RTN); `--desc-act` then orders each group of input
features by the column norms of the projections sharing that input (q/k/v; gate/up), a stand-in for
GPTQ's Hessian diagonal. With `--calibration-text FILE` (GPTQ only) it is GPTQ proper (Frantar et al.
2022): the model runs in Hugging Face transformers on --nsamples windows of --seqlen tokens of that text,
layer by layer (each layer sees the already quantized earlier ones), accumulating H = X^T X of every
linear layer's input; each weight is then quantized column by column (act order: by decreasing H
diagonal), each column's rounding error spread over the columns not yet quantized through the
Cholesky factor of H^-1 (damped by --damp of its mean diagonal). Group scales and zeros are taken
from the error-updated weights as each group starts, and written in the same GPTQ format.

FP8 with `--activation-scheme static` (per-tensor or per-channel weights) runs the unquantized model on
the calibration windows and writes each linear layer's `input_scale` = max |input| / 448, float32 [],
as FP8 checkpoints with static activations carry it (vLLM's layout); the weights are RTN as above.

    python scripts/quantize.py models/tandem-tiny /tmp/tiny-gptq --method gptq --group-size 64 \
        --calibration-text corpus.txt --nsamples 32 --seqlen 256
`scripts/perplexity.py` compares the resulting models' perplexity on held-out text.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.quant.rtn import (AWQ_ORDER, FP8_MAX, Options, gptq_group_params, gptq_tensors, pack_cols, pack_rows,  # noqa: F401
                                quantize_awq, quantize_fp8, quantize_gptq)

QUANTIZABLE = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")
# MoE experts (Qwen3-MoE's mlp.experts.E.*_proj, Mixtral's block_sparse_moe.experts.E.w1/w2/w3): FP8 only.
EXPERT = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# Projections that read the same input share one act-order permutation (GPTQ's Hessian is per input).
_SIBLINGS = {"self_attn.q_proj": ("q", "k", "v"), "self_attn.k_proj": ("q", "k", "v"), "self_attn.v_proj": ("q", "k", "v"),
             "mlp.gate_proj": ("gate", "up"), "mlp.up_proj": ("gate", "up")}


def _act_order(siblings: list[torch.Tensor]) -> torch.Tensor:
    """A permutation of the input features, largest column norm first over every projection of this input."""
    norms = torch.cat(siblings, 0).float().norm(dim=0)  # [in]
    return torch.argsort(norms, descending=True, stable=True)


# ---------------------------------------------------------------- GPTQ with calibration data


def gptq_solve(w: torch.Tensor, h: torch.Tensor, o: Options, damp: float = 0.01, block: int = 128
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ of one weight [out, in] given H = X^T X [in, in] of its inputs -> (checkpoint tensors, dequantized)."""
    w = w.float().clone()
    out, n = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if o.desc_act else torch.arange(n)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(n, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    gs = n if o.group_size == -1 else o.group_size
    maxq = 2**o.bits - 1
    groups = -(-n // gs)
    scales = torch.empty(groups, out)
    zeros = torch.empty(groups, out, dtype=torch.int64)
    codes = torch.empty(out, n, dtype=torch.int64)  # in permuted order
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1, err1, h1 = w[:, i1:i2].clone(), torch.zeros(out, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:  # a group starts: its scale/zero from the weights as updated so far
                cols = torch.cat([w1[:, i:], w[:, i2:]], 1)[:, :gs]
                scales[col // gs], zeros[col // gs] = gptq_group_params(cols, o.bits, o.sym)
            s, z = scales[col // gs], zeros[col // gs]
            q = torch.clamp(torch.round(w1[:, i] / s) + z, 0, maxq)
            codes[:, col] = q.to(torch.int64)
            err = (w1[:, i] - (q - z) * s) / h1[i, i]
            w1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    g_idx = torch.empty(n, dtype=torch.int64)
    g_idx[perm] = torch.arange(n) // gs  # groups are runs of the (act) order
    q = torch.empty_like(codes)
    q[:, perm] = codes  # back to the input features' order
    deq = (q - zeros[g_idx].t()).float() * scales[g_idx].t()
    return gptq_tensors(q, scales, zeros, g_idx, o.bits), deq


_INPUT_OWNERS = {"self_attn.q_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}


@torch.no_grad()
def calibrated_gptq(src: str, o: Options, samples: list[list[int]], damp: float = 0.01) -> dict[str, tuple]:
    """Checkpoint name -> (tensors, dequantized) for every decoder linear weight (and the LM head with
    o.lm_head), quantized layer by layer with each layer's inputs computed through the layers quantized
    before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    batch = torch.tensor(samples)
    results: dict[str, tuple] = {}
    hess: dict[str, torch.Tensor] = {}  # H = X^T X of each input, the current layer's

    def hook(name):
        def fn(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            hess[name] = hess.get(name, 0) + x.t() @ x
        return fn

    for i, layer in enumerate(model.model.layers):
        hess.clear()
        handles = [layer.get_submodule(owner).register_forward_pre_hook(hook(owner)) for owner in _INPUT_OWNERS]
        model(batch)
        for handle in handles:
            handle.remove()
        for owner, names in _INPUT_OWNERS.items():
            for name in names:
                module = layer.get_submodule(name)
                tensors, deq = gptq_solve(module.weight, hess[owner], o, damp)
                module.weight.copy_(deq)  # later layers see this layer quantized
                results[f"model.layers.{i}.{name}.weight"] = (tensors, deq)
    if o.lm_head:  # its input is the final norm's output of the quantized decoder
        hess.clear()
        handle = model.lm_head.register_forward_pre_hook(hook("lm_head"))
        model(batch)
        handle.remove()
        results[HEAD] = gptq_solve(model.lm_head.weight, hess["lm_head"], o, damp)
    return results


@torch.no_grad()
def activation_input_scales(src: str, samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """FP8 static activations: checkpoint name (`...q_proj.input_scale`) -> max |input| / FP8_MAX over the
    calibration windows, float32 [], for every decoder linear layer, measured on the unquantized model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_module, args):
            amax[name] = torch.maximum(amax.get(name, torch.zeros(())), args[0].detach().abs().max().float())
        return fn

    handles = [module.register_forward_pre_hook(hook(f"model.{name}.input_scale"))
               for name, module in model.model.named_modules() if QUANTIZABLE.match(f"model.{name}.weight")]
    model(torch.tensor(samples))
    for handle in handles:
        handle.remove()
    return {name: (a / FP8_MAX).clamp(min=1e-12) for name, a in amax.items()}


def calibration_samples(tokenizer_dir: str, text: str, n: int, seqlen: int, seed: int = 0) -> list[list[int]]:
    """n random windows of seqlen tokens of `text`."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"]
    if len(ids) < seqlen + 1:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one window of {seqlen}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (n,), generator=g).tolist()
    return [ids[s:s + seqlen] for s in starts]


# ---------------------------------------------------------------- the folder


def _tensor_files(src: str) -> dict[str, str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    names: dict[str, str] = {}
    for fname in sorted(os.listdir(src)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(src, fname), framework="pt") as f:
                names.update({k: fname for k in f.keys()})
    return names


HEAD = "lm_head.weight"


def _quantize_one(name: str, w: torch.Tensor, o: Options, get) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if o.method == "fp8":
        return quantize_fp8(w, o)
    if o.method == "awq":
        return quantize_awq(w, o)
    perm = None
    if o.desc_act and name == HEAD:
        perm = _act_order([w])
    elif o.desc_act:
        m = QUANTIZABLE.match(name)
        prefix, module = m.group(1), m.group(2)
        kind = module.split(".")[0]
        sib = _SIBLINGS.get(module)
        names = [f"{prefix}{kind}.{s}_proj.weight" for s in sib] if sib else [name]
        perm = _act_order([get(n) for n in names])
    return quantize_gptq(w, o, perm)


def quantize_folder(src: str, dst: str, o: Options, dequantized_out: str | None = None,
                    calibration: list[list[int]] | None = None, damp: float = 0.01) -> None:
    """calibration: token windows for GPTQ proper (else round-to-nearest)."""
    o.check()
    static = o.activation_scheme == "static"
    if calibration is not None and o.method != "gptq" and not static:
        raise ValueError("calibration data is used by --method gptq and FP8 static activations only "
                         "(AWQ and FP8 weights here are round-to-nearest)")
    if static and calibration is None:
        raise ValueError("FP8 static activation scales need calibration data (--calibration-text)")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if o.lm_head:
        _check_head(config, o)
    moe = any(config.get(k) for k in ("num_experts", "num_local_experts"))
    if moe and (o.method != "fp8" or static):
        raise ValueError("MoE models: this tool writes FP8 with dynamic activations only (experts included)")
    solved = calibrated_gptq(src, o, calibration, damp) if calibration is not None and o.method == "gptq" else {}
    input_scales = activation_input_scales(src, calibration) if static else {}
    files = _tensor_files(src)
    if o.lm_head and HEAD not in files:
        raise ValueError(f"--lm-head: {src} has no {HEAD} tensor to quantize")
    handles = {f: safe_open(os.path.join(src, f), framework="pt") for f in sorted(set(files.values()))}
    get = lambda n: handles[files[n]].get_tensor(n)  # noqa: E731
    out_files: dict[str, dict[str, torch.Tensor]] = {f: {} for f in handles}
    ref_files: dict[str, dict[str, torch.Tensor]] = {f: {} for f in handles}
    for name, fname in files.items():
        t = get(name)
        if QUANTIZABLE.match(name) or (moe and EXPERT.match(name)) or (o.lm_head and name == HEAD):
            tensors, deq = solved[name] if name in solved else _quantize_one(name, t, o, get)
            base = name[: -len("weight")]
            out_files[fname].update({base + k: v.contiguous() for k, v in tensors.items()})
            if static:
                out_files[fname][base + "input_scale"] = input_scales[base + "input_scale"]
            ref_files[fname][name] = deq.contiguous()
        else:
            out_files[fname][name] = t
            ref_files[fname][name] = t
    quantizer = f"tandem scripts/quantize.py (GPTQ, {len(calibration)} calibration windows)" if solved else "tandem scripts/quantize.py (RTN)"
    _write(src, dst, {**config, "quantization_config": o.quantization_config(quantizer)}, out_files)
    if dequantized_out:
        _write(src, dequantized_out, {**config, "dtype": "float32"}, ref_files)


def _check_head(config: dict, o: Options) -> None:
    """--lm-head: an untied head whose vocabulary packs into int32 words along the output dim (GPTQ's qzeros)."""
    if config.get("tie_word_embeddings"):
        raise ValueError("--lm-head: this model ties its LM head to the embeddings (tie_word_embeddings); "
                         "a tied head stays unquantized")
    pack = 32 // o.bits
    if config["vocab_size"] % pack:
        raise ValueError(f"--lm-head: vocab_size {config['vocab_size']} is not a multiple of {pack} "
                         f"({o.bits}-bit codes pack {pack} to an int32 word along the vocabulary)")


def _write(src: str, dst: str, config: dict, files: dict[str, dict[str, torch.Tensor]]) -> None:
    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):  # tokenizer, generation config, ...
        if not fname.endswith(".safetensors") and fname not in ("config.json", "model.safetensors.index.json") \
                and os.path.isfile(os.path.join(src, fname)):
            shutil.copy(os.path.join(src, fname), os.path.join(dst, fname))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for fname, tensors in files.items():
        save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
    if len(files) > 1:
        weight_map = {name: fname for fname, tensors in files.items() for name in tensors}
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--method", choices=["gptq", "awq", "fp8"], required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128, help="-1: one group per output row (GPTQ/AWQ)")
    p.add_argument("--asym", action="store_true", help="GPTQ: asymmetric (zero points) instead of symmetric")
    p.add_argument("--desc-act", action="store_true", help="GPTQ: act order (a permutation, stored as g_idx)")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], help="FP8 weight_block_size")
    p.add_argument("--fp8-scale", choices=["block", "tensor", "channel"], default="block")
    p.add_argument("--activation-scheme", choices=["dynamic", "static"], default="dynamic",
                   help="FP8 (tensor/channel): static writes each linear's input_scale from --calibration-text")
    p.add_argument("--lm-head", action="store_true",
                   help="GPTQ: quantize the (untied) LM head too; config.json then says lm_head: true")
    p.add_argument("--dequantized-out", help="also write the dequantized model here as a plain checkpoint")
    p.add_argument("--calibration-text", help="GPTQ proper, or FP8 static activation scales: a text file to draw "
                   "calibration windows from")
    p.add_argument("--nsamples", type=int, default=32, help="calibration windows")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, a fraction of H's mean diagonal")
    a = p.parse_args(argv)
    o = Options(a.method, a.bits, a.group_size, not a.asym, a.desc_act, tuple(a.block), a.fp8_scale, a.activation_scheme,
                a.lm_head)
    calib = None
    if a.calibration_text:
        with open(a.calibration_text, encoding="utf-8") as f:
            calib = calibration_samples(a.src, f.read(), a.nsamples, a.seqlen)
    quantize_folder(a.src, a.dst, o, a.dequantized_out, calib, a.damp)
    print(f"wrote {a.dst} ({o.quantization_config()['quant_method']})" + (f" and {a.dequantized_out}" if a.dequantized_out else ""))


if __name__ == "__main__":
    main()
