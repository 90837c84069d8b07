"""Tiny random Hugging Face models + a locally trained tokenizer, for CPU tests.

Each `build_*` function writes config.json, model.safetensors (float32), generation_config.json and
a tokenizer into a folder and returns the folder. Nothing is downloaded. Weights are drawn with a
large `initializer_range` so that greedy decoding does not collapse into ties or one repeated token.

Reuse from any test file:

    from tests.models import build_model, tiny_model
    path = build_model("llama", tmp_path / "llama")        # build into a given folder
    path = tiny_model("qwen3_moe")                          # built once per process, in a temp dir

`ARCHITECTURES` lists every name `build_model` accepts. Multi-process tests can build a model in the
parent and pass the folder to the children (the folder is self-contained).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Callable

import torch

# Sentences to train the byte-level BPE on; also handy as prompts.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "A scheduler decides which sequences run in the next step.",
    "Prefix caching reuses the blocks of a shared system prompt.",
    "Hello world! Tiny models make fast and deterministic tests.",
    "Once upon a time there was a small language model on a CPU.",
    "Chunked prefill splits a long prompt over several steps.",
    "Preemption frees the blocks of a sequence and recomputes it later.",
    "You are a helpful assistant. Answer the question briefly and clearly.",
    "numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]

EOS_TOKEN = "<|eos|>"
BOS_TOKEN = "<|bos|>"
PAD_TOKEN = "<|pad|>"
TOKENIZER_VOCAB_SIZE = 300  # 3 specials + 256 bytes + merges

# Shared tiny dimensions.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 128
MAX_POSITIONS = 256
MISTRAL_WINDOW = 40  # sliding window of the tiny Mistral (so tests reach it cheaply)
INIT_RANGE = 0.2  # std of the random weights; 0.02 (HF's default) gives degenerate, repetitive greedy output


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(path: str | os.PathLike):
    """Train a tiny byte-level BPE on CORPUS and save it (PreTrainedTokenizerFast) to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN, pad_token=PAD_TOKEN)
    fast.save_pretrained(str(path))
    return fast


# ---------------------------------------------------------------- configs


def _common(tokenizer, **overrides) -> dict:
    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kw.update(overrides)
    return kw


def _llama(tok, **o):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(tok, **o))


def _llama3_rope(tok, **o):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return LlamaConfig(**_common(tok, rope_parameters=rope, **o))


def _mistral(tok, **o):
    from transformers import MistralConfig

    # A sliding window: the engine caps max_model_len at it, where it equals full attention.
    return MistralConfig(**_common(tok, **{"sliding_window": MISTRAL_WINDOW, **o}))


def _qwen2(tok, **o):
    from transformers import Qwen2Config

    return Qwen2Config(**_common(tok, **o))  # q/k/v carry a bias


def _qwen3(tok, **o):
    from transformers import Qwen3Config

    # head_dim * heads (128) != hidden (64); per-head q/k RMSNorm; tied embeddings.
    return Qwen3Config(**_common(tok, **{"head_dim": 32, "tie_word_embeddings": True, **o}))


def _mixtral(tok, **o):
    from transformers import MixtralConfig

    return MixtralConfig(**_common(tok, **{"num_local_experts": 4, "num_experts_per_tok": 2, **o}))


def _qwen3_moe(tok, norm_topk_prob: bool, **o):
    from transformers import Qwen3MoeConfig

    # 3 layers: layer 1 dense via mlp_only_layers; with decoder_sparse_step=1 layers 0 and 2 are sparse.
    kw = {"num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": 1,
          "mlp_only_layers": [1], **o}
    return Qwen3MoeConfig(**_common(tok, **kw))


def _qwen3_moe_step2(tok, **o):
    # decoder_sparse_step=2: only odd layers (1, 3) are sparse, layer 0 and 2 are dense.
    return _qwen3_moe(tok, norm_topk_prob=True, **{"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [], **o})


CONFIGS: dict[str, Callable] = {
    "llama": _llama,
    "llama3_rope": _llama3_rope,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "qwen3_moe": lambda tok, **o: _qwen3_moe(tok, norm_topk_prob=True, **o),
    "qwen3_moe_nonorm": lambda tok, **o: _qwen3_moe(tok, norm_topk_prob=False, **o),
    "qwen3_moe_step2": _qwen3_moe_step2,
}
ARCHITECTURES = list(CONFIGS)


# ---------------------------------------------------------------- building


def build_model(name: str, path: str | os.PathLike, seed: int | None = None, **config_overrides) -> str:
    """Build the tiny model `name` (one of ARCHITECTURES) with random weights into `path`; returns it.

    `seed` defaults to one derived from the name, so architectures of equal shapes differ.
    `config_overrides` go to the HF config (e.g. num_hidden_layers=4, num_key_value_heads=4).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    if name not in CONFIGS:
        raise ValueError(f"unknown tiny model {name!r}; choose from {ARCHITECTURES}")
    if seed is None:
        seed = zlib.crc32(name.encode()) % 10_000
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    config = CONFIGS[name](tok, **config_overrides)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                     do_sample=False).save_pretrained(str(path))
    return str(path)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights around 1 (not exactly 1, so a missing norm would be noticed), every other weight
    and bias N(0, INIT_RANGE); the router gets a larger spread so that top-k routing has no near-ties."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("mlp.gate.weight") or "router" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(INIT_RANGE * torch.randn(p.shape, generator=g))


_cache: dict[tuple, str] = {}
_cache_lock = threading.Lock()
_cache_root: str | None = None


def tiny_model(name: str, seed: int | None = None, **config_overrides) -> str:
    """`build_model` into a per-process temp dir, memoised: each (name, seed, overrides) is built once."""
    global _cache_root
    key = (name, seed, repr(sorted(config_overrides.items())))
    with _cache_lock:
        if key not in _cache:
            if _cache_root is None:
                _cache_root = tempfile.mkdtemp(prefix="tandem-tiny-models-")
                atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
            folder = os.path.join(_cache_root, f"{name}-{len(_cache)}")
            _cache[key] = build_model(name, folder, seed, **config_overrides)
        return _cache[key]


def load_hf(path: str):
    """The Hugging Face reference model for a tiny-model folder (float32, eval, eager attention)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def prompts_of_lengths(lengths: list[int], vocab_size: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Random token-id prompts (ids >= `low`, skipping the special tokens) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------- references and checks


_hf_models: dict[str, torch.nn.Module] = {}
_hf_results: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def hf_model(path: str):
    """`load_hf(path)`, memoised per process."""
    if path not in _hf_models:
        _hf_models[path] = load_hf(path)
    return _hf_models[path]


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, *, ignore_eos: bool = True, min_new_tokens: int = 0,
              eos_token_id: int | list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of Hugging Face `generate(do_sample=False)` for one prompt, and the log-softmax of
    the raw logits at each step ([n, vocab], float32). Memoised per process.

    ignore_eos: HF has no such switch, so when it stops at EOS the generation is continued from the
    sequence so far (greedy decoding depends only on the prefix, so this is what ignoring EOS means).
    """
    key = (path, tuple(prompt), max_new_tokens, ignore_eos, min_new_tokens, repr(eos_token_id))
    if key in _hf_results:
        return _hf_results[key]
    model = hf_model(path)
    eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    eos_set = {eos} if isinstance(eos, int) else set(eos or [])
    seq, out, logits = list(prompt), [], []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            want = max_new_tokens - len(out)
            kw = dict(do_sample=False, max_new_tokens=want, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=model.generation_config.pad_token_id, eos_token_id=eos)
            if min_new_tokens > len(out):
                kw["min_new_tokens"] = min_new_tokens - len(out)
            ids = torch.tensor([seq])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            new = g.sequences[0, len(seq):].tolist()
            logits += [step[0].float() for step in g.logits]
            out += new
            seq += new
            if not ignore_eos and new and new[-1] in eos_set:
                break
    result = (out, torch.log_softmax(torch.stack(logits), dim=-1))
    _hf_results[key] = result
    return result


def hf_greedy_batch(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """`hf_greedy(..., ignore_eos=True)` for many prompts in ONE left-padded HF `generate` call (much
    cheaper on CPU than one call per prompt). EOS is switched off in the generation config, so every
    prompt gets exactly max_new_tokens tokens. Memoised per process."""
    key = ("batch", path, tuple(map(tuple, prompts)), max_new_tokens)
    if key in _hf_results:
        return _hf_results[key]
    model = hf_model(path)
    pad = model.generation_config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = model.generation_config
    saved_eos, gen.eos_token_id = gen.eos_token_id, None
    try:
        with torch.no_grad():
            g = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad,
                               output_logits=True, return_dict_in_generate=True)
    finally:
        gen.eos_token_id = saved_eos
    logprobs = torch.log_softmax(torch.stack(g.logits, dim=1).float(), dim=-1)  # [B, n, V]
    result = [(g.sequences[i, width:].tolist(), logprobs[i]) for i in range(len(prompts))]
    _hf_results[key] = result
    return result


def hf_greedy_argmax(path: str, prompts: list[list[int]], n: int, device: str = "cpu") -> list[list[int]]:
    """n greedy tokens per prompt by the plain argmax loop: the whole HF forward over the sequence so
    far at every step (no KV cache, no `generate`, EOS not special). Not memoised; on CUDA the model is
    freed (and the cache emptied) before returning."""
    model = load_hf(path)
    if device != "cpu":
        model = model.to(device)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            for _ in range(n):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            outs.append(ids[0, len(p):].tolist())
    if device != "cpu":
        del model
        torch.cuda.empty_cache()
    return outs


def fused_and_unfused_decode(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """Greedy outputs with log-probs, one prompt at a time (the batch-1 decode graph), first through the runner's
    graphs as captured (the fused decoder, where the model takes it), then with the graphs recaptured on the unfused
    decoder: (fused, unfused). Shuts the engine down."""
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        eng = llm.llm_engine
        runner = getattr(eng, "runner", None) or eng.executor.runner
        fused = [llm.generate([p], params)[0] for p in prompts]
        runner.model.fuse_decode = False
        runner.cuda_graphs = runner._capture_cuda_graphs()
        unfused = [llm.generate([p], params)[0] for p in prompts]
    finally:
        llm.llm_engine.shutdown()
    return fused, unfused


def assert_engine_clean(llm) -> None:
    """After every request finished or was aborted: nothing queued, no block owned, invariants hold."""
    engine = getattr(llm, "llm_engine", llm)
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests(), f"requests left: {list(engine.requests)}"
    assert not engine.scheduler.has_work and not engine.scheduler.seqs
    assert not getattr(engine.scheduler, "has_leases", False), "KV held or reserved for a peer pool"
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} KV blocks still owned"
    assert all(b.ref_count == 0 for b in bm.blocks)
