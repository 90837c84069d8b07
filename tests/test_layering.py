"""The package layering (scripts/import_graph.py): no upward import, no cycle, no overlong function,
and the diagram in docs/architecture.md matches the code. Reads source with `ast`; imports nothing."""
from __future__ import annotations

import ast
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)


def test_no_upward_import():
    assert ig.upward_imports() == [], "a lower layer imports a higher one (LAYERS in scripts/import_graph.py)"


def test_no_cycle_between_packages():
    assert ig.package_cycles() == []


def test_no_function_over_80_lines_outside_triton_kernels():
    assert ig.long_functions(80) == [], "split these functions"


def test_architecture_diagram_matches_the_code():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- import-graph:begin -->\n(.*?)\n<!-- import-graph:end -->", doc, re.S)
    assert found, "docs/architecture.md lacks the import-graph markers"
    assert found.group(1).strip() == ig.mermaid(), "regenerate with: python scripts/import_graph.py --diagram"


@pytest.mark.parametrize("package", ig.LAYERS)
def test_package_has_a_docstring(package):
    tree = ast.parse((ROOT / package / "__init__.py").read_text(encoding="utf-8"))
    assert (ast.get_docstring(tree) or "").strip(), f"{package}/__init__.py needs a docstring saying what it holds"


def test_checker_sees_lazy_and_relative_imports_and_exempts_triton(tmp_path, monkeypatch):
    """The checker itself: a lazy relative import upward, a cycle, and a long Triton kernel."""
    for pkg in ig.LAYERS:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text('"""doc"""\n')
    (tmp_path / "workers" / "sub").mkdir()
    (tmp_path / "workers" / "sub" / "__init__.py").write_text("")
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "workers" / "sub" / "m.py").write_text(textwrap.dedent("""\
        import parallel.state

        def f():
            from ...engine import llm   # lazy and relative: workers -> engine, upward
            return llm
        """) + f"\n@triton.jit\ndef kernel():\n{body}\n\ndef long():\n{body}\n")
    (tmp_path / "engine" / "x.py").write_text("from workers.sub import m\nfrom . import y\n")
    monkeypatch.setattr(ig, "ROOT", tmp_path)

    assert ig.package_edges() == {
        ("engine", "workers"): ["engine/x.py:1 -> workers.sub"],
        ("workers", "engine"): ["workers/sub/m.py:4 -> engine"],
        ("workers", "parallel"): ["workers/sub/m.py:1 -> parallel.state"],
    }
    assert ig.upward_imports() == ["workers/sub/m.py:4 -> engine (workers may not import engine)"]
    assert ig.package_cycles() == [["workers", "engine"]]
    assert ig.long_functions(80) == ["workers/sub/m.py:91 long (82 lines)"]
