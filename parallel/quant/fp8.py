"""FP8 (`quant_method: fp8`, e4m3 weights), run dequantized.

Published layouts, per linear layer:
    weight            float8_e4m3fn [out, in]
    block-wise (`weight_block_size` [bn, bk], the Qwen3 / DeepSeek FP8 releases):
    weight_scale_inv  float32 [ceil(out / bn), ceil(in / bk)]   w = weight * scale_inv of its block
    otherwise:
    weight_scale      float32 [] / [1] per tensor, or [out] / [out, 1] per channel   w = weight * scale
Online (`quantization="fp8"` on a 16/32-bit checkpoint; config key `tandem_online`: "channel" or
"tensor"): the plain weight loads as usual and is quantized at load, w / scale in e4m3 with a
per-output-channel (or per-tensor) float32 scale, the layout of the per-channel checkpoints above.
Activations (`activation_scheme`): "dynamic" quantizes them per token on the W8A8 path
(parallel/quant/packed.py); "static" (per-tensor or per-channel weight scales only, as in vLLM) reads
one calibrated `input_scale` float32 [] / [1] per linear and uses it instead: x_fp8 = clamp(x / s). A
fused layer (q/k/v, gate/up: one input) takes the largest of its projections' scales, as vLLM does.
On CPU, and on CUDA where the W8A8 GEMM does not run (1-4 rows, non-bf16 activations), weights run
dequantized with activations unquantized, static or not: output equals the dequantized model's.
Fused projections (q/k/v, gate/up) keep one block-scale row range per projection, since each was
quantized on its own; a ragged last block is allowed on one rank, but under TP every rank's slice
must start on a block boundary.
"""
from __future__ import annotations

import torch

from parallel.quant.base import LinearMethod, QuantConfig, quant_param, units
from parallel.quant.config import check_plain_modules
from parallel.quant.packed import from_fp8
from parallel.quant.rtn import FP8_MAX, fp8_scale


ONLINE_KEY = "tandem_online"


def online_fp8_config(granularity: str = "channel") -> dict:
    """The quantization_config of a checkpoint quantized to FP8 at load (`quantization="fp8"`)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", ONLINE_KEY: granularity}


class FP8Config(QuantConfig):
    name = "fp8"

    def __init__(self, block: tuple[int, int] | None, online: str | None = None, static_act: bool = False):
        self.block, self.online, self.static_act = block, online, static_act

    @classmethod
    def from_config(cls, qc: dict) -> "FP8Config":
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme={scheme!r} is not supported ('dynamic' or 'static')")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt={fmt!r} is not supported (e4m3)")
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"FP8 weight_block_size={block!r} is not supported (two positive ints, e.g. [128, 128])")
            block = (block[0], block[1])
        check_plain_modules(qc, "modules_to_not_convert")
        check_plain_modules(qc, "ignored_layers")
        online = qc.get(ONLINE_KEY)
        if online is not None and (online not in ("channel", "tensor") or block is not None):
            raise ValueError(f"FP8 {ONLINE_KEY}={online!r} is not supported ('channel' or 'tensor', without weight_block_size)")
        if scheme == "static" and (block is not None or online is not None):
            # vLLM's rule too: block-wise FP8 quantizes activations per token group, never with one static scale.
            raise ValueError("FP8 activation_scheme='static' is supported with per-tensor or per-channel weight_scale "
                             "only, not with weight_block_size (block-wise FP8 takes dynamic activations)")
        return cls(block, online, static_act=scheme == "static")

    def linear_method(self) -> "FP8LinearMethod":
        return FP8LinearMethod(self)


class FP8LinearMethod(LinearMethod):
    def __init__(self, cfg: FP8Config):
        self.cfg = cfg

    def create_weights(self, layer, in_per_rank, out_per_rank, in_full):
        load = layer.weight_loader
        if self.cfg.online:  # the checkpoint's plain weight; quantized in process_weights
            layer.weight = quant_param((out_per_rank, in_per_rank), torch.get_default_dtype(), load, out_dim=0, in_dim=1)
            return
        layer.weight = quant_param((out_per_rank, in_per_rank), torch.float8_e4m3fn, load, out_dim=0, in_dim=1)
        if self.cfg.block is None:
            layer.weight_scale = quant_param((out_per_rank, 1), torch.float32, load, out_dim=0, scalar_ok=True)
            if self.cfg.static_act:  # one per fused projection; every rank holds them all (one input, not split)
                layer.input_scale = quant_param((len(layer.out_shards),), torch.float32, _input_scale_loader(layer))
            return
        bn, bk = self.cfg.block
        if layer.tp_size > 1:
            # A rank's slice must begin on a block boundary, or its first block's scale is another rank's.
            for size in layer.out_shards:
                units(size, bn, False, "FP8 output features per rank vs weight_block_size[0]")
            if layer.row_parallel:
                units(in_per_rank, bk, False, "FP8 input features per rank vs weight_block_size[1]")
        rows = sum(units(s, bn, True, "") for s in layer.out_shards)
        layer.weight_scale_inv = quant_param((rows, units(in_per_rank, bk, True, "")), torch.float32, load,
                                             out_dim=0, out_unit=bn, in_dim=1, in_unit=bk, ceil=True)
        layer.register_buffer("fp8_scale_rows", torch.empty(out_per_rank, dtype=torch.long), persistent=False)
        layer.register_buffer("fp8_scale_cols", torch.empty(in_per_rank, dtype=torch.long), persistent=False)

    def init_buffers(self, layer):
        if self.cfg.block is None or self.cfg.online:
            return
        bn, bk = self.cfg.block
        # Row r of fused projection s uses scale row (rows of earlier projections) + r // bn.
        rows, base = [], 0
        for size in layer.out_shards:
            rows.append(base + torch.arange(size) // bn)
            base += -(-size // bn)
        device = layer.fp8_scale_rows.device
        layer.fp8_scale_rows = torch.cat(rows).to(device)
        layer.fp8_scale_cols = (torch.arange(layer.fp8_scale_cols.numel()) // bk).to(device)

    def dequantize(self, layer):
        w = layer.weight.float()  # [out, in]
        if self.cfg.block is None:
            return w * layer.weight_scale  # [out, 1] broadcast over in
        scale = layer.weight_scale_inv.index_select(0, layer.fp8_scale_rows).index_select(1, layer.fp8_scale_cols)
        return w * scale

    def process_weights(self, layer):
        if self.cfg.static_act:
            layer.input_scale = torch.nn.Parameter(static_input_scale(layer.input_scale), requires_grad=False)
        if self.cfg.online:
            w = layer.weight.float()
            scale = fp8_scale(w, self.cfg.online).expand(w.shape[0], 1).contiguous()  # [out, 1]
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            del w
        super().process_weights(layer)

    def pack(self, layer):
        if self.cfg.block is None:  # per-channel (a per-tensor scale was broadcast to every row at load)
            return from_fp8(layer.weight, layer.weight_scale, layer.weight.shape[1], per_channel=True,
                            input_scale=layer.input_scale if self.cfg.static_act else None)
        # [out, ceil(in / bk)]: each row's scale per block of bk input features
        return from_fp8(layer.weight, layer.weight_scale_inv.index_select(0, layer.fp8_scale_rows), self.cfg.block[1],
                        per_channel=False)


def _input_scale_loader(layer):
    """Loads a projection's per-tensor `input_scale` into its slot of the layer's [projections] vector."""
    def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if not loaded.dtype.is_floating_point or loaded.numel() != 1:
            raise ValueError(f"input_scale must be one float per tensor (a static per-tensor activation scale), "
                             f"got {loaded.dtype} of shape {tuple(loaded.shape)}")
        idx, _ = layer.out_slice(shard_id)
        param.data[idx] = loaded.reshape(()).float()
        param.loaded_slots = getattr(param, "loaded_slots", set()) | {idx}  # checked in static_input_scale
    return load


def static_input_scale(per_projection: torch.nn.Parameter) -> torch.Tensor:
    """The layer's one activation scale, float32 [1]: the largest of its projections' (they share the input,
    so a scale that fits the widest calibrated range fits all). A projection without one (the loader only
    checks that the parameter got something), or zero, negative or non-finite values, are refused: x / s
    would be inf or NaN in every activation."""
    missing = set(range(per_projection.numel())) - getattr(per_projection, "loaded_slots", set())
    if missing:
        raise ValueError(f"FP8 activation_scheme='static' but the checkpoint has no input_scale for projection(s) "
                         f"{sorted(missing)} of this fused layer")
    scale = per_projection.float().max().reshape(1)
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"FP8 input_scale must be positive and finite, got {per_projection.tolist()}")
    return scale
