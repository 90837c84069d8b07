"""Build a model on the meta device, materialise this rank's shard, and fill it from safetensors.

Only tensors that map to a local parameter are read (pipeline stages skip other stages' layers; EP
ranks skip non-local experts), and each parameter's `weight_loader` narrows to its own shard. A
tensor that no rank would consume (e.g. a `weight_scale_inv` of an FP8 checkpoint whose config.json
lacks its quantization_config) is an error, never silently dropped. Quantized checkpoints are
detected from config.json's `quantization_config` alone (parallel/quant).
"""
from __future__ import annotations

import copy
import glob
import logging
import json
import os
import re

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig

from parallel.linear import default_weight_loader
from parallel.quant.base import LinearMethod
from parallel.quant.dummy import fill_dummy_quantized, rtn_options
from workers.models import build_model
from workers.models.transformer import CausalLM

log = logging.getLogger(__name__)


def load_hf_config(path: str):
    return AutoConfig.from_pretrained(path, local_files_only=True)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors in {path!r} (only safetensors checkpoints are supported; or use load_format='dummy')")
    return files


def load_model(hf_config, model_path: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               load_format: str = "auto", seed: int = 0, show_progress: bool = True,
               quantization_config: dict | None | str = "checkpoint") -> CausalLM:
    """quantization_config: what `ModelConfig.quantization_config()` resolved (the checkpoint's, or an
    online / dummy one); "checkpoint" keeps hf_config's own."""
    if quantization_config != "checkpoint":
        hf_config = copy.copy(hf_config)
        hf_config.quantization_config = quantization_config
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build_model(hf_config, max_positions)
    finally:
        torch.set_default_dtype(previous)
    materialize(model, device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        load_safetensors(model, checkpoint_files(model_path), show_progress)
    torch.set_default_dtype(dtype)  # the activations' dtype, for the kernels' load-time tuning
    try:
        process_weights(model)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@torch.no_grad()
def process_weights(model: torch.nn.Module) -> None:
    """After loading: online quantization, and on CUDA the quantized kernels' weight layout (parallel/quant)."""
    kernels: dict[tuple[str, str], list[str]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod) and method.quantized:
            method.process_weights(module)
            why = getattr(module, "tinygemm_skipped", None)
            kernel = getattr(module, "linear_kernel", type(method).__name__)
            kernels.setdefault((kernel + (f" [not tinygemm: {why}]" if why else ""), name.split(".")[-1]), []).append(name)
            log.debug("%s: %s", name, kernel)
    for (kernel, kind), names in kernels.items():  # one line per kernel and projection kind
        log.info("quantized linear kernel: %s x%d: %s", kind, len(names), kernel)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Replace meta parameters/buffers by uninitialised ones on `device`, keeping tied parameters tied
    and each parameter's attributes (its `weight_loader`), which `Module.to_empty` would drop."""
    new: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                q = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
                q.__dict__.update(p.__dict__)
                new[id(p)] = q
            module._parameters[name] = new[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=device)


def load_safetensors(model: CausalLM, files: list[str], show_progress: bool = True) -> None:
    loaded: set[int] = set()
    with tqdm(total=len(files), desc="Loading safetensors", unit="file", disable=not show_progress) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = model.checkpoint_target(name)
                    if target is None:
                        if not _belongs_elsewhere(model, name):
                            raise ValueError(f"checkpoint tensor {name!r} is not used by the model{_quant_hint(model, name)}")
                        continue
                    param, args = target
                    loader = getattr(param, "weight_loader", default_weight_loader)
                    try:
                        loader(param, f.get_tensor(name), *args)
                    except ValueError as e:
                        raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
                    loaded.add(id(param))
            bar.update(1)
    missing = [n for n, p in model.named_parameters() if id(p) not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:5]}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _belongs_elsewhere(model: CausalLM, name: str) -> bool:
    """A tensor another rank loads (other pipeline stages' layers, head or embedding; other EP ranks'
    experts), or a buffer HF saved that Tandem recomputes (rotary inv_freq)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = _LAYER.match(name)
    if m and int(m.group(1)) not in model.layer_range:
        return 0 <= int(m.group(1)) < model.config.num_hidden_layers
    expert = model._EXPERT.match(name)
    if expert:  # a local layer's expert that lives on another EP rank (a tensor this model has no parameter for is not)
        kind = "w2" if expert.group(3) in ("w2", "down_proj") else "w13"
        suffix = "" if expert.group(4) == "weight" else "_scale"
        return f"layers.{name.split('.')[2]}.mlp.experts.{kind}{suffix}" in model._params()
    if name.startswith("lm_head."):
        return model.lm_head is None
    if name.startswith("model.norm."):
        return model.norm is None
    if name.startswith("model.embed_tokens."):
        return model.embed_tokens is None
    return False


def _quant_hint(model: CausalLM, name: str) -> str:
    if getattr(model, "quant_config", None) is None and name.rsplit(".", 1)[-1] in (
            "weight_scale_inv", "weight_scale", "input_scale", "qweight", "qzeros", "scales", "g_idx"):
        return " (it belongs to a quantized checkpoint, but config.json has no quantization_config)"
    return ""


@torch.no_grad()
def fill_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights of the real shapes, made on the target device (for benchmarks of models we cannot download).
    Quantized layers get random weights quantized by round-to-nearest into their checkpoint layout."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    quantized: set[int] = set()
    rtn_cache: dict = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod) and method.quantized and rtn_options(model.quant_config) is not None:
            fill_dummy_quantized(module, rtn_options(model.quant_config), gen, rtn_cache)
            quantized.update(id(p) for p in module.parameters() if p is not getattr(module, "bias", None))
    for module in model.modules():
        if hasattr(module, "fill_dummy") and getattr(module, "fp8", False):  # FP8 experts: e4m3 codes and their scales
            module.fill_dummy(gen)
            quantized.update(id(p) for p in module.parameters())
    for name, p in model.named_parameters():
        if id(p) in quantized:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            # Small uniform values keep activations finite in fp16/bf16 through many layers.
            p.uniform_(-1e-2, 1e-2, generator=gen)
