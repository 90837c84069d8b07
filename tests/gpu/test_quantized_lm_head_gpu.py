"""A GPTQ-quantized LM head on CUDA (issue 15; parallel/embedding.py QuantizedLMHead): after the loader's
`process_weights` it runs on the 4-bit kernels (not the reference dequantize), its logits equal the bf16 inputs'
fp32 product with the dequantized head at 1, 3 and 64 rows, a CUDA graph replays them, and greedy picks the
reference's best token or one within rounding of it."""
from __future__ import annotations

import pytest
import torch

from parallel.embedding import QuantizedLMHead
from parallel.quant import parse_quant_config
from parallel.quant.rtn import Options, quantize
from parallel.state import Group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB, HIDDEN = 32000, 4096  # Llama-2's head: 8 codes a word, groups of 128


@pytest.fixture(scope="module")
def head_and_reference():
    o = Options("gptq", bits=4, group_size=128, lm_head=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors, deq = quantize(torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.02, o)
    with torch.device("cuda"):
        head = QuantizedLMHead(VOCAB, HIDDEN, parse_quant_config(o.quantization_config()), Group([0], 0))
    for name, t in tensors.items():
        p = getattr(head, name)
        p.weight_loader(p, t)
    head.init_buffers()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the activations' dtype, as the loader sets it for process_weights
    try:
        head.quant_method.process_weights(head)
    finally:
        torch.set_default_dtype(previous)
    return head, deq.to(torch.bfloat16).float()


def test_head_runs_on_the_four_bit_kernels(head_and_reference):
    head, _ = head_and_reference
    assert "reference" not in head.linear_kernel, head.linear_kernel
    assert getattr(head, "packed", None) is not None


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_logits_and_greedy_match_the_dequantized_head(head_and_reference, rows):
    head, ref_w = head_and_reference
    x = (torch.randn(rows, HIDDEN, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
         .to(torch.bfloat16))
    exact = x.float() @ ref_w.t()  # [rows, VOCAB]
    logits = head.local_logits(x)
    assert logits.shape == (rows, VOCAB) and logits.dtype == torch.bfloat16
    err = (logits.float() - exact).abs().max().item()
    assert err <= 0.01 * exact.abs().max().item(), err
    ids, _ = head.greedy_tokens(x)
    best = exact.max(dim=-1).values
    chosen = exact.gather(1, ids[:, None]).squeeze(1)
    assert torch.all(best - chosen <= 2 * err + 1e-6)  # the best token, or a near-tie within the bf16 output's rounding


def test_graph_replay_equals_eager(head_and_reference):
    head, _ = head_and_reference
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    eager = head.local_logits(x).clone()
    static_x = x.clone()
    head.local_logits(static_x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = head.local_logits(static_x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_y, eager, rtol=0, atol=0)
