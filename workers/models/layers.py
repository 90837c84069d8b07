"""Unsharded building blocks: RMSNorm, rotary embedding, SiLU-and-mul, the attention layer.

Numerics follow the Hugging Face implementations op for op (fp32 variance in RMSNorm, fp32 RoPE
tables cast to the model dtype), so greedy tokens match HF.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel.linear import default_weight_loader, set_weight_loader
from workers.attention import AttentionBackend, get_forward_context

try:  # fused Triton kernels for the CUDA path; the CPU path below never uses them
    from parallel.kernels import fused_ops as _fused
except ImportError:  # no Triton (CPU machines)
    _fused = None


def _use_fused(x: torch.Tensor) -> bool:
    return _fused is not None and x.is_cuda


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(nn.Parameter(torch.empty(dim), requires_grad=False), default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_rows: int | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). `fp8_rows` (CUDA): the next
        linear's W8A8 activations are emitted with the output (parallel/quant/fp8_act.py)."""
        if _use_fused(x):
            return _fused.rms_norm(x, self.weight, self.eps, residual, fp8_rows)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def silu_and_mul(gate_up: torch.Tensor, fp8_rows: int | None = None) -> torch.Tensor:
    """silu(gate) * up; `fp8_rows` as in `RMSNorm.forward` (CUDA only)."""
    if _use_fused(gate_up):
        return _fused.silu_and_mul(gate_up, fp8_rows)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type (llama3, yarn, linear...)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' rescales with sequence length at run time and is not supported")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with cos/sin tables precomputed for every position."""

    def __init__(self, hf_config, head_dim: int, max_positions: int):
        super().__init__()
        self.hf_config, self.head_dim, self.max_positions = hf_config, head_dim, max_positions
        self.register_buffer("cos_sin", torch.empty(max_positions, 2, head_dim), persistent=False)

    def init_buffers(self) -> None:
        """Fill the tables on the module's device (called after the model is materialised from meta)."""
        inv_freq, scaling = rope_inv_freq(self.hf_config, self.head_dim)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        table = torch.stack((emb.cos() * scaling, emb.sin() * scaling), dim=1)  # [P, 2, D]
        self.cos_sin = table.to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: "RMSNorm | None" = None,
                k_norm: "RMSNorm | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D]. With q_norm/k_norm (Qwen3), each head is
        RMS-normed first; on CUDA norms and rotation are one kernel."""
        if q_norm is not None and k_norm is not None:
            if _use_fused(q) and q_norm.weight.dtype == q.dtype and q_norm.eps == k_norm.eps:
                return _fused.qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos_sin)
            q, k = q_norm(q), k_norm(k)
        if _use_fused(q):
            return _fused.rope(positions, q, k, self.cos_sin)
        cos_sin = self.cos_sin[positions].to(q.dtype)  # [T, 2, D]
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class PagedAttention(nn.Module):
    """Attention over this layer's slice of the paged KV cache; the runner sets `kv_cache` and `backend`."""

    # While piecewise CUDA graphs capture (workers/piecewise_graphs.py), attention calls go here instead.
    intercept: Callable[["PagedAttention", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D]
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if PagedAttention.intercept is not None:
            return PagedAttention.intercept(self, q, k, v)
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("KV cache not allocated: the model runner binds it before the first step")
        return self.backend.forward(q, k, v, self.kv_cache, get_forward_context(), self.scale)
