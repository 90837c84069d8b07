"""Dummy weights for quantized layers (load_format="dummy", benchmarks): random weights of the layer's
shapes, quantized by round-to-nearest (rtn.py, the code scripts/quantize.py writes checkpoints with)
into the method's checkpoint layout and copied into its parameters as a checkpoint would be."""
from __future__ import annotations

import torch
from torch import nn

from parallel.quant.base import QuantConfig, units
from parallel.quant.rtn import FP8_MAX, Options, quantize

# Static FP8 activation scale of dummy weights: activations up to +-16 (RMS-normed hidden states and the
# small products of uniform(-1e-2, 1e-2) weights stay well inside) keep e4m3's full precision.
DUMMY_INPUT_SCALE = 16.0 / FP8_MAX


def rtn_options(cfg: QuantConfig | None) -> Options | None:
    """The RTN options that write `cfg`'s layout; None where the layer loads plain weights (online FP8)."""
    if cfg is None or getattr(cfg, "online", None):
        return None
    if cfg.name == "gptq":
        return Options("gptq", bits=cfg.bits, group_size=cfg.group_size, sym=cfg.sym)
    if cfg.name == "awq":
        return Options("awq", group_size=cfg.group_size)
    if cfg.block is not None:
        return Options("fp8", block=cfg.block, fp8_scale="block")
    return Options("fp8", fp8_scale="channel")


@torch.no_grad()
def fill_dummy_quantized(layer: nn.Module, o: Options, gen: torch.Generator, cache: dict) -> None:
    """Each fused projection of this rank (layer.out_shards) gets a random [rows, in_per_rank] weight,
    quantized; layers of the same shapes share one (cache) so an 8B model quantizes in seconds."""
    device = next(layer.parameters()).device
    for i, rows in enumerate(layer.out_shards):
        key = (rows, layer.in_per_rank)
        if key not in cache:
            w = torch.empty(rows, layer.in_per_rank, device=device).uniform_(-1e-2, 1e-2, generator=gen)
            cache[key] = quantize(w, o)[0]
        for name, t in cache[key].items():
            p = getattr(layer, name)
            dst = p.data
            if p.out_dim is not None:
                first = sum(units(s, p.out_unit, p.ceil, "output features") for s in layer.out_shards[:i])
                dst = dst.narrow(p.out_dim, first, units(rows, p.out_unit, p.ceil, "output features"))
            if name == "g_idx":  # groups are numbered from this rank's first (row-parallel, split groups)
                t = t + layer.gptq_group_offset
            if t.dim() == 0:  # per-tensor scale: every row of the projection
                t = t.expand(dst.shape)
            if dst.shape != t.shape:
                raise ValueError(f"dummy quantized weights: {name} of shape {tuple(t.shape)} does not fit {tuple(dst.shape)} "
                                 f"on this rank (use a checkpoint written by scripts/quantize.py)")
            dst.copy_(t)
    if hasattr(layer, "input_scale"):  # FP8 activation_scheme "static": RTN has no activations to calibrate on
        layer.input_scale.data.fill_(DUMMY_INPUT_SCALE)
        layer.input_scale.loaded_slots = set(range(layer.input_scale.numel()))
