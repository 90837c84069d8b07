"""Model names -> local folders: a folder is used as it is; anything else is a Hugging Face model ID.

An ID (`owner/name`, optionally at a `revision`: branch, tag or commit) resolves through huggingface_hub's
cache, as vLLM and transformers do: a snapshot already in the cache is used without a network call,
otherwise the files the engine reads are downloaded into the cache (`HF_HUB_CACHE` / `HF_HOME` choose
where; `HF_TOKEN` authenticates; `HF_HUB_OFFLINE=1` forbids the download). Only what the engine loads is
fetched: configs, the tokenizer, the chat template and safetensors weights (no .bin or .pth duplicates).
"""
from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

# What the engine reads from a model folder (workers/loader.py, the tokenizer, generation defaults).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_model_id(name: str) -> bool:
    """True when `name` is not an existing path and has the shape of a Hugging Face model ID."""
    return not os.path.exists(name) and bool(_REPO_ID.match(name)) and ".." not in name


def resolve_model_path(name: str, revision: str | None = None) -> str:
    """The local folder of model `name` (a folder, or a Hugging Face ID resolved through the cache)."""
    if not is_model_id(name):
        if revision is not None:  # as vLLM: a folder is what it is
            log.warning("revision %r ignored: it applies to Hugging Face model IDs, and %r is a local folder", revision, name)
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:  # the cache first: no network call when the snapshot is there
        return snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as e:
        raise ValueError(f"model {name!r} is neither a local folder nor a valid Hugging Face model ID: {e}") from None
    what = f"model {name!r}" + (f" at revision {revision!r}" if revision else "")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"{what}: not a local folder, and not in the Hugging Face cache ({_cache_dir()}) while "
                         f"HF_HUB_OFFLINE is set")
    try:
        return snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except Exception as e:  # not found, gated, no network: the user's to fix, with Hugging Face's reason
        raise ValueError(f"{what}: not a local folder, and downloading it from the Hugging Face Hub failed "
                         f"({type(e).__name__}: {e})") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
