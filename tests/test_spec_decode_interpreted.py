"""Speculative decoding through the GPU attention path on CPU: the engine with attention_backend="triton",
its kernels (decode, prefill, KV write, and the split-context kernel of parallel/kernels/verify_attention.py
that verification steps run) under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess since it must
be set before the kernels are defined). tandem-tiny in fp32, n-gram speculation batched next to a plain
decode and alone: greedy output token-identical to the same engine without speculation and to the torch
backend, with the split-context kernel actually run. The graphed path is tests/gpu/test_spec_decode_gpu.py."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

SCRIPT = r'''
import torch
torch.cuda.is_current_stream_capturing = lambda: False  # a CPU build of torch has no CUDA to ask
from parallel.kernels import verify_attention
from tandem import LLM, SamplingParams

calls = []
kernel = verify_attention.verify_attention
verify_attention.verify_attention = lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 numbers: 0 1 2 3",
           "The quick brown fox jumps over the lazy dog. " * 6 + "The quick"]
params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
kw = dict(device="cpu", dtype="float32", block_size=16, max_num_seqs=4, enable_prefix_caching=False, show_progress=False)
llm = LLM("models/tandem-tiny", attention_backend="triton", speculative_config=NGRAM, **kw)
eng = llm.llm_engine
batched = llm.generate(PROMPTS, params)
alone = llm.generate(PROMPTS[1:], params)
stats = eng.spec_decoder.metrics()
eng.spec_decoder = None
plain = llm.generate(PROMPTS, params)
ref = LLM("models/tandem-tiny", attention_backend="torch", **kw).generate(PROMPTS, params)
want = [o.token_ids for o in ref]
assert [o.token_ids for o in plain] == want
assert [o.token_ids for o in batched] == want, ([o.token_ids for o in batched], want)
assert alone[0].token_ids == want[1]
assert stats["spec_decode_num_accepted_tokens"] > 0, stats
assert calls and max(calls) > 1, calls  # verification steps ran on the split-context kernel
print("ok", len(calls), stats["spec_decode_num_accepted_tokens"])
'''


@pytest.mark.interpreted(SCRIPT, timeout=900)
def test_ngram_greedy_through_the_triton_attention_path_is_token_identical():
    out = run_interpreted(SCRIPT).strip()
    assert out.startswith("ok"), out
