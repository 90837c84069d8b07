"""FP8 W8A8 activations emitted by the kernel that produces them (parallel/quant/fp8_act.py), on CPU.

Through Triton's interpreter (TRITON_INTERPRET=1, a subprocess): the RMSNorm (with and without the residual add)
and SiLU-and-mul kernels asked for FP8 rows write the same 16-bit output as without, and codes and scales equal,
bit for bit, to `quant_fp8_rows` of that output (the consumer's own quantizer), scales also to the plain torch
definition (amax / 448), padding rows zero with scale 1; `quant_fp8_rows` pads in its one kernel, in one pass and
in two. The codes are not compared with torch's e4m3 cast here: the interpreter's float-to-e4m3 conversion (Triton
3.9) rounds ties away from zero and drops the carry into the exponent (124.4 -> 64, not 128), so it differs from
torch and from the GPU, where tests/gpu/test_fp8_fused_act.py compares the codes with torch exactly. In process: the W8A8 linear takes the attached codes (and only for the tensor they were made for, with
its row count, once), and the decoder layer and MLP ask each producer for the rows of the linear after it.
"""
from __future__ import annotations

import pytest
import torch

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
from parallel.kernels import fused_ops as fo
from parallel.kernels import quant_gemm as qg
from parallel.quant import fp8_act

torch.manual_seed(0)


def ref_codes(y, rows):
    """quant_fp8_rows's definition in plain torch, padded to `rows`."""
    y = y.float()
    s = (y.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    q = (y / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    pad = rows - y.shape[0]
    q = torch.cat([q, torch.zeros(pad, y.shape[1], dtype=torch.float8_e4m3fn)])
    return q, torch.cat([s, torch.ones(pad, 1)])


def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    a8 = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
    b8 = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
    assert torch.equal(a8, b8), (what, (a.float() - b.float()).abs().max().item())


checked = 0
for rows, pad_to in ((5, 16), (16, 16), (1, 16)):
    for n in (96, 1000):
        x = (torch.randn(rows, n) * 4).bfloat16()
        res = torch.randn(rows, n).bfloat16()
        w = (torch.rand(n) + 0.5).bfloat16()
        for residual in (None, res):
            plain = fo.rms_norm(x, w, 1e-5, residual)
            got = fo.rms_norm(x, w, 1e-5, residual, fp8_rows=pad_to)
            y, y0 = (got[0], plain[0]) if residual is not None else (got, plain)
            same(y, y0, "norm output")
            if residual is not None:
                same(got[1], plain[1], "residual output")
            q, s = fp8_act.take(y, pad_to)
            _, rs = ref_codes(y, pad_to)
            same(s, rs, ("norm scales", rows, n))
            kq, ks = qg.quant_fp8_rows(y, pad_to)
            same(q, kq, "norm vs quant_fp8_rows"); same(s, ks, "norm vs quant_fp8_rows scales")
            assert fp8_act.take(y, pad_to) is None  # taken once
            checked += 1
        gu = (torch.randn(rows, 2 * n) * 3).bfloat16()
        plain = fo.silu_and_mul(gu)
        y = fo.silu_and_mul(gu, fp8_rows=pad_to)
        same(y, plain, "silu output")
        q, s = fp8_act.take(y, pad_to)
        _, rs = ref_codes(y, pad_to)
        kq, ks = qg.quant_fp8_rows(y, pad_to)
        same(s, rs, ("silu scales", rows, n)); same(q, kq, ("silu vs quant_fp8_rows", rows, n)); same(s, ks, "silu")
        checked += 1
for k in (512, 9000):  # one pass (K <= 8192) and two
    x = (torch.randn(7, k) * 10).bfloat16()
    q, s = qg.quant_fp8_rows(x, 16)
    rq, rs = ref_codes(x, 16)
    same(s, rs, ("quant_fp8_rows scales", k)); same(q[7:], rq[7:], "padding codes")
    # the rows' codes: within the interpreter's rounding of the exact x / scale (a tie or a carry off by one step)
    v = (x.float() / rs[:7]).clamp(-448, 448)
    err = (q[:7].float() - v).abs() / v.abs().clamp(min=2 ** -6)
    assert err.max() <= 0.5 + 1e-6, (k, err.max())
    checked += 1
print("ok", checked)
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_fp8_activations_from_their_producers_in_the_triton_interpreter():
    out = run_interpreted(SCRIPT).strip()
    assert out == "ok 20", out


def test_w8a8_linear_takes_the_attached_codes_once_and_only_for_its_tensor(monkeypatch):
    pytest.importorskip("triton")
    from parallel.quant import fp8_act
    from parallel.quant import packed as pk

    got: list = []
    monkeypatch.setattr(pk, "_kernels", type("K", (), {"scaled_mm_fp8": staticmethod(
        lambda x, codes, w_scale, bias, input_scale, pre=None: got.append(pre) or x)}))
    w = pk.PackedWeight(torch.zeros(8, 32, dtype=torch.float8_e4m3fn), torch.ones(8, 1), None, 32, None,
                        w8a8_scale=torch.ones(1, 8))
    x = torch.zeros(6, 32, dtype=torch.bfloat16)
    codes = (torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(16, 1))
    fp8_act.attach(x, *codes)
    w.apply(x.clone(), None)  # another tensor: quantized by the GEMM itself
    w.apply(x, None)
    w.apply(x, None)  # taken by the first consumer
    fp8_act.attach(x, torch.zeros(32, 32, dtype=torch.float8_e4m3fn), torch.ones(32, 1))
    w.apply(x, None)  # made for another row count: not used
    assert [p is not None and p[0] is codes[0] and p[1] is codes[1] for p in got] == [False, True, False, False]
    assert got[0] is None and got[2] is None and got[3] is None
    static = pk.PackedWeight(w.codes, w.scales, None, 32, None, w8a8_scale=torch.ones(1, 8), act_scale=torch.ones(1))
    fp8_act.attach(x, *codes)
    static.apply(x, None)  # a static input scale: the codes are not its activations
    assert got[-1] is None
    assert w.fp8_input_rows(x) is None  # CPU: no W8A8 GEMM, nothing to emit


def test_decoder_layer_asks_each_producer_for_the_next_linears_rows(monkeypatch):
    """DecoderLayer / MLP wiring: input_layernorm gets qkv_proj's rows, post_attention_layernorm gate_up's,
    SiLU-and-mul down_proj's (each linear's `fp8_input_rows`, stubbed here: on CPU it is always None)."""
    from types import SimpleNamespace

    from parallel.linear import _TPLinear
    from workers.models import layers, transformer

    seen: list = []
    monkeypatch.setattr(_TPLinear, "fp8_input_rows",
                        lambda self, x: {"qkv": 16, "gate_up": 32, "down": 48}[self.tag] if hasattr(self, "tag") else None)
    real_norm = layers.RMSNorm.forward

    def norm(self, x, residual=None, fp8_rows=None):
        seen.append((self.tag, fp8_rows))
        return real_norm(self, x, residual)

    monkeypatch.setattr(layers.RMSNorm, "forward", norm)
    monkeypatch.setattr(transformer, "silu_and_mul",
                        lambda gu, fp8_rows=None: seen.append(("silu", fp8_rows)) or layers.silu_and_mul(gu))
    cfg = SimpleNamespace(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                          rope_scaling=None, mlp_bias=False, model_type="llama")
    from parallel.state import Group

    monkeypatch.setattr("parallel.linear.tp_group", lambda: Group(ranks=[0], rank=0))
    layer = transformer.DecoderLayer(cfg, transformer.ArchSpec(), 0, 64)
    for m, tag in ((layer.self_attn.qkv_proj, "qkv"), (layer.mlp.gate_up_proj, "gate_up"), (layer.mlp.down_proj, "down"),
                   (layer.input_layernorm, "ln1"), (layer.post_attention_layernorm, "ln2")):
        m.tag = tag
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
    layer.self_attn.forward = lambda positions, x: x  # attention itself is not what this test checks
    x = torch.randn(5, 32)
    layer(torch.arange(5), x, None)
    layer(torch.arange(5), x, torch.randn(5, 32))
    assert seen == [("ln1", 16), ("ln2", 32), ("silu", 48)] * 2, seen
