"""Batch-1 decode with the small ops folded into the GEMVs (CUDA-graph capture, no PP, dense MLP).

A decoder layer at one token is four weight-streaming GEMVs with small kernels between them. The
unfused path (`DecoderLayer.forward`) runs ten kernels per layer; here it is six (seven with
Qwen3's per-head q/k norms, which must come before RoPE):
    qkv   = RoPE(GEMV(RMSNorm(h)))              input_layernorm in the prologue, RoPE in the epilogue
    out   = attention(q, k, v)                  the decode kernel (which also writes k/v)
    h     = GEMV(out) + h                       residual add in the epilogue
    act   = silu(GEMV_gate(RMSNorm(h))) * GEMV_up(...)   post_attention_layernorm and SiLU-and-mul
    h     = GEMV(act) + h
The residual stream h is carried summed instead of as (x, residual); every value is rounded where
the unfused path rounds it, so the two agree up to the order of the norm's sum
(tests/gpu/test_fused_decode.py).

Quantized layers (GPTQ / AWQ int4 and int8, FP8) take the same path when load gave each of them a
`gemv_weight` (parallel/quant/fused_gemv.py): the quantized GEMV (parallel/kernels/gemv_quant.py) reads
the packed weight in place with the same prologue and epilogues; a model with any other quantized linear
keeps the unfused decoder.

Under TP the qkv and gate/up GEMVs read this rank's column shard as they are, and the two
row-parallel GEMVs (o_proj, down_proj) produce partial sums: the group's first rank adds the bias and
the residual in its epilogue, the others neither, so one all-reduce returns h + x @ W.T + b, the
same value the unfused path builds as (x @ W.T summed) + b + h, up to the order of that sum. The
first two-GPU run (2026-11-25) had TP=2 batch-1 decode on the unfused path at 0.95x one GPU.
"""
from __future__ import annotations

import torch

from parallel.comm import reduce_partial_sums
from parallel.embedding import tp_embed_mode

try:
    from parallel.kernels import fused_ops as _fused_ops
    from parallel.kernels import gemv as _gemv
    from parallel.kernels import gemv_quant as _gemv_quant
except ImportError:  # no Triton (CPU machines)
    _fused_ops = _gemv = _gemv_quant = None


def applies(model, token_ids: torch.Tensor) -> bool:
    """One token, captured into a CUDA graph, on a model this path covers."""
    if _gemv is None or token_ids.shape[0] != 1 or not token_ids.is_cuda or not torch.cuda.is_current_stream_capturing():
        return False
    if not hasattr(model, "_fused_decode_ok"):
        model._fused_decode_ok = _covers(model)
    return model._fused_decode_ok


def _covers(model) -> bool:
    from workers.models.transformer import MLP

    if not (model.is_first_stage and model.is_last_stage):
        return False
    if getattr(model, "quant_config", None) is not None and not all(
            _streams(lin) for layer in model.layers.values() for lin in _linears(layer)):
        return False  # a quantized layer the fused GEMVs cannot read (fused_gemv.py says why in gemv_skipped)
    if model.embed_tokens.weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    if model.config.hidden_size > _gemv.MAX_NORM_K:
        return False
    return all(isinstance(layer.mlp, MLP) for layer in model.layers.values())


def forward(model, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """token_ids [1] -> final-normed hidden [1, d], as `CausalLM.forward` returns it."""
    gemv = _gemv.gemv
    pushed = _pushed_partials(model)
    # h: the residual stream, or (pushed partials) the site where its TP ranks' partial sums wait to be summed
    first = embed_site_count(pushed.sites, len(model.layers)) if pushed else 0  # 1: the embedding pushes to site 0
    if first:
        emb = model.embed_tokens
        _fused_ops.vocab_rows(token_ids, emb.weight, emb.vocab_start, push=pushed.site(0))
        h = pushed.site(0)
    else:
        h = model.embed_tokens(token_ids)
    for i, layer in enumerate(model.layers.values()):
        attn, mlp = layer.self_attn, layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        # RoPE goes into the qkv epilogue unless per-head q/k norms (Qwen3) must come first
        rope = None if attn.q_norm is not None else _gemv.Rope(
            positions, attn.rotary.cos_sin, attn.head_dim, (attn.num_heads + attn.num_kv_heads) * attn.head_dim)
        qkv, h = normed_gemv(gemv, h, attn.qkv_proj, ln1, rope=rope)
        h = row_parallel_gemv(gemv, attn.attend(positions, qkv, rotated=rope is not None), attn.o_proj, h,
                              pushed.site(first + 2 * i) if pushed else None)
        act, h = normed_gemv(gemv, h, mlp.gate_up_proj, ln2, silu=True)
        h = row_parallel_gemv(gemv, act, mlp.down_proj, h, pushed.site(first + 2 * i + 1) if pushed else None)
    if pushed:
        h = _gemv.sum_pushed(h, torch.empty(1, pushed.width, dtype=h.parts.dtype, device=h.parts.device))
    return model.norm(h)


def _pushed_partials(model):
    """The TP group's pushed-partials slots (parallel/p2p_allreduce.PushedPartials) where they serve this model:
    every linear plain (the quantized GEMVs do not push), a site for each row-parallel output, and no other model
    on these ranks using them (a second model's steps would leave its last site written where this one's next
    push lands, and a peer could read the stale value); else None."""
    if not hasattr(model, "_pushed"):
        layers = list(model.layers.values())
        pushed = getattr(layers[0].self_attn.o_proj.group, "pushed_partials", None) if layers else None
        if pushed is not None and (pushed.width != model.config.hidden_size
                                   or embed_site_count(pushed.sites, len(layers)) is None
                                   or any(getattr(lin, "gemv_weight", None) is not None
                                          for layer in layers for lin in _linears(layer))
                                   or not pushed.claim(model)):
            pushed = None
        model._pushed = pushed
    return model._pushed


def pushed_sites(num_layers: int) -> int:
    """Pushed-partials sites a step of the batch-1 fused decoder uses: each layer's two row-parallel outputs, and
    with TANDEM_TP_EMBED=push one more first, the embedding's (every site of the cycle must be taken each step: the
    GEMV taking a site empties the one before it)."""
    return 2 * num_layers + (tp_embed_mode() == "push")


def embed_site_count(sites: int, num_layers: int) -> int | None:
    """The sites before the layers' (1: the embedding pushes to site 0; 0: none), or None where `sites` fits
    neither layout."""
    extra = sites - 2 * num_layers
    return extra if extra in (0, 1) else None


def normed_gemv(gemv, h, linear, norm, **fused) -> tuple[torch.Tensor, torch.Tensor]:
    """(the GEMV of norm(h), h): where h is a pushed-partials site, the GEMV waits for and sums its partials
    first, and the sum is the h returned."""
    if isinstance(h, torch.Tensor):
        return linear_gemv(gemv, h, linear, linear.bias, norm_weight=norm.weight, eps=norm.eps, **fused), h
    whole = torch.empty(1, h.parts.shape[1], dtype=h.parts.dtype, device=h.parts.device)
    return gemv(whole, linear.weight, linear.bias, norm_weight=norm.weight, eps=norm.eps, take=h, **fused), whole


def _linears(layer) -> tuple:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _streams(linear) -> bool:
    """A plain layer, or a quantized one with the quantized GEMV's view of its packed weight."""
    return not getattr(linear, "quantized", False) or getattr(linear, "gemv_weight", None) is not None


def linear_gemv(gemv, x: torch.Tensor, linear, bias: torch.Tensor | None, **fused) -> torch.Tensor:
    """`gemv` (with `fused` prologue/epilogue arguments) on the layer's weight: plain, or quantized in place."""
    qw = getattr(linear, "gemv_weight", None)
    if qw is not None:
        return _gemv_quant.qgemv(x, qw, bias, **fused)
    return gemv(x, linear.weight, bias, **fused)


def row_parallel_gemv(gemv, x: torch.Tensor, linear, residual: torch.Tensor, push=None):
    """residual + x_full @ W.T + bias for a row-parallel `linear` whose rank holds x's and W's shard of K:
    the bias and residual ride in the first rank's epilogue only, and the all-reduce sums the parts. With
    `push` (a pushed-partials site) each rank stores its part in every rank's slots there instead, and the
    site is returned: the next normed GEMV sums it."""
    group = linear.group
    first = group.is_first
    fused = dict(push=push) if push is not None else {}
    out = linear_gemv(gemv, x, linear, linear.bias if first else None, residual=residual if first else None, **fused)
    return push if push is not None else reduce_partial_sums(out, group)
