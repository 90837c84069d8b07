"""Quantized checkpoints (issue 15, stage 1): GPTQ, AWQ and FP8 in their published layouts, written by
scripts/quantize.py from the tiny models, load from config.json alone and generate exactly what
Hugging Face transformers generates on the dequantized weights (written by the same tool as a plain
checkpoint, from the integer codes before packing). Sharded loading under TP is checked layer by
layer (each rank's dequantized shard is its slice of the full weight), and bad configs are refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.quant import parse_quant_config
from parallel.state import Group
from tandem import SamplingParams
from tests.models import hf_greedy_batch, prompts_of_lengths, tiny_model
from tests.quant_helpers import cpu_llm as _llm
from tests.quant_helpers import qt
from tests.quant_helpers import with_quant_config as _with_quant_config

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = prompts_of_lengths([1, 4, 9, 17], vocab_size=300, seed=3)
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

# name -> (tiny architecture, tool options). Covers bits 4/8, group sizes incl. -1, sym/asym, act order,
# q/k/v bias (qwen2), per-head norms and head_dim != hidden/heads (qwen3), ragged FP8 blocks (128 > 64).
CASES = {
    "gptq4_g32_sym": ("llama", qt.Options("gptq", bits=4, group_size=32)),
    "gptq4_g16_asym_act": ("qwen2", qt.Options("gptq", bits=4, group_size=16, sym=False, desc_act=True)),
    "gptq8_all_asym": ("qwen3", qt.Options("gptq", bits=8, group_size=-1, sym=False)),
    "gptq8_g32_sym_act": ("llama", qt.Options("gptq", bits=8, group_size=32, desc_act=True)),
    "awq_g32": ("llama", qt.Options("awq", group_size=32)),
    "awq_g16_bias": ("qwen2", qt.Options("awq", group_size=16)),
    "fp8_block32": ("qwen3", qt.Options("fp8", block=(32, 32))),
    "fp8_block128": ("llama", qt.Options("fp8", block=(128, 128))),
    "fp8_tensor": ("llama", qt.Options("fp8", fp8_scale="tensor")),
    "fp8_channel": ("qwen2", qt.Options("fp8", fp8_scale="channel")),
    # activation_scheme "static": an input_scale per linear, from calibration windows. On CPU weights run
    # dequantized and activations unquantized, so the output is still HF's on the dequantized weights.
    "fp8_tensor_static": ("llama", qt.Options("fp8", fp8_scale="tensor", activation_scheme="static")),
    "fp8_channel_static": ("qwen3", qt.Options("fp8", fp8_scale="channel", activation_scheme="static")),
}


def _quantized(tmp_path: Path, case: str) -> tuple[str, str, str]:
    arch, opts = CASES[case]
    src = tiny_model(arch)
    dst, ref = str(tmp_path / f"{case}-q"), str(tmp_path / f"{case}-ref")
    calib = None
    if opts.activation_scheme == "static":
        calib = qt.calibration_samples(src, (ROOT / "README.md").read_text(encoding="utf-8"), 4, 32)
    qt.quantize_folder(src, dst, opts, dequantized_out=ref, calibration=calib)
    return src, dst, ref


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_hf_on_dequantized_weights(tmp_path, case):
    src, dst, ref = _quantized(tmp_path, case)
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == CASES[case][1].method
    llm = _llm(dst)  # nothing but the folder: the method comes from config.json
    model = llm.llm_engine.executor.runner.model
    qkv = model.layers["0"].self_attn.qkv_proj
    down = model.layers["0"].mlp.down_proj
    assert qkv.quantized and down.quantized
    if CASES[case][1].method == "fp8":
        assert down.weight.dtype == torch.float8_e4m3fn
    else:
        assert down.qweight.dtype == torch.int32 and not hasattr(down, "weight")
    if CASES[case][1].activation_scheme == "static":  # one scale per layer: q/k/v's largest, down's own
        with safe_open(os.path.join(dst, "model.safetensors"), "pt") as f:
            scale = lambda m: f.get_tensor(f"model.layers.0.{m}.input_scale")  # noqa: E731
            want_qkv = torch.stack([scale(f"self_attn.{p}_proj") for p in "qkv"]).max()
            assert qkv.input_scale.item() == want_qkv.item() and down.input_scale.item() == scale("mlp.down_proj").item()
    outs = llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    for prompt, out, (expected, _) in zip(PROMPTS, outs, hf_greedy_batch(ref, PROMPTS, MAX_NEW)):
        assert out.token_ids == expected, f"{case}: prompt of {len(prompt)} tokens diverges from HF on the dequantized model"
    # The reference is really quantized (not the original weights), so the comparison means something.
    with safe_open(os.path.join(ref, "model.safetensors"), "pt") as r, safe_open(os.path.join(src, "model.safetensors"), "pt") as s:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(r.get_tensor(name), s.get_tensor(name))


# ---- sharding: every TP rank's dequantized shard is its slice of the full dequantized weight ----

LAYER_CASES = {
    "gptq4_g8_asym_act": qt.Options("gptq", bits=4, group_size=8, sym=False, desc_act=True),
    "gptq8_g16_sym": qt.Options("gptq", bits=8, group_size=16),
    "gptq4_all": qt.Options("gptq", bits=4, group_size=-1),
    "awq_g16": qt.Options("awq", group_size=16),
    "fp8_block16": qt.Options("fp8", block=(16, 16)),
    "fp8_channel": qt.Options("fp8", fp8_scale="channel"),
    "fp8_tensor": qt.Options("fp8", fp8_scale="tensor"),
}


def _quantize_tensors(w: torch.Tensor, o, perm=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if o.method == "gptq":
        return qt.quantize_gptq(w, o, perm)
    return qt.quantize_awq(w, o) if o.method == "awq" else qt.quantize_fp8(w, o)


def _load(layer, parts: dict, shard_id=None) -> None:
    for name, t in parts.items():
        p = getattr(layer, name)
        p.weight_loader(p, t, *(() if shard_id is None else (shard_id,)))
    layer.init_buffers()


def _build(cls, tp: int, rank: int, o, *args):
    group = Group(ranks=list(range(tp)), rank=rank)
    return cls(*args, group=group, quant_config=parse_quant_config(o.quantization_config()))


@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_quantized_layers_dequantize_to_their_slice(case, tp):
    o = LAYER_CASES[case]
    g = torch.Generator().manual_seed(0)
    w_q, w_k, w_v = (torch.randn(n, 64, generator=g) for n in (64, 32, 32))  # 8 heads of 8, 4 KV heads
    w_gate, w_up, w_down = torch.randn(96, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(64, 128, generator=g)
    perm = torch.randperm(64, generator=g) if o.desc_act else None  # one act order per shared input
    (tq, dq), (tk, dk), (tv, dv) = (_quantize_tensors(w, o, perm) for w in (w_q, w_k, w_v))
    (tg, dg), (tu, du) = (_quantize_tensors(w, o, perm) for w in (w_gate, w_up))
    td, dd = _quantize_tensors(w_down, o, torch.randperm(128, generator=g) if o.desc_act else None)
    if tp == 4 and o.method == "fp8" and o.fp8_scale == "block":
        pytest.skip("k/v shards of 8 rows start inside 16-row blocks (refused; see the next test)")
    for rank in range(tp):
        qkv = _build(QKVParallelLinear, tp, rank, o, 64, 8, 8, 4)
        for sid, parts in zip("qkv", (tq, tk, tv)):
            _load(qkv, {k: v for k, v in parts.items()}, sid)
        nq, nkv = 64 // tp, 32 // tp
        want = torch.cat([dq[rank * nq:(rank + 1) * nq], dk[rank * nkv:(rank + 1) * nkv], dv[rank * nkv:(rank + 1) * nkv]])
        torch.testing.assert_close(qkv.quant_method.dequantize(qkv), want, rtol=0, atol=0)

        gu = _build(MergedColumnParallelLinear, tp, rank, o, 64, [96, 96])
        _load(gu, tg, 0)
        _load(gu, tu, 1)
        n = 96 // tp
        torch.testing.assert_close(gu.quant_method.dequantize(gu), torch.cat([dg[rank * n:(rank + 1) * n], du[rank * n:(rank + 1) * n]]),
                                   rtol=0, atol=0)

        down = _build(RowParallelLinear, tp, rank, o, 128, 64)
        _load(down, td)
        k = 128 // tp
        torch.testing.assert_close(down.quant_method.dequantize(down), dd[:, rank * k:(rank + 1) * k], rtol=0, atol=0)


def test_misaligned_shards_are_refused():
    o = qt.Options("fp8", block=(16, 16))
    with pytest.raises(ValueError, match="weight_block_size"):
        _build(QKVParallelLinear, 4, 1, o, 64, 8, 8, 4)  # k/v: 8 rows per rank, blocks of 16
    with pytest.raises(ValueError, match="group_size"):
        _build(RowParallelLinear, 4, 0, qt.Options("gptq", group_size=32), 64, 64)  # 16 inputs per rank, groups of 32
    with pytest.raises(ValueError, match="pack"):
        _build(ColumnParallelLinear, 1, 0, qt.Options("awq", group_size=16), 64, 12)  # 12 outputs: not whole words of 8


def test_fused_projections_with_different_act_orders_are_refused():
    o = qt.Options("gptq", bits=4, group_size=16, desc_act=True)
    g = torch.Generator().manual_seed(1)
    gu = _build(MergedColumnParallelLinear, 1, 0, o, 64, [32, 32])
    _load(gu, qt.quantize_gptq(torch.randn(32, 64, generator=g), o, torch.randperm(64, generator=g))[0], 0)
    with pytest.raises(ValueError, match="g_idx"):
        _load(gu, qt.quantize_gptq(torch.randn(32, 64, generator=g), o, torch.randperm(64, generator=g))[0], 1)


def test_tp2_equals_tp1_on_a_gptq_checkpoint(tmp_path, shared_ray):
    """Both ranks' shards (act order with grouped scales under row parallelism; packed qzeros under
    column parallelism) on two gloo ranks give the one-rank tokens."""
    _, dst, ref = _quantized(tmp_path, "gptq4_g16_asym_act")
    one = _llm(dst)
    expected = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    one.shutdown()
    two = _llm(dst, tensor_parallel_size=2)  # its ranks on the session's Ray (tests/conftest.py)
    try:
        got = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
    finally:
        two.shutdown()
    assert got == expected
    assert expected == [t for t, _ in hf_greedy_batch(ref, PROMPTS, MAX_NEW)]


test_tp2_equals_tp1_on_a_gptq_checkpoint = pytest.mark.slow(test_tp2_equals_tp1_on_a_gptq_checkpoint)


# ---- refusals ----

@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "activation_scheme": "per_token"}, "per_token"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}, "modules_to_not_convert"),
    ({"bits": 4}, "quant_method"),
])
def test_unsupported_quantization_configs_are_refused_by_name(tmp_path, qc, match):
    path = _with_quant_config(tmp_path, qc)
    with pytest.raises(ValueError, match=match):
        _llm(path)


def test_fp8_checkpoint_without_its_scales_is_refused(tmp_path):
    _, dst, _ = _quantized(tmp_path, "fp8_block32")
    f = os.path.join(dst, "model.safetensors")
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if not k.endswith("weight_scale_inv")}
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        _llm(dst)


def test_fp8_checkpoint_without_quantization_config_is_refused(tmp_path):
    """Today's bug: the FP8 weights loaded as plain ones, their scales ignored, garbage generated."""
    _, dst, _ = _quantized(tmp_path, "fp8_block32")
    cfg = json.loads(Path(dst, "config.json").read_text())
    del cfg["quantization_config"]
    Path(dst, "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config"):
        _llm(dst)


def test_unconsumed_tensor_is_an_error(tmp_path):
    path = _with_quant_config(tmp_path, None)
    f = os.path.join(path, "model.safetensors")
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weight_scale_inv"):
        _llm(path)


def test_quantization_argument_must_match_the_checkpoint(tmp_path):
    _, dst, _ = _quantized(tmp_path, "gptq4_g32_sym")
    with pytest.raises(ValueError, match="'awq' but the checkpoint"):
        _llm(dst, quantization="awq")
    with pytest.raises(ValueError, match="not quantized"):
        _llm(tiny_model("llama"), quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        _llm(dst, quantization="int3")
    dummy = _llm(dst, load_format="dummy")  # random weights, RTN-quantized into the checkpoint's layout
    assert dummy.llm_engine.executor.runner.model.layers["0"].mlp.down_proj.qweight.any()
    dummy.shutdown()
    assert _llm(dst, quantization="gptq").generate(PROMPTS[:1], GREEDY)[0].token_ids


# ---- FP8 static activations (activation_scheme "static"): loading, and which scale the W8A8 GEMM uses ----

def test_fp8_static_checkpoint_without_input_scales_is_refused(tmp_path):
    _, dst, _ = _quantized(tmp_path, "fp8_tensor_static")
    f = os.path.join(dst, "model.safetensors")
    with safe_open(f, "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if k != "model.layers.0.self_attn.k_proj.input_scale"}
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no input_scale"):
        _llm(dst)


def test_fp8_dynamic_checkpoint_with_input_scales_is_refused(tmp_path):
    """An input_scale the config does not ask for is never dropped in silence."""
    _, dst, _ = _quantized(tmp_path, "fp8_tensor_static")
    cfg = json.loads(Path(dst, "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "dynamic"
    Path(dst, "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="input_scale"):
        _llm(dst)


def _static_qkv(tp: int, rank: int, scales: dict[str, float], bad: float | None = None):
    o = qt.Options("fp8", fp8_scale="tensor", activation_scheme="static")
    layer = _build(QKVParallelLinear, tp, rank, o, 64, 8, 8, 4)
    layer.init_buffers()
    g = torch.Generator().manual_seed(0)
    for sid, n in zip("qkv", (64, 32, 32)):
        tensors, _ = qt.quantize_fp8(torch.randn(n, 64, generator=g), o)
        tensors["input_scale"] = torch.tensor(scales[sid] if bad is None else bad)
        _load(layer, tensors, sid)
    return layer


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_static_input_scale_is_the_largest_of_the_fused_projections_on_every_rank(tp):
    for rank in range(tp):
        layer = _static_qkv(tp, rank, {"q": 0.25, "k": 0.5, "v": 0.125})
        assert layer.input_scale.tolist() == [0.25, 0.5, 0.125]
        layer.quant_method.process_weights(layer)
        assert layer.input_scale.tolist() == [0.5]
        packed = layer.quant_method.pack(layer)  # the CUDA layout, built here on CPU: it carries the scale
        assert packed.act_scale.tolist() == [0.5]


@pytest.mark.parametrize("bad", [0.0, float("inf")])
def test_fp8_static_input_scale_must_be_positive_and_finite(bad):
    layer = _static_qkv(1, 0, {}, bad=bad)
    with pytest.raises(ValueError, match="positive and finite"):
        layer.quant_method.process_weights(layer)


def test_fp8_static_input_scale_of_many_values_is_refused():
    layer = _static_qkv(1, 0, {"q": 1.0, "k": 1.0, "v": 1.0})
    with pytest.raises(ValueError, match="one float per tensor"):
        layer.input_scale.weight_loader(layer.input_scale, torch.ones(64), "q")


def test_fp8_w8a8_uses_the_static_scale_and_else_a_dynamic_one(monkeypatch):
    """The scale selection of the W8A8 GEMM (run on CUDA; its torch parts checked here): with the
    checkpoint's input_scale the activations are clamp(x / s) in e4m3 and cuBLAS gets s for every row;
    without one the per-token Triton quantizer runs."""
    qg = pytest.importorskip("parallel.kernels.quant_gemm")
    calls: dict = {}

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        calls.update(a=a, scale_a=scale_a)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    x = torch.randn(5, 32, dtype=torch.bfloat16) * 3
    w8, w_scale = torch.randn(8, 32).to(torch.float8_e4m3fn), torch.ones(1, 8)
    s = torch.tensor([0.02])
    y = qg.scaled_mm_fp8(x, w8, w_scale, None, input_scale=s)
    assert y.shape == (5, 8)
    assert calls["scale_a"].shape == (16, 1) and torch.equal(calls["scale_a"], torch.full((16, 1), 0.02))
    want = (x.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(calls["a"][:5].view(torch.uint8), want.view(torch.uint8))
    assert not calls["a"][5:].float().any()  # padding rows (cuBLAS wants M a multiple of 16) are zero

    dynamic: list = []
    monkeypatch.setattr(qg, "quant_fp8_rows", lambda x, rows: dynamic.append(rows) or
                        (torch.zeros(rows, x.shape[1], dtype=torch.float8_e4m3fn), torch.ones(rows, 1)))
    qg.scaled_mm_fp8(x, w8, w_scale, None)
    assert dynamic == [16]


def test_fp8_packed_weight_hands_its_static_scale_to_the_w8a8_gemm(monkeypatch):
    from parallel.quant import packed as pk

    got: list = []
    monkeypatch.setattr(pk, "_kernels", type("K", (), {"scaled_mm_fp8": staticmethod(
        lambda x, codes, w_scale, bias, input_scale: got.append(input_scale) or x)}))
    w = pk.PackedWeight(torch.zeros(8, 32, dtype=torch.float8_e4m3fn), torch.ones(8, 1), None, 32, None,
                        w8a8_scale=torch.ones(1, 8), act_scale=torch.tensor([0.5]))
    w.apply(torch.zeros(6, 32, dtype=torch.bfloat16), None)  # > 4 rows, bf16: the W8A8 path
    assert [t.tolist() for t in got] == [[0.5]]
