"""compressed-tensors checkpoints (llm-compressor's format, issue 15): the FP8 schemes load from
config.json alone and generate what Hugging Face transformers generates on the dequantized weights, dense
and MoE; the other schemes (INT8 W8A8, weight-only FP8, partial targets, ignored projections) are
refused by name. The checkpoints are scripts/quantize.py's FP8 ones rewritten into compressed-tensors'
names and config: the tensors are the same e4m3 codes and float32 scales."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tandem import SamplingParams
from tests.models import hf_greedy_batch, prompts_of_lengths, tiny_model
from tests.quant_helpers import ROOT, qt, with_quant_config
from tests.quant_helpers import cpu_llm as _llm

PROMPTS = prompts_of_lengths([1, 6, 13], vocab_size=300, seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _group(strategy: str, block=None, static: bool = False) -> dict:
    act = ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False} if static else
           {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group" if block else "token", "dynamic": True})
    return {"targets": ["Linear"], "format": "float-quantized",
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                        "block_structure": list(block) if block else None, "dynamic": False, "group_size": None},
            "input_activations": act, "output_activations": None}


def ct_config(group: dict, ignore=("lm_head",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": list(ignore), "kv_cache_scheme": None}


CASES = {  # name -> (tiny architecture, quantize.py options, compressed-tensors group)
    "dense_channel": ("llama", qt.Options("fp8", fp8_scale="channel"), _group("channel")),
    "dense_tensor_static": ("qwen3", qt.Options("fp8", fp8_scale="tensor", activation_scheme="static"),
                            _group("tensor", static=True)),
    "dense_block": ("qwen2", qt.Options("fp8", block=(32, 32)), _group("block", (32, 32))),
    "moe_block": ("qwen3_moe", qt.Options("fp8", block=(16, 16)), _group("block", (16, 16))),
}


def _ct_checkpoint(tmp_path: Path, case: str) -> tuple[str, str]:
    arch, opts, group = CASES[case]
    src, dst, ref = tiny_model(arch), str(tmp_path / "ct"), str(tmp_path / "ref")
    calib = None
    if opts.activation_scheme == "static":
        calib = qt.calibration_samples(src, (ROOT / "README.md").read_text(encoding="utf-8"), 4, 32)
    qt.quantize_folder(src, dst, opts, dequantized_out=ref, calibration=calib)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)  # compressed-tensors calls every FP8 scale `weight_scale`, block-wise too
    save_file({k.replace(".weight_scale_inv", ".weight_scale"): v for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    config = json.loads(Path(dst, "config.json").read_text())
    config["quantization_config"] = ct_config(group)
    Path(dst, "config.json").write_text(json.dumps(config))
    return dst, ref


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_tensors_fp8_matches_hf_on_dequantized_weights(tmp_path, case):
    dst, ref = _ct_checkpoint(tmp_path, case)
    llm = _llm(dst)
    outs = llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    for prompt, out, (expected, _) in zip(PROMPTS, outs, hf_greedy_batch(ref, PROMPTS, 8)):
        assert out.token_ids == expected, f"{case}: prompt of {len(prompt)} tokens diverges from HF on the dequantized model"


INT8 = {**_group("channel"), "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}


@pytest.mark.parametrize("qc,match", [
    (ct_config(INT8), "weights of type 'int' with 8 bits"),
    (ct_config({**_group("channel"), "input_activations": None}), "weight-only"),
    (ct_config({**_group("channel"), "targets": ["re:.*down_proj$"]}), "targets"),
    (ct_config(_group("channel"), ignore=["lm_head", "re:.*down_proj$"]), "ignore entry 're:.*down_proj\\$'.*mlp.down_proj"),
    (ct_config(_group("channel"), ignore=["model.layers.0.self_attn.q_proj"]), "ignore entry"),
    ({**ct_config(_group("channel")), "config_groups": {"a": _group("channel"), "b": _group("tensor")}}, "2 config_groups"),
    (ct_config({**_group("channel"), "format": "pack-quantized"}), "format 'pack-quantized'"),
    (ct_config(_group("block", (128, 128), static=True)), "static input activations"),
])
def test_other_compressed_tensors_schemes_are_refused_by_name(tmp_path, qc, match):
    with pytest.raises(ValueError, match=match):
        _llm(with_quant_config(tmp_path, qc))


def test_routers_embeddings_and_the_head_may_be_ignored():
    from parallel.quant import parse_quant_config

    cfg = parse_quant_config(ct_config(_group("channel"), ignore=["lm_head", "re:.*mlp.gate$", "model.embed_tokens",
                                                                  "re:.*norm.*"]))
    assert cfg.name == "compressed-tensors" and cfg.block is None and not cfg.static_act
