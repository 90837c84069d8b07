"""Quantized GEMMs and the FP8 KV cache on CUDA, against the reference paths (issue 15).

* W4A16 / W8A16 Triton GEMV (1-4 rows) and GEMM (more rows) on GPTQ (sym, asym, act order, 8 bit,
  one group), AWQ and FP8-block weights: equal to F.linear on the reference dequantized weight
  (PackedWeight.dequantize, itself checked against each method's dequantize on CPU).
* FP8 W8A8 (_scaled_mm, per-token activations, per-channel weights): within FP8's activation error.
* Layers loaded from quantizer-written tensors take the kernel path on CUDA and match their CPU twin.
* FP8 KV cache: the Triton backend equals the torch backend on the same FP8 cache.
* End to end: a quantized tiny checkpoint generates on CUDA what HF generates on its dequantized weights
  (float32: the Triton kernels; bfloat16: the tinygemm int4 path for GPTQ / AWQ).
* tinygemm W4A16 (parallel/quant/tinygemm.py, bf16 activations): `_convert_weight_to_int4pack` writes the
  layout its plain-torch model says, the int4pack dequantize kernel reads it back, and the linear (tinygemm
  and dequantize + cuBLAS, with act order's column permutation) equals F.linear on the reference
  dequantized weight for GPTQ sym / asym / act order / one group and AWQ at 1, 3, 16, 100 rows, also
  replayed from a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.linear import MergedColumnParallelLinear, RowParallelLinear
from parallel.quant import parse_quant_config
from parallel.quant.rtn import Options, quantize
from parallel.state import Group

CUDA = torch.device("cuda")


def _layer(cls, o: Options, *args, device="cpu"):
    layer = cls(*args, group=Group(ranks=[0], rank=0), quant_config=parse_quant_config(o.quantization_config()))
    return layer.to(device)


def _loaded(o: Options, n_in: int, outs: list[int], seed: int = 0, perm: bool = False):
    """A MergedColumnParallelLinear (or Row for one output) filled from RTN-quantized random weights."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_in, generator=g) if perm else None
    layer = _layer(MergedColumnParallelLinear, o, n_in, outs)
    for i, n in enumerate(outs):
        tensors, _ = quantize(torch.randn(n, n_in, generator=g) * 0.05, o, order)
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t, i)
    layer.init_buffers()
    return layer


CASES = {
    "gptq4_g128_sym": (Options("gptq", bits=4, group_size=128), False),
    "gptq4_g32_asym_act": (Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), True),
    "gptq8_g64": (Options("gptq", bits=8, group_size=64), False),
    "gptq4_all": (Options("gptq", bits=4, group_size=-1), False),
    "awq_g128": (Options("awq", group_size=128), False),
    "awq_g64": (Options("awq", group_size=64), False),
    "fp8_block128": (Options("fp8", block=(128, 128)), False),
    "fp8_channel": (Options("fp8", fp8_scale="channel"), False),
}


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tol * scale, f"max error {err:.4g} vs max |ref| {scale:.4g}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [1, 3, 16, 100])
def test_kernel_matches_reference_dequantized_linear(case, rows):
    o, act = CASES[case]
    layer = _loaded(o, 512, [256, 384], perm=act)
    ref_w = layer.quant_method.dequantize(layer)  # CPU reference, float32 [640, 512]
    layer = layer.to(CUDA)
    layer.init_buffers()
    layer.quant_method.process_weights(layer)
    packed = layer.packed
    assert packed is not None
    torch.testing.assert_close(packed.dequantize().cpu(), ref_w, rtol=0, atol=0)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(CUDA, torch.bfloat16)
    ref = F.linear(x, ref_w.to(CUDA, torch.bfloat16))
    y = layer(x)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    w8a8 = packed.w8a8_scale is not None and rows > 4
    _close(y, ref, 0.08 if w8a8 else 0.02)  # W8A8 also rounds the activations to e4m3
    if not w8a8:  # compare with the fp32 product of the same bf16 inputs: the kernels accumulate in fp32
        exact = x.float() @ ref_w.to(CUDA, torch.bfloat16).float().t()
        _close(y, exact, 0.01)


def test_row_parallel_bias_and_graph_capture():
    o = Options("gptq", bits=4, group_size=128)
    g = torch.Generator().manual_seed(1)
    layer = _layer(RowParallelLinear, o, 1024, 256)
    tensors, deq = quantize(torch.randn(256, 1024, generator=g) * 0.05, o)
    for name, t in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    layer = layer.to(CUDA)
    layer.init_buffers()
    layer.quant_method.process_weights(layer)
    x = torch.randn(1, 1024, device=CUDA, dtype=torch.bfloat16)
    eager = layer(x)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    layer(static_x)  # compile outside the capture
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_y, eager)
    _close(eager, F.linear(x, deq.to(CUDA, torch.bfloat16)), 0.02)


def test_fp8_kv_cache_triton_equals_torch_backend():
    from workers.attention.backend import AttentionMetadata
    from workers.attention.torch_backend import TorchAttention
    from workers.attention.triton_backend import TritonAttention

    torch.manual_seed(0)
    hq, hkv, d, bs, nb = 8, 2, 64, 16, 64
    lens = [(40, 40), (1, 77), (1, 130), (25, 60)]  # (new tokens, seq_len): prefill, decodes, chunk
    lens = sorted(lens, key=lambda t: t[0] != 1)  # decodes first, as the runner orders them
    tables, slots, qsl = [], [], [0]
    next_block = 1
    for q_len, seq_len in lens:
        blocks = list(range(next_block, next_block + -(-seq_len // bs)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (16 - len(blocks)))
        slots += [blocks[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
        qsl.append(qsl[-1] + q_len)
    t = qsl[-1]
    meta = AttentionMetadata(torch.tensor(slots, device=CUDA), torch.tensor(qsl, device=CUDA, dtype=torch.int32),
                             torch.tensor([s for _, s in lens], device=CUDA, dtype=torch.int32),
                             torch.tensor(tables, device=CUDA, dtype=torch.int32), [q for q, _ in lens],
                             [s for _, s in lens], max(q for q, _ in lens), max(s for _, s in lens),
                             num_decodes=sum(q == 1 for q, _ in lens))
    q = torch.randn(t, hq, d, device=CUDA, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=CUDA, dtype=torch.bfloat16) * 3
    v = torch.randn(t, hkv, d, device=CUDA, dtype=torch.bfloat16)
    cache = (torch.randn(2, nb, bs, hkv, d, device=CUDA) * 2).to(torch.float8_e4m3fn)  # the cached context
    c_torch, c_triton = cache.clone(), cache.clone()
    ref = TorchAttention().forward(q, k, v, c_torch, meta, d ** -0.5)
    out = TritonAttention().forward(q, k, v, c_triton, meta, d ** -0.5)
    assert torch.equal(c_torch.view(torch.uint8), c_triton.view(torch.uint8)), "the two backends wrote different bytes"
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # And the FP8 cache is really coarser than bf16: a bf16 cache of the same values answers differently.
    bf16_cache = cache.to(torch.bfloat16)
    exact = TorchAttention().forward(q, k, v, bf16_cache, meta, d ** -0.5)
    assert (exact - ref).abs().max() > 1e-3


@pytest.mark.parametrize("method,dtype", [("gptq", "float32"), ("awq", "float32"), ("fp8", "float32"),
                                          ("gptq", "bfloat16"), ("awq", "bfloat16")])
def test_quantized_checkpoint_on_cuda_matches_hf_on_dequantized(tmp_path, method, dtype):
    import importlib.util
    import sys
    from pathlib import Path

    from tandem import LLM, SamplingParams
    from tests.models import hf_greedy_batch, hf_model, prompts_of_lengths, tiny_model

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("quantize_tool_gpu", root / "scripts" / "quantize.py")
    qt = importlib.util.module_from_spec(spec)
    sys.modules["quantize_tool_gpu"] = qt
    spec.loader.exec_module(qt)
    o = {"gptq": Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), "awq": Options("awq", group_size=32),
         "fp8": Options("fp8", fp8_scale="channel")}[method]
    dst, ref = str(tmp_path / "q"), str(tmp_path / "ref")
    qt.quantize_folder(tiny_model("llama"), dst, o, dequantized_out=ref)
    prompts = prompts_of_lengths([3, 9, 17, 30], vocab_size=300, seed=5)
    llm = LLM(model=dst, device="cuda", dtype=dtype, show_progress=False, block_size=16)
    layer = llm.llm_engine.executor.runner.model.layers["0"].mlp.down_proj
    assert getattr(layer, "packed", None) is not None, "the CUDA layer did not take the kernel path"
    if dtype == "bfloat16":  # 4-bit GPTQ / AWQ in bf16: PyTorch's tinygemm int4 kernel
        assert getattr(layer.packed, "kernel", None) == "tinygemm", getattr(layer, "tinygemm_skipped", None)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    llm.shutdown()
    hf = hf_greedy_batch(ref, prompts, 8)
    want = [t for t, _ in hf]
    got = [o.token_ids for o in outs]
    agree = sum(a == b for x, y in zip(want, got) for a, b in zip(x, y)) / sum(len(x) for x in want)
    # fp32 with TF32 tensor cores in the GEMM (and W8A8's e4m3 activations) can flip a near-tie late on;
    # a wrong layout or kernel gives garbage from the first token.
    if dtype == "float32":
        assert [x[0] for x in got] == [x[0] for x in want]
        assert agree >= (0.6 if method == "fp8" else 0.85), (got, want)
        return
    # bf16 activations and KV cache (8 bits of mantissa) against HF's fp32 flip near-ties on this random tiny model
    # (2026-11-26 and 11-29: one first token of four; 0.62 of the tokens agreeing), and after a flip the two continue
    # from different prefixes. So each of our tokens is judged on our own prefix: HF, fed prompt + our tokens, must
    # rank it within 0.1 nats of its best choice at every step. A wrong layout or kernel misses by nats.
    model = hf_model(ref)
    for prompt, ours in zip(prompts, got):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        gaps = lp.max(dim=-1).values - lp[torch.arange(len(ours)), torch.tensor(ours)]
        assert gaps.max().item() < 0.1, f"tokens {ours}: HF ranks step {gaps.argmax().item()} below its best by " \
                                         f"{gaps.max().item():.3f} nats (gaps {[round(g, 3) for g in gaps.tolist()]})"


@pytest.mark.parametrize("plan", [{"mid": "fused", "large": "fused"}, {"mid": "dequant", "large": "dequant"},
                                  {"gemv": dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)}])
@pytest.mark.parametrize("case", ["gptq4_g128_sym", "awq_g64", "fp8_block128"])
def test_every_kernel_choice_matches_reference(case, plan):
    from parallel.kernels import quant_gemm

    o, act = CASES[case]
    layer = _loaded(o, 1024, [512], perm=act).to(CUDA)
    layer.init_buffers()
    ref_w = layer.quant_method.dequantize(layer)
    layer.quant_method.process_weights(layer)
    p = layer.packed
    for rows in (2, 48, 1500):
        x = torch.randn(rows, 1024, device=CUDA, dtype=torch.bfloat16)
        y = quant_gemm.matmul_q(x, p.codes, p.scales, p.zeros, p.group_size, p.bits, None, plan)
        _close(y, x.float() @ ref_w.to(torch.bfloat16).float().t(), 0.01)


# ---------------------------------------------------------------- tinygemm int4 (bf16 activations)

TINYGEMM_CASES = {
    "gptq4_g128_sym": (Options("gptq", bits=4, group_size=128), False),
    "gptq4_g32_asym_act": (Options("gptq", bits=4, group_size=32, sym=False, desc_act=True), True),
    "gptq4_g64_asym": (Options("gptq", bits=4, group_size=64, sym=False), False),
    "gptq4_all": (Options("gptq", bits=4, group_size=-1), False),
    "awq_g128": (Options("awq", group_size=128), False),
    "awq_g64": (Options("awq", group_size=64), False),
}


def _tinygemm_layer(case: str, n_in: int = 512, outs=(256, 384)):
    from parallel.quant import tinygemm

    o, act = TINYGEMM_CASES[case]
    layer = _loaded(o, n_in, list(outs), perm=act)
    ref_w = layer.quant_method.dequantize(layer)  # CPU reference, float32 [N, K]
    cpu_pw = layer.quant_method.pack(layer)
    layer = layer.to(CUDA)
    layer.init_buffers()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the activations' dtype, as the loader sets it
    try:
        layer.quant_method.process_weights(layer)
    finally:
        torch.set_default_dtype(previous)
    w = layer.packed
    assert isinstance(w, tinygemm.Int4PackWeight), getattr(layer, "tinygemm_skipped", None)
    assert layer.linear_kernel.startswith("tinygemm")
    return layer, w, ref_w, cpu_pw


@pytest.mark.parametrize("case", list(TINYGEMM_CASES))
def test_tinygemm_layout_and_dequantize_kernel(case):
    from parallel.quant import tinygemm

    layer, w, ref_w, cpu_pw = _tinygemm_layer(case)
    codes = tinygemm.unpack_codes(cpu_pw.codes)
    # The CUDA op's layout is the one the plain-torch model (and so the dequantize kernel) assumes.
    assert torch.equal(w.weight.cpu(), tinygemm.int4pack_reference(tinygemm.to_uint8_pairs(codes), w.inner_k_tiles))
    model = tinygemm.dequantize_int4pack_reference(w.weight.cpu(), w.scales_and_zeros.cpu(), w.group_size)
    torch.testing.assert_close(w.dense(torch.float32).cpu(), model, rtol=0, atol=0)
    # What tinygemm itself computes: x = I gives W.T (bf16 fma of (q - 8) * scale + zero, one rounding).
    eye = torch.eye(w.in_features, device=CUDA, dtype=torch.bfloat16)
    tiny_w = torch.ops.aten._weight_int4pack_mm(eye, w.weight, w.group_size, w.scales_and_zeros).float().t().cpu()
    torch.testing.assert_close(tiny_w, model, rtol=2**-7, atol=1e-6)
    # And the reference weight, within bf16's rounding of scale and zero (|q - 8|, |8 - z| <= 8).
    deq = w.dequantize().cpu()
    assert (deq - ref_w).abs().max() <= cpu_pw.scales.float().max() / 16


@pytest.mark.parametrize("case", list(TINYGEMM_CASES))
@pytest.mark.parametrize("rows", [1, 3, 16, 100])
def test_tinygemm_matches_reference_dequantized_linear(case, rows):
    layer, w, ref_w, _ = _tinygemm_layer(case)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(CUDA, torch.bfloat16)
    exact = x.float() @ ref_w.to(CUDA, torch.bfloat16).float().t()
    measured = w.dequant_rows
    for dequant_rows in (None, 1, measured):  # tinygemm at every size, dequantize + cuBLAS, the measured split
        w.dequant_rows = dequant_rows
        y = layer(x)
        assert y.shape == exact.shape and y.dtype == torch.bfloat16
        _close(y, exact, 0.01)


def test_tinygemm_under_cuda_graph_capture():
    layer, w, ref_w, _ = _tinygemm_layer("gptq4_g32_asym_act")  # act order: the index_select is captured too
    w.dequant_rows = 64
    for rows in (1, 4, 80):  # tinygemm, tinygemm, dequantize + cuBLAS
        x = torch.randn(rows, 512, device=CUDA, dtype=torch.bfloat16)
        eager = layer(x)
        static_x = x.clone()
        layer(static_x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        static_x.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_y, eager)
        _close(eager, x.float() @ ref_w.to(CUDA, torch.bfloat16).float().t(), 0.01)


def test_tinygemm_probe_passes_on_this_gpu():
    from parallel.quant import tinygemm

    assert tinygemm.probe(CUDA) is None
