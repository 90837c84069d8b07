"""AWQ (AutoAWQ `version: gemm`, 4 bit, zero point), run dequantized.

Published layout, per linear layer with G = in / group_size groups:
    qweight int32 [in, out / 8]   eight 4-bit codes per word along the output dim, in AutoAWQ's
                                  order: nibble k (bits 4k..4k+3) holds output 8c + AWQ_ORDER[k]
    qzeros  int32 [G, out / 8]    zero points, packed the same way (stored as is)
    scales  fp16  [G, out]
    w[o, i] = scales[g, o] * (q[i, o] - z[g, o]),  g = i // group_size
"""
from __future__ import annotations

import torch

from parallel.quant.base import LinearMethod, QuantConfig, quant_param, units
from parallel.quant.config import check_plain_modules
from parallel.quant.gptq import unpack_int32
from parallel.quant.packed import from_int_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Output j of a word is nibble AWQ_REVERSE[j] (the inverse permutation of AWQ_ORDER).
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, out / 8] int32 -> [rows, out] codes in output order."""
    nibbles = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)  # [rows, out/8, 8] nibble k
    reverse = torch.tensor(AWQ_REVERSE, device=packed.device)
    return nibbles.index_select(2, reverse).reshape(packed.shape[0], -1)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int):
        self.group_size = group_size

    @classmethod
    def from_config(cls, qc: dict) -> "AWQConfig":
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits!r} is not supported (4)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported (only 'gemm' packing)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ zero_point=false is not supported")
        group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(f"AWQ group_size={group_size!r} is not supported (a positive int or -1)")
        check_plain_modules(qc, "modules_to_not_convert")
        return cls(group_size)

    def linear_method(self) -> "AWQLinearMethod":
        return AWQLinearMethod(self)


class AWQLinearMethod(LinearMethod):
    def __init__(self, cfg: AWQConfig):
        self.cfg = cfg

    def create_weights(self, layer, in_per_rank, out_per_rank, in_full):
        gs = self.cfg.group_size if self.cfg.group_size != -1 else in_full
        one_group = self.cfg.group_size == -1
        groups = 1 if one_group else units(in_per_rank, gs, False, "AWQ input features per rank vs group_size")
        g_dim = None if one_group else 0  # one group: every row-parallel rank keeps it whole
        load, packed_out = layer.weight_loader, units(out_per_rank, 8, False, "AWQ output features")
        layer.awq_group_size = gs
        layer.qweight = quant_param((in_per_rank, packed_out), torch.int32, load, in_dim=0, out_dim=1, out_unit=8)
        layer.qzeros = quant_param((groups, packed_out), torch.int32, load, in_dim=g_dim, in_unit=gs, out_dim=1, out_unit=8)
        layer.scales = quant_param((groups, out_per_rank), torch.float32, load, in_dim=g_dim, in_unit=gs, out_dim=1)

    def dequantize(self, layer):
        q = unpack_awq(layer.qweight)  # [in, out]
        z = unpack_awq(layer.qzeros)  # [G, out]
        g = torch.arange(q.shape[0], device=q.device) // layer.awq_group_size  # [in], local groups
        return ((q - z[g]).float() * layer.scales[g]).t()

    def pack(self, layer):
        q, z = unpack_awq(layer.qweight), unpack_awq(layer.qzeros)
        g = torch.arange(q.shape[0], device=q.device) // layer.awq_group_size
        return from_int_codes(q, z, layer.scales, g, 4, min(layer.awq_group_size, q.shape[0]))

    def packed_params(self):
        return ("qweight", "qzeros", "scales")
