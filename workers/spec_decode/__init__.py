"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and exact verification.

The engine proposes up to k tokens per decoding sequence (engine/spec_decode.py), the scheduler
reserves KV slots for them, and the target model runs the k+1 tokens of each sequence in one
forward pass (as a chunk of a chunked prefill). `verify.py` then keeps the longest prefix the
target agrees with: exactly for greedy requests, by rejection sampling (Leviathan et al., Chen et
al.) for sampled ones, so the output distribution is the target's either way.
"""
