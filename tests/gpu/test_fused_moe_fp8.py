"""FP8 experts in the fused MoE kernel on a GPU: bf16 activations, e4m3 weights with 128 x 128 block scales
(the Qwen3 FP8 layout) and per-row scales, equal to the expert loop on the same dequantized weights, eager
and inside a CUDA graph (decode). The same kernel runs in Triton's interpreter in
tests/test_fused_moe_interpreted.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block128", "per_row"])
@pytest.mark.parametrize("tokens", [1, 37, 600])
def test_fp8_fused_moe_matches_the_expert_loop(block, tokens):
    from parallel.kernels.fused_moe import fused_moe
    from parallel.state import Group
    from workers.models.moe import Experts

    torch.manual_seed(0)
    e, h, i, k = 16, 512, 256, 4
    ex = Experts(e, h, i, group=Group(), fp8_block=block).cuda()
    for w in (ex.w13, ex.w2):
        w.data.copy_((torch.randn(w.shape, device="cuda") * 100).to(w.dtype))
    for s in (ex.w13_scale, ex.w2_scale):
        s.data.copy_(torch.rand(s.shape, device="cuda") * 1e-4 + 1e-5)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, device="cuda"), -1), k, -1)
    ex.use_fused = False
    want = ex(x, ids, weights).float()
    scales = (ex.w13_scale, ex.w13_block, ex.w2_scale, ex.w2_block)
    got = fused_moe(x, ex.w13, ex.w2, ids, weights, fp8_scales=scales).float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe(x, ex.w13, ex.w2, ids, weights, fp8_scales=scales)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, fused_moe(x, ex.w13, ex.w2, ids, weights, fp8_scales=scales))
