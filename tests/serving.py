"""Helpers for the front-end tests: a tiny model with a chat template, and a LocalBackend over it."""
from __future__ import annotations

import os
from pathlib import Path

from tests.models import BOS_TOKEN, EOS_TOKEN, build_model

# ChatML-like, in the tiny tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}" + BOS_TOKEN + "{{ m['role'] }}\n{{ m['content'] }}" + EOS_TOKEN + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + BOS_TOKEN + "assistant\n{% endif %}"
)

# Engine settings small enough for a shared 2-core machine.
ENGINE_KWARGS = dict(dtype="float32", device="cpu", num_blocks=96, block_size=16, max_num_batched_tokens=256)


def build_chat_model(path: str | os.PathLike) -> str:
    """The tiny Llama of tests/models.py plus a chat template (max_model_len 256, vocab 300)."""
    folder = build_model("llama", path)
    Path(folder, "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def make_backend(model: str, **overrides):
    """A LocalBackend over `model` (AppConfig args as overrides, e.g. max_waiting_requests=1)."""
    from router.config import AppConfig
    from router.local_backend import LocalBackend

    return LocalBackend.from_config(AppConfig(model=model, colocated=True, **{**ENGINE_KWARGS, **overrides}))
