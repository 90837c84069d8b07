"""What the quantization tests share: scripts/quantize.py as a module (`qt`), the CPU engine they load
checkpoints into, and a tiny model whose config.json carries a given quantization_config."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

from tandem import LLM
from tests.models import tiny_model

ROOT = Path(__file__).resolve().parents[1]

if "quantize_tool" in sys.modules:
    qt = sys.modules["quantize_tool"]
else:
    _spec = importlib.util.spec_from_file_location("quantize_tool", ROOT / "scripts" / "quantize.py")
    qt = importlib.util.module_from_spec(_spec)
    sys.modules["quantize_tool"] = qt  # dataclasses look their module up there
    _spec.loader.exec_module(qt)


def cpu_llm(path: str, **kw) -> LLM:
    """The engine the quantization tests compare with HF: float32 on CPU, small blocks."""
    return LLM(model=path, dtype="float32", device="cpu", show_progress=False, block_size=4, **kw)


def with_quant_config(tmp_path: Path, qc: dict | None, arch: str = "llama") -> str:
    """A copy of the tiny `arch` model (plain weights) whose config.json says `quantization_config: qc`."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model(arch), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)
