"""FP8 MoE checkpoints (issue 15): the experts of Qwen3-MoE and Mixtral in e4m3 with block-wise,
per-channel or per-tensor scales, written in the published layout by scripts/quantize.py, load from
config.json alone and generate exactly what Hugging Face transformers generates on the dequantized
weights; TP splits each expert's blocks, EP spreads whole experts; other quantized MoE is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem import SamplingParams
from tests.models import hf_greedy_batch, prompts_of_lengths, tiny_model
from tests.quant_helpers import cpu_llm as _llm
from tests.quant_helpers import qt, with_quant_config

PROMPTS = prompts_of_lengths([1, 5, 11, 19], vocab_size=300, seed=5)
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

CASES = {  # tiny Qwen3-MoE: H 64, I 32 (two 16-row blocks), 8 experts; tiny Mixtral: I 128, 4 experts
    "qwen3_moe_block16": ("qwen3_moe", qt.Options("fp8", block=(16, 16))),
    "qwen3_moe_channel": ("qwen3_moe", qt.Options("fp8", fp8_scale="channel")),
    "mixtral_tensor": ("mixtral", qt.Options("fp8", fp8_scale="tensor")),
    "mixtral_block32": ("mixtral", qt.Options("fp8", block=(32, 32))),
}


def _quantized(tmp_path: Path, case: str) -> tuple[str, str]:
    arch, opts = CASES[case]
    dst, ref = str(tmp_path / f"{case}-q"), str(tmp_path / f"{case}-ref")
    qt.quantize_folder(tiny_model(arch), dst, opts, dequantized_out=ref)
    return dst, ref


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_moe_checkpoint_matches_hf_on_dequantized_weights(tmp_path, case):
    dst, ref = _quantized(tmp_path, case)
    llm = _llm(dst)
    experts = llm.llm_engine.executor.runner.model.layers["0"].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w2.dtype == torch.float8_e4m3fn
    outs = llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    for prompt, out, (expected, _) in zip(PROMPTS, outs, hf_greedy_batch(ref, PROMPTS, MAX_NEW)):
        assert out.token_ids == expected, f"{case}: prompt of {len(prompt)} tokens diverges from HF on the dequantized model"


def test_fp8_expert_shards_dequantize_to_their_slice(tmp_path):
    """Under TP each rank holds its rows of gate/up and columns of down, with the matching scale blocks;
    under EP whole experts. Each rank's dequantized expert equals its slice of the full one."""
    from safetensors import safe_open

    from parallel.state import Group
    from workers.models.moe import Experts

    dst, ref = _quantized(tmp_path, "qwen3_moe_block16")
    prefix = "model.layers.0.mlp.experts"
    with safe_open(f"{dst}/model.safetensors", "pt") as q, safe_open(f"{ref}/model.safetensors", "pt") as r:
        full = {(e, p): r.get_tensor(f"{prefix}.{e}.{p}_proj.weight") for e in range(8) for p in ("gate", "up", "down")}
        for tp, rank, local in ((2, 0, None), (2, 1, None), (1, 0, range(4, 8))):
            ex = Experts(8, 64, 32, group=Group(list(range(tp)), rank), local_experts=local, fp8_block=(16, 16))
            for e in (local or range(8)):
                for p, shard in (("gate", "gate"), ("up", "up"), ("down", "down")):
                    ex.weight_loader(ex.w2 if p == "down" else ex.w13, q.get_tensor(f"{prefix}.{e}.{p}_proj.weight"), e, shard)
                    ex.scale_loader(ex.w2_scale if p == "down" else ex.w13_scale,
                                    q.get_tensor(f"{prefix}.{e}.{p}_proj.weight_scale_inv"), e, shard)
            n = 32 // tp
            for i, e in enumerate(local or range(8)):
                rows = slice(rank * n, (rank + 1) * n)
                want13 = torch.cat([full[e, "gate"][rows], full[e, "up"][rows]])
                assert torch.equal(ex.dequantized(i, "w13", torch.float32), want13)
                assert torch.equal(ex.dequantized(i, "w2", torch.float32), full[e, "down"][:, rows])


def test_fp8_moe_blocks_that_straddle_tp_ranks_are_refused():
    from parallel.state import Group
    from workers.models.moe import Experts

    with pytest.raises(ValueError, match="weight_block_size"):
        Experts(8, 64, 32, group=Group([0, 1], 0), fp8_block=(32, 32))  # 16 rows per rank, blocks of 32


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, "quantized MoE models \\(gptq"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
])
def test_other_quantized_moe_is_refused_by_name(tmp_path, qc, match):
    with pytest.raises(ValueError, match=match):
        _llm(with_quant_config(tmp_path, qc, arch="qwen3_moe"))


def test_an_fp8_moe_checkpoint_without_its_quantization_config_is_refused(tmp_path):
    dst, _ = _quantized(tmp_path, "qwen3_moe_channel")
    config = json.loads(Path(dst, "config.json").read_text())
    del config["quantization_config"]
    Path(dst, "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config"):
        _llm(dst)


@pytest.mark.slow
def test_tp2_fp8_moe_equals_hf_on_dequantized_weights(tmp_path, shared_ray):
    """Two gloo ranks (on the session's Ray, tests/conftest.py), each with half of every expert's 16-row
    blocks (and of down's 16-column blocks)."""
    dst, ref = _quantized(tmp_path, "qwen3_moe_block16")
    two = _llm(dst, tensor_parallel_size=2)
    try:
        got = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
    finally:
        two.shutdown()
    assert got == [t for t, _ in hf_greedy_batch(ref, PROMPTS, MAX_NEW)]


def test_a_plain_moe_checkpoint_under_an_fp8_config_is_refused(tmp_path):
    """config.json says FP8 but the experts are 32-bit floats: never loaded as if they were e4m3 codes."""
    path = with_quant_config(tmp_path, {"quant_method": "fp8", "weight_block_size": [32, 32]}, arch="mixtral")
    with pytest.raises(ValueError, match="float32 expert weight, but config.json's quantization_config says FP8"):
        _llm(path)
