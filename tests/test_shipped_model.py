"""Checks on the checkpoint shipped in models/tandem-tiny (built by scripts/train_tiny_model.py).

Fast (a few seconds on one CPU core) and fully offline: everything loads from the local folder.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tandem-tiny"

PY_SNIPPET = '''import os
import sys


def list_files(directory, suffix=".py"):
    """Return the sorted names of the files in *directory* that end with *suffix*."""
    result = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and name.endswith(suffix):
            result.append(name)
    return result


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, n=1):
        self.count += n
        return self.count


if __name__ == "__main__":
    print(list_files(sys.argv[1]))
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    return m.float().eval()


def test_folder_contents_and_size():
    assert MODEL_DIR.is_dir(), f"{MODEL_DIR} missing: run scripts/train_tiny_model.py"
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "README.md"):
        assert required in names
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size < 10 * 1024 * 1024, f"shipped model folder is {size / 1e6:.2f} MB"


def test_config_and_weights():
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(MODEL_DIR, local_files_only=True)
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.tie_word_embeddings
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.max_position_embeddings == 1024
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert raw.get("dtype", raw.get("torch_dtype")) == "bfloat16" and raw["rope_theta"] == 10000.0
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
        emb = f.get_slice("model.embed_tokens.weight").get_shape()
    assert emb == [cfg.vocab_size, cfg.hidden_size]
    assert "lm_head.weight" not in keys  # tied


def test_tokenizer_matches_config(tokenizer):
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(MODEL_DIR, local_files_only=True)
    gen = GenerationConfig.from_pretrained(MODEL_DIR, local_files_only=True)
    assert len(tokenizer) == cfg.vocab_size
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == eos
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == eos
    assert gen.bos_token_id == gen.pad_token_id == eos
    gen_eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert eos in gen_eos and im_end in gen_eos
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(special) < cfg.vocab_size
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1
    text = "def f(x):\n    return x  # héllo wörld 日本語 🐍\n\ttab\r\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level: anything round-trips, nothing added
    assert max(ids) < cfg.vocab_size


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does os.path.join do?"},
        {"role": "assistant", "content": "Joins paths."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat does os.path.join do?<|im_end|>\n"
        "<|im_start|>assistant\nJoins paths.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt.endswith("<|im_end|>\n") and "assistant" not in no_prompt
    out = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1


@torch.no_grad()
def test_model_is_trained(tokenizer, model):
    vocab = model.config.vocab_size
    uniform = math.log(vocab)

    # Teacher-forced loss on unseen Python code: far below the uniform distribution's ln(V).
    ids = torch.tensor([tokenizer(PY_SNIPPET)["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 0.5 * uniform, f"per-token loss {loss:.2f} vs uniform {uniform:.2f}"

    # Greedy continuation of a Python-ish prompt: confident (low per-token loss) and readable text.
    prompt = tokenizer("import os\nimport sys\n\n\ndef ", return_tensors="pt")["input_ids"]
    gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False)
    new = gen[:, prompt.shape[1]:]
    assert new.shape[1] > 0
    logits = model(input_ids=gen).logits[:, prompt.shape[1] - 1 : -1]
    gen_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), new.reshape(-1)).item()
    assert gen_loss < 0.3 * uniform, f"greedy continuation loss {gen_loss:.2f} vs uniform {uniform:.2f}"
    text = tokenizer.decode(new[0], skip_special_tokens=True)
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    assert text.strip() and printable >= 0.95 * len(text), repr(text)
