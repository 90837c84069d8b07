"""Issue 15, later stages, on CPU: the GPU kernels' weight layout, online FP8, dummy quantized
weights and the FP8 KV cache.

* Every method repacks into the one layout the Triton kernels read (parallel/quant/packed.py); its
  plain-torch dequantization equals the method's reference dequantization exactly, for each format
  and for TP shards (the GPU tests then check the kernels against this layout).
* quantization="fp8" on a plain checkpoint quantizes at load (per-channel e4m3 weights) and generates
  what HF generates on the same per-channel dequantized weights written by scripts/quantize.py.
* load_format="dummy" with gptq / awq gives RTN-quantized random weights in the checkpoint layout.
* kv_cache_dtype="fp8": the cache holds e4m3, attention equals attention over the rounded keys and
  values, a block takes half the bytes of a 16-bit one (so twice the blocks in the same budget).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from parallel.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.quant import parse_quant_config
from parallel.quant.packed import PackedWeight
from parallel.quant.rtn import Options, quantize
from parallel.state import Group
from tandem import LLM, SamplingParams
from tests.models import hf_greedy_batch, prompts_of_lengths, tiny_model
from workers.config import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("quantize_tool_fast", ROOT / "scripts" / "quantize.py")
qt = importlib.util.module_from_spec(_spec)
sys.modules["quantize_tool_fast"] = qt
_spec.loader.exec_module(qt)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = prompts_of_lengths([1, 5, 12], vocab_size=300, seed=7)


def _build(cls, tp: int, rank: int, o: Options, *args):
    return cls(*args, group=Group(ranks=list(range(tp)), rank=rank), quant_config=parse_quant_config(o.quantization_config()))


def _fill(layer, parts: list[dict], shard_ids) -> None:
    for sid, tensors in zip(shard_ids, parts):
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t, *(() if sid is None else (sid,)))
    layer.init_buffers()


PACK_CASES = {
    "gptq4_g32_sym": Options("gptq", bits=4, group_size=32),
    "gptq4_g16_asym_act": Options("gptq", bits=4, group_size=16, sym=False, desc_act=True),
    "gptq8_g32_act": Options("gptq", bits=8, group_size=32, desc_act=True),
    "gptq4_all": Options("gptq", bits=4, group_size=-1),
    "awq_g32": Options("awq", group_size=32),
    "fp8_block32": Options("fp8", block=(32, 32)),
    "fp8_channel": Options("fp8", fp8_scale="channel"),
    "fp8_tensor": Options("fp8", fp8_scale="tensor"),
}


@pytest.mark.parametrize("case", list(PACK_CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_kernel_layout_dequantizes_to_the_reference(case, tp):
    o = PACK_CASES[case]
    g = torch.Generator().manual_seed(0)
    perm_in = torch.randperm(128, generator=g) if o.desc_act else None
    perm_mid = torch.randperm(256, generator=g) if o.desc_act else None
    qkv_parts = [quantize(torch.randn(n, 128, generator=g), o, perm_in)[0] for n in (128, 64, 64)]
    gu_parts = [quantize(torch.randn(256, 128, generator=g), o, perm_in)[0] for _ in range(2)]
    down = quantize(torch.randn(128, 256, generator=g), o, perm_mid)[0]
    for rank in range(tp):
        layers = [(_build(QKVParallelLinear, tp, rank, o, 128, 16, 8, 4), qkv_parts, "qkv"),
                  (_build(MergedColumnParallelLinear, tp, rank, o, 128, [256, 256]), gu_parts, [0, 1]),
                  (_build(RowParallelLinear, tp, rank, o, 256, 128), [down], [None])]
        for layer, parts, ids in layers:
            _fill(layer, parts, ids)
            packed = layer.quant_method.pack(layer)
            if tp > 1 and o.desc_act and layer.row_parallel:
                # Act order scatters each group over every rank's inputs: no rank holds whole groups,
                # so the layer keeps the reference path (correct, not fast).
                assert packed is None
                continue
            assert isinstance(packed, PackedWeight), f"{case}: {type(layer).__name__} rank {rank} fell back"
            assert (packed.perm is not None) == bool(o.desc_act)
            torch.testing.assert_close(packed.dequantize(), layer.quant_method.dequantize(layer), rtol=0, atol=0)
            if o.method != "fp8":  # a quarter (4 bit) or half (8 bit) of bf16's bytes, plus one fp16 scale/zero per group
                assert packed.codes.dtype == torch.int32 and packed.codes.numel() * 32 // o.bits == packed.dequantize().numel()


def test_online_fp8_matches_hf_on_per_channel_dequantized_weights(tmp_path):
    src = tiny_model("qwen2")  # q/k/v biases too
    ref = str(tmp_path / "ref")
    qt.quantize_folder(src, str(tmp_path / "q"), Options("fp8", fp8_scale="channel"), dequantized_out=ref)
    llm = LLM(model=src, quantization="fp8", dtype="float32", device="cpu", show_progress=False, block_size=4)
    model = llm.llm_engine.executor.runner.model
    down = model.layers["0"].mlp.down_proj
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale.shape == (down.weight.shape[0], 1)
    assert model.lm_head.weight.dtype == torch.float32  # the head stays unquantized
    outs = llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    assert [o.token_ids for o in outs] == [t for t, _ in hf_greedy_batch(ref, PROMPTS, 8)]


def test_online_fp8_per_tensor_config():
    from parallel.quant.fp8 import online_fp8_config

    cfg = parse_quant_config(online_fp8_config("tensor"))
    layer = RowParallelLinear(64, 32, group=Group(ranks=[0], rank=0), quant_config=cfg)
    w = torch.randn(32, 64)
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.unique(layer.weight_scale).numel() == 1
    _, deq = quantize(w, Options("fp8", fp8_scale="tensor"))
    torch.testing.assert_close(layer.quant_method.dequantize(layer), deq, rtol=0, atol=0)
    with pytest.raises(ValueError, match="tandem_online"):
        parse_quant_config({**online_fp8_config(), "tandem_online": "block"})


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dummy_weights_are_quantized_at_load(method):
    llm = LLM(model=tiny_model("llama"), quantization=method, load_format="dummy", dtype="float32", device="cpu",
              show_progress=False, block_size=4)
    model = llm.llm_engine.executor.runner.model
    for layer in (model.layers["0"].self_attn.qkv_proj, model.layers["0"].mlp.down_proj):
        assert type(layer.quant_method).__name__.lower().startswith(method)
        w = layer.quant_method.dequantize(layer)
        assert 0 < w.abs().max() <= 0.011  # the dummy range, through 4-bit codes
        assert w.unique().numel() > 16  # many groups' scales, not one constant
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids
    llm.shutdown()


def test_quantization_at_load_refusals():
    with pytest.raises(ValueError, match="only fp8 quantizes at load"):
        LLM(model=tiny_model("llama"), quantization="gptq", device="cpu", show_progress=False)


# ---- FP8 KV cache ----

def _meta(lens: list[tuple[int, int]], bs: int):
    from workers.attention.backend import AttentionMetadata

    tables, slots, qsl, nxt = [], [], [0], 1
    for q_len, seq_len in lens:
        blocks = list(range(nxt, nxt + -(-seq_len // bs)))
        nxt += len(blocks)
        tables.append(blocks + [0] * (8 - len(blocks)))
        slots += [blocks[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
        qsl.append(qsl[-1] + q_len)
    return AttentionMetadata(torch.tensor(slots), torch.tensor(qsl, dtype=torch.int32),
                             torch.tensor([s for _, s in lens], dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
                             [q for q, _ in lens], [s for _, s in lens], max(q for q, _ in lens), max(s for _, s in lens))


@pytest.mark.parametrize("lens", [[(12, 12), (5, 9)], [(1, 13), (1, 6)]], ids=["prefill", "decode"])
def test_fp8_cache_attention_equals_attention_on_rounded_kv(lens):
    from workers.attention.torch_backend import TorchAttention

    g = torch.Generator().manual_seed(0)
    meta = _meta(lens, 4)
    t = sum(q for q, _ in lens)
    q, k, v = (torch.randn(t, h, 16, generator=g) * s for h, s in ((4, 1.0), (2, 600.0), (2, 1.0)))  # k beyond e4m3's 448
    ctx = torch.randn(2, 16, 4, 2, 16, generator=g)
    fp8 = ctx.to(torch.float8_e4m3fn)
    out = TorchAttention().forward(q, k, v, fp8, meta, 0.25)
    rounded = lambda x: x.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # noqa: E731
    ref = TorchAttention().forward(q, rounded(k), rounded(v), fp8.float(), meta, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch.isfinite(out).all()
    assert torch.isfinite(fp8.float()).all()  # |k| > 448 was clamped, not cast to NaN


def test_fp8_kv_cache_halves_block_bytes_and_doubles_blocks():
    kw = dict(model=DEFAULT_MODEL, dtype="bfloat16", device="cpu", show_progress=False, block_size=16,
              cpu_kv_cache_bytes=1 << 20, max_model_len=256)
    counts, outs = {}, {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(kv_cache_dtype=kv, **kw)
        r = llm.llm_engine.executor.runner
        counts[kv] = (r.num_blocks, r.kv_bytes_per_block(), r.kv_cache.dtype)
        outs[kv] = [o.token_ids for o in llm.generate([[1, 2, 3, 4, 5, 6, 7]], GREEDY)]
        llm.shutdown()
    assert counts["fp8_e4m3"][2] == torch.float8_e4m3fn and counts["auto"][2] == torch.bfloat16
    assert counts["fp8_e4m3"][1] * 2 == counts["auto"][1]
    assert counts["fp8_e4m3"][0] == 2 * counts["auto"][0]
    assert len(outs["fp8_e4m3"][0]) == 8


# ---- calibrated GPTQ and the perplexity report ----

def test_gptq_solver_beats_rtn_on_the_layer_output():
    """GPTQ minimises ||X W^T - X Q^T|| for the calibration inputs X: on correlated inputs it must beat
    round-to-nearest at the same format, and its tensors must dequantize to what it reports."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g) + 0.1 * torch.randn(512, 128, generator=g)
    w = torch.randn(64, 128, generator=g)
    for o in (Options("gptq", bits=4, group_size=32), Options("gptq", bits=4, group_size=-1, desc_act=True, sym=False)):
        tensors, deq = qt.gptq_solve(w, x.t() @ x, o)
        _, rtn = quantize(w, o, None)
        err = lambda q: (x @ (w - q).t()).pow(2).sum().item()  # noqa: E731
        assert err(deq) < 0.7 * err(rtn), (o, err(deq), err(rtn))
        layer = _build(RowParallelLinear, 1, 0, o, 128, 64)
        _fill(layer, [tensors], [None])
        torch.testing.assert_close(layer.quant_method.dequantize(layer), deq, rtol=0, atol=0)


def test_calibrated_gptq_checkpoint_matches_hf_on_dequantized(tmp_path):
    src = tiny_model("llama")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    o = Options("gptq", bits=4, group_size=32, desc_act=True)
    calib = qt.calibration_samples(src, text, 4, 32)
    dst, ref = str(tmp_path / "q"), str(tmp_path / "ref")
    qt.quantize_folder(src, dst, o, dequantized_out=ref, calibration=calib)
    import json

    assert "GPTQ, 4 calibration windows" in json.loads(Path(dst, "config.json").read_text())["quantization_config"]["meta"]["quantizer"][0]
    llm = LLM(model=dst, dtype="float32", device="cpu", show_progress=False, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    assert [o.token_ids for o in outs] == [t for t, _ in hf_greedy_batch(ref, PROMPTS, 8)]


def test_perplexity_script_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("perplexity_tool", ROOT / "scripts" / "perplexity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = str(ROOT / "README.md")
    report = mod.main(["--text", text, "--calibration-text", text, "--variants", "bf16,int4-channel (RTN),int4-channel (GPTQ)",
                       "--max-tokens", "1024", "--seqlen", "128", "--nsamples", "4", "--out", str(tmp_path / "p.json")])
    ppl = {k: v["perplexity"] for k, v in report["results"].items()}
    assert all(1.0 < v < 1e4 for v in ppl.values())
    assert ppl["int4-channel (RTN)"] > ppl["bf16"]  # 4-bit per-channel codes cost something
