"""One decoder-only transformer for the Llama family, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE.

The architectures differ in a handful of switches (`ArchSpec`): q/k/v bias, per-head q/k RMSNorm,
and whether the MLP is dense or a sparse MoE. Checkpoint names stay the Hugging Face ones; fused
parameters (qkv_proj, gate_up_proj, experts.w13) map back to them in `checkpoint_target`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from parallel.embedding import VocabParallelEmbedding, make_lm_head
from parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.quant import QuantConfig, parse_quant_config
from parallel.state import pp_group, tp_group
from workers.models import fused_decode
from workers.models.layers import PagedAttention, RMSNorm, RotaryEmbedding, silu_and_mul
from workers.models.moe import SparseMoE


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    moe: str | None = None  # None, "mixtral" or "qwen3_moe"


def arch_spec(hf_config) -> ArchSpec:
    t = hf_config.model_type
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if t in ("llama", "mistral"):
        return ArchSpec(qkv_bias=attention_bias, o_bias=attention_bias)
    if t == "qwen2":
        return ArchSpec(qkv_bias=True)
    if t == "qwen3":
        return ArchSpec(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    if t == "mixtral":
        return ArchSpec(moe="mixtral")
    if t == "qwen3_moe":
        return ArchSpec(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, moe="qwen3_moe")
    raise ValueError(f"unsupported model_type {t!r}")


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, max_positions: int, quant_config: QuantConfig | None = None):
        super().__init__()
        d = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, bias=spec.qkv_bias,
                                          quant_config=quant_config)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=spec.o_bias, quant_config=quant_config)
        self.head_dim = d
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if spec.qk_norm else None
        self.rotary = RotaryEmbedding(cfg, d, max_positions)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, rotated: bool = False) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] of this rank -> attention output [T, Hq D], before o_proj.
        `rotated`: RoPE is already applied (the batch-1 fused GEMV does it, workers/models/fused_decode.py)."""
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not rotated:  # (rotated only comes from models without per-head norms)
            q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
        out = self.attn(q, k, v)  # [T, Hq, D]
        return out.reshape(-1, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, quant_config: QuantConfig | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                                       quant_config=quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # FP8 W8A8: SiLU-and-mul also writes down_proj's FP8 activations (parallel/quant/fp8_act.py)
        return self.down_proj(silu_and_mul(gate_up, self.down_proj.fp8_input_rows(gate_up)))


def _is_moe_layer(cfg, spec: ArchSpec, layer_idx: int) -> bool:
    if spec.moe == "mixtral":
        return True
    if spec.moe == "qwen3_moe":
        return layer_idx not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    return False


class DecoderLayer(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, layer_idx: int, max_positions: int, quant_config: QuantConfig | None = None,
                 moe_fp8: tuple[int, int] | None | bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, spec, max_positions, quant_config)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if _is_moe_layer(cfg, spec, layer_idx):
            if spec.moe == "mixtral":
                self.mlp = SparseMoE(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                                     renormalize=True, fp8_block=moe_fp8)
            else:
                self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                     renormalize=cfg.norm_topk_prob, fp8_block=moe_fp8)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)), quant_config=quant_config)

    def forward(self, positions, x, residual):
        # FP8 W8A8: the norms also write the FP8 activations of the linear after them (parallel/quant/fp8_act.py)
        qkv_rows = self.self_attn.qkv_proj.fp8_input_rows(x)
        if residual is None:
            residual, x = x, self.input_layernorm(x, fp8_rows=qkv_rows)
        else:
            x, residual = self.input_layernorm(x, residual, fp8_rows=qkv_rows)
        x = self.self_attn(positions, x)
        mlp_rows = self.mlp.gate_up_proj.fp8_input_rows(x) if isinstance(self.mlp, MLP) else None
        x, residual = self.post_attention_layernorm(x, residual, fp8_rows=mlp_rows)
        return self.mlp(x), residual


def _moe_fp8_block(quant_config: QuantConfig | None, cfg) -> tuple[int, int] | None | bool:
    """How a MoE model's experts are stored: False plain; for an FP8 checkpoint the weight_block_size, or None
    for per-tensor / per-channel scales. Other quantized MoE checkpoints are refused by name."""
    if quant_config is None:
        return False
    from parallel.quant.fp8 import FP8Config

    if not isinstance(quant_config, FP8Config):
        raise ValueError(f"quantized MoE models ({quant_config.name} on {cfg.model_type}) are not supported yet; "
                         "FP8 MoE checkpoints are")
    if quant_config.online:
        raise ValueError(f"quantization='fp8' on an unquantized MoE model ({cfg.model_type}) is not supported yet: "
                         "load an FP8 checkpoint of it")
    if quant_config.static_act:
        raise ValueError(f"FP8 MoE with activation_scheme='static' ({cfg.model_type}) is not supported yet; "
                         "dynamic (and block-wise) FP8 MoE checkpoints are")
    return quant_config.block


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Layers of one pipeline stage: equal shares, the remainder going to the middle stages."""
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    # Middle stages first (the first and last also carry the embedding and the head), then outwards.
    middle = sorted(range(pp_size), key=lambda r: (r in (0, pp_size - 1), abs(r - (pp_size - 1) / 2)))
    for r in middle[:extra]:
        sizes[r] += 1
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


class CausalLM(nn.Module):
    """Decoder + LM head. On a pipeline stage only its layers exist (`self.layers` keyed by global index)."""

    fuse_decode = True  # batch-1 graph capture takes workers/models/fused_decode.py; tests turn it off to compare

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        self.spec = arch_spec(cfg)
        # Linear layers of the decoder (and the LM head where a GPTQ checkpoint says lm_head=true); embeddings,
        # norms and the MoE router stay plain.
        self.quant_config = parse_quant_config(getattr(cfg, "quantization_config", None))
        self.moe_fp8 = _moe_fp8_block(self.quant_config, cfg) if self.spec.moe is not None else False
        pp = pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.layer_range = stage_layers(cfg.num_hidden_layers, pp.size, pp.rank)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first_stage else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, self.spec, i, max_positions, self.quant_config, self.moe_fp8)
                                     for i in self.layer_range})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last_stage else None
        self.lm_head = None
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.quant_config is not None and self.quant_config.lm_head and self.tied:
            raise ValueError(f"the checkpoint's {self.quant_config.name} quantization_config says lm_head=true, but the "
                             "LM head is tied to the embeddings (tie_word_embeddings); a tied head is never quantized")
        if self.is_last_stage:
            self.lm_head = make_lm_head(cfg.vocab_size, cfg.hidden_size, self.quant_config)
            if self.tied and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """First stage: token_ids [T] -> hidden. Later stages take (hidden, residual) from the previous one.

        Returns (hidden, residual); on the last stage hidden is final-normed and residual is None.
        """
        if self.fuse_decode and hidden is None and fused_decode.applies(self, token_ids):
            return fused_decode.forward(self, token_ids, positions), None
        if self.is_first_stage:
            hidden = self.embed_tokens(token_ids)
        for layer in self.layers.values():
            hidden, residual = layer(positions, hidden, residual)
        if self.is_last_stage:
            hidden, _ = self.norm(hidden, residual)
            residual = None
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on the first TP rank of the last stage; None on other TP ranks."""
        return self.lm_head.compute_logits(hidden)

    # ---- checkpoint name -> (parameter, loader arguments) ----
    _STACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    _EXPERT = re.compile(r"^(model\.layers\.\d+\.)(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.(weight|weight_scale_inv|weight_scale)$")
    _EXPERT_SHARD = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}

    def checkpoint_target(self, name: str) -> tuple[nn.Parameter, tuple] | None:
        """Which local parameter a checkpoint tensor loads into, and the extra loader args; None to skip."""
        params = self._params()
        if self.quant_config is not None:
            name = self.quant_config.checkpoint_name(name)
        m = self._EXPERT.match(name)
        if m:
            prefix, expert_id, kind, tensor = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            key = self._local_name(prefix + "mlp.experts." + ("w2" if kind in ("w2", "down_proj") else "w13")
                                   + ("" if tensor == "weight" else "_scale"))
            experts = self._module_of(key)
            if key not in params or not experts.is_local(expert_id):
                return None
            return params[key], (expert_id, self._EXPERT_SHARD[kind])
        name = name.replace("block_sparse_moe.gate.", "mlp.gate.")
        for ckpt_part, (fused, shard) in self._STACKED.items():
            if f".{ckpt_part}." in name and ".experts." not in name:
                key = self._local_name(name.replace(f".{ckpt_part}.", f".{fused}."))
                return (params[key], (shard,)) if key in params else None
        key = self._local_name(name)
        if key == "embed_tokens.weight" and self.embed_tokens is None and self.lm_head is not None and self.tied:
            # A last pipeline stage without the embedding holds its own copy of the tied matrix.
            key = "lm_head.weight"
        if key is None or key not in params:
            return None
        return params[key], ()

    def _local_name(self, name: str) -> str | None:
        if name.startswith("model."):
            name = name[len("model."):]
        return name

    def _module_of(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rsplit(".", 1)[0])

    def _params(self) -> dict[str, nn.Parameter]:
        if not hasattr(self, "_param_cache"):
            self._param_cache = dict(self.named_parameters(remove_duplicate=False))
        return self._param_cache


def build_model(hf_config, max_positions: int) -> CausalLM:
    if pp_group().size > hf_config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_group().size}) exceeds num_hidden_layers ({hf_config.num_hidden_layers}): "
                         "every stage needs at least one layer")
    if tp_group().size > 1 and hf_config.num_attention_heads % tp_group().size:
        raise ValueError(f"num_attention_heads ({hf_config.num_attention_heads}) not divisible by tensor_parallel_size ({tp_group().size})")
    return CausalLM(hf_config, max_positions)
