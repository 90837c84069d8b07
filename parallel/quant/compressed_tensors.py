"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, what llm-compressor writes): the FP8
schemes, read as the FP8 method they are (parallel/quant/fp8.py).

Accepted: one config group whose `targets` is ["Linear"], `float-quantized` (or `naive-quantized`) format,
8-bit float weights, symmetric, with `strategy` channel (`weight_scale` [out, 1]), tensor ([] / [1]) or
block (`block_structure` [bn, bk], `weight_scale` [ceil(out / bn), ceil(in / bk)], which the FP8 method
names `weight_scale_inv`), and input activations 8-bit float, either dynamic per token (FP8-Dynamic; per
token group for blocks) or static per tensor (`input_scale`, channel/tensor weights only). `ignore` may
name only modules Tandem keeps unquantized anyway (lm_head, embeddings, norms, MoE routers); a regex there
is tried on the decoder's projection names and refused if it would leave one of them in full precision.
Everything else (INT8 W8A8, INT4/WNA16 packs, NVFP4, weight-only FP8, several groups) is a ValueError that
names it: loading it as plain or as something else would generate garbage.
"""
from __future__ import annotations

import re
from typing import Any

from parallel.quant.fp8 import FP8Config

# Decoder projections that a compressed-tensors `ignore` entry must not name (they are quantized here).
_PROJECTIONS = tuple(f"model.layers.0.{p}" for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.0.down_proj",
    "block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w2", "block_sparse_moe.experts.0.w3"))
_PLAIN = ("lm_head", "embed_tokens", "norm", "gate", "mlp.gate", "block_sparse_moe.gate")
_FORMATS = ("float-quantized", "naive-quantized")


class CompressedTensorsFP8Config(FP8Config):
    """The FP8 method, reading a block-wise checkpoint's `weight_scale` as `weight_scale_inv` (same tensor)."""

    name = "compressed-tensors"

    def checkpoint_name(self, name: str) -> str:
        if self.block is not None and name.endswith(".weight_scale"):
            return name + "_inv"
        return name


def _refuse(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {what} is not supported; Tandem loads its FP8 schemes "
                      "(FP8-Dynamic per channel / per tensor / block, FP8 per tensor or channel with static activations)")


def _check_ignore(ignore: list) -> None:
    for entry in ignore or []:
        entry = str(entry)
        if entry.startswith("re:"):
            pattern = re.compile(entry[3:])
            hit = next((p for p in _PROJECTIONS if pattern.fullmatch(p) or pattern.match(p)), None)
            if hit is not None:
                raise _refuse(f"ignore entry {entry!r} (it leaves {hit.split('.', 3)[-1]} unquantized)")
        elif not any(entry == p or entry.endswith("." + p) for p in _PLAIN):
            raise _refuse(f"ignore entry {entry!r} (a linear layer left unquantized)")


def compressed_tensors_config(qc: dict[str, Any]) -> CompressedTensorsFP8Config:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"{len(groups)} config_groups (one is)")
    group = next(iter(groups.values()))
    fmt = group.get("format") or qc.get("format")
    if fmt not in _FORMATS:
        raise _refuse(f"format {fmt!r}")
    if qc.get("quantization_status", "compressed") not in ("compressed", "frozen"):
        raise _refuse(f"quantization_status {qc.get('quantization_status')!r}")
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"targets {group.get('targets')!r} (only ['Linear'])")
    if qc.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme (use kv_cache_dtype='fp8')")
    w, act = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(f"weights of type {w.get('type')!r} with {w.get('num_bits')} bits")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise _refuse("asymmetric or dynamic weights")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise _refuse(f"block_structure {bs!r}")
        block = (bs[0], bs[1])
    elif strategy not in ("channel", "tensor"):
        raise _refuse(f"weight strategy {strategy!r}")
    if not act:
        raise _refuse("FP8 weights without activation quantization (weight-only, W8A16)")
    if act.get("type") != "float" or act.get("num_bits") != 8:
        raise _refuse(f"input activations of type {act.get('type')!r} with {act.get('num_bits')} bits")
    static = not act.get("dynamic", False)
    if static and (block is not None or act.get("strategy") != "tensor"):
        raise _refuse(f"static input activations with strategy {act.get('strategy')!r} and {strategy} weights "
                      "(static ones are per tensor, with channel or tensor weights)")
    if not static and act.get("strategy") not in ("token", "group", "tensor"):
        raise _refuse(f"dynamic input activations with strategy {act.get('strategy')!r}")
    if group.get("output_activations"):
        raise _refuse("output activation quantization")
    _check_ignore(qc.get("ignore"))
    return CompressedTensorsFP8Config(block, static_act=static)
