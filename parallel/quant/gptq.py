"""GPTQ (AutoGPTQ / GPTQModel `checkpoint_format: gptq`), run dequantized.

Published layout, per linear layer with in / out features and G = ceil(in / group_size) groups
(G = 1 for group_size -1):
    qweight int32 [in / pack, out]   codes packed along the input dim, low bits first (pack = 32 / bits)
    qzeros  int32 [G, out / pack]    zero points packed along the output dim, stored minus one
    scales  fp16  [G, out]
    g_idx   int32 [in]               the group of each input feature (act order permutes them)
    w[o, i] = scales[g, o] * (q[i, o] - (qzeros[g, o] + 1)),  g = g_idx[i]
"""
from __future__ import annotations

import torch

from parallel.quant.base import LinearMethod, QuantConfig, quant_param, units
from parallel.quant.config import check_plain_modules
from parallel.quant.packed import from_int_codes


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 codes packed low bits first along `dim` -> one code per element (int32), dim grows by 32/bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [pack]
    x = packed.unsqueeze(dim + 1)  # [..., n, 1, ...]
    view = [1] * x.dim()
    view[dim + 1] = shifts.numel()
    # Arithmetic right shift sign-extends negative words; the mask keeps just this code's bits.
    codes = (x >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= shifts.numel()
    return codes.reshape(shape)


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, sym: bool, desc_act: bool):
        self.bits, self.group_size, self.sym, self.desc_act = bits, group_size, sym, desc_act
        self.pack = 32 // bits

    @classmethod
    def from_config(cls, qc: dict) -> "GPTQConfig":
        bits = qc.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"GPTQ bits={bits!r} is not supported (4 or 8)")
        group_size = qc.get("group_size", -1)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(f"GPTQ group_size={group_size!r} is not supported (a positive int or -1)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported (only 'gptq', zero points stored minus one)")
        lm_head = qc.get("lm_head", False)
        if not isinstance(lm_head, bool):
            raise ValueError(f"GPTQ lm_head={lm_head!r} is not supported (true or false)")
        if qc.get("dynamic"):
            raise ValueError("GPTQ 'dynamic' per-module overrides are not supported")
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ValueError(f"GPTQ pack_dtype={qc['pack_dtype']!r} is not supported (int32)")
        for key in ("modules_to_not_convert",):
            check_plain_modules(qc, key)
        if qc.get("modules_in_block_to_quantize"):
            raise ValueError("GPTQ modules_in_block_to_quantize (only some linear layers quantized) is not supported yet")
        cfg = cls(bits, group_size, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)))
        cfg.lm_head = lm_head  # GPTQModel's quantized LM head (parallel/embedding.py QuantizedLMHead)
        return cfg

    def linear_method(self) -> "GPTQLinearMethod":
        return GPTQLinearMethod(self)


class GPTQLinearMethod(LinearMethod):
    def __init__(self, cfg: GPTQConfig):
        self.cfg = cfg

    def create_weights(self, layer, in_per_rank, out_per_rank, in_full):
        c, load = self.cfg, layer.weight_loader
        gs = c.group_size if c.group_size != -1 else in_full
        # Scales and zeros follow the rank's input shard only when its groups are its own: with one
        # group, or act order (g_idx scatters any group over all of `in`), every rank keeps all of them.
        split_groups = layer.row_parallel and c.group_size != -1 and not c.desc_act
        if split_groups:
            groups = units(in_per_rank, gs, False, "GPTQ input features per rank vs group_size")
        else:
            groups = -(-in_full // gs)
        layer.gptq_group_offset = layer.tp_rank * groups if split_groups else 0
        g_dim = 0 if split_groups else None
        layer.qweight = quant_param((units(in_per_rank, c.pack, False, "GPTQ input features"), out_per_rank), torch.int32,
                                    load, in_dim=0, in_unit=c.pack, out_dim=1)
        layer.qzeros = quant_param((groups, units(out_per_rank, c.pack, False, "GPTQ output features")), torch.int32,
                                   load, in_dim=g_dim, in_unit=gs, out_dim=1, out_unit=c.pack)
        layer.scales = quant_param((groups, out_per_rank), torch.float32, load, in_dim=g_dim, in_unit=gs, out_dim=1)
        layer.g_idx = quant_param((in_per_rank,), torch.int32, load, in_dim=0)

    def dequantize(self, layer):
        c = self.cfg
        q = unpack_int32(layer.qweight, c.bits, 0)  # [in, out]
        z = unpack_int32(layer.qzeros, c.bits, 1) + 1  # [G, out]; the format stores zero - 1
        g = (layer.g_idx - layer.gptq_group_offset).long()  # [in] -> this rank's rows of scales/zeros
        w = (q - z[g]).float() * layer.scales[g]  # [in, out]
        return w.t()

    def pack(self, layer):
        c = self.cfg
        q = unpack_int32(layer.qweight, c.bits, 0)  # [in, out]
        z = unpack_int32(layer.qzeros, c.bits, 1) + 1
        g = (layer.g_idx - layer.gptq_group_offset).long()
        # One group (-1): any run length dividing this rank's inputs serves; the kernels' tiles need K-sized runs at most.
        gs = q.shape[0] if c.group_size == -1 else c.group_size
        return from_int_codes(q, z, layer.scales, g, c.bits, gs)

    def packed_params(self):
        return ("qweight", "qzeros", "scales", "g_idx")
