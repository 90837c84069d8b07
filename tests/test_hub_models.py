"""Hugging Face model IDs resolved through a local hub-layout cache, offline (workers/hub.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from workers.config import DEFAULT_MODEL
from workers.hub import is_model_id, resolve_model_path

REPO_ID = "tandem-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache holding REPO_ID at two commits: main -> COMMIT (the shipped tiny model) and
    tag v0 -> OLD (the same weights with max_position_embeddings changed, to tell them apart)."""
    import huggingface_hub.constants as hub_constants

    repo = tmp_path / ("models--" + REPO_ID.replace("/", "--"))
    for commit, ref in ((COMMIT, "main"), (OLD, "v0")):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(DEFAULT_MODEL, snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    config = repo / "snapshots" / OLD / "config.json"
    config.write_text(config.read_text().replace('"max_position_embeddings": ', '"max_position_embeddings": 1 + '))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: everything must come from the cache
    return repo


def test_model_id_shape():
    assert is_model_id("meta-llama/Llama-3.1-8B") and is_model_id("gpt2")
    assert not is_model_id(DEFAULT_MODEL) and not is_model_id("./no/such/../folder") and not is_model_id("a b/c")


def test_an_id_resolves_to_its_snapshot_and_generates_like_the_folder(hub_cache):
    assert resolve_model_path(REPO_ID) == str(hub_cache / "snapshots" / COMMIT)
    assert resolve_model_path(REPO_ID, "v0") == str(hub_cache / "snapshots" / OLD)
    assert resolve_model_path(REPO_ID, OLD) == str(hub_cache / "snapshots" / OLD)
    params = SamplingParams(max_tokens=8, temperature=0)
    by_id = LLM(REPO_ID, show_progress=False)
    assert by_id.llm_engine.config.model.model == str(hub_cache / "snapshots" / COMMIT)
    by_folder = LLM(DEFAULT_MODEL, show_progress=False)
    assert by_id.generate("def f(x):", params)[0].token_ids == by_folder.generate("def f(x):", params)[0].token_ids


def test_missing_ids_and_misplaced_revisions_are_clear_errors(hub_cache):
    with pytest.raises(ValueError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        LLM("tandem-test/not-there", show_progress=False)
    with pytest.raises(ValueError, match="revision"):
        resolve_model_path(REPO_ID, "no-such-tag")
    assert resolve_model_path(DEFAULT_MODEL, "v0") == DEFAULT_MODEL  # a folder is what it is (logged)


def test_served_name_of_an_id_is_the_id(hub_cache):
    from router.config import AppConfig

    assert AppConfig(model=REPO_ID).served_model_name == REPO_ID
    assert AppConfig(model=DEFAULT_MODEL).served_model_name == Path(DEFAULT_MODEL).name
