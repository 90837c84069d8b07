"""The import graph of Tandem's six top-level packages, and the rules it must keep.

Why: the packages are layers (`LAYERS`, lowest first), and a layer may import only from itself and
lower ones. A lazy import inside a function breaks that as surely as one at the top of a file, so this
reads every import with `ast` (nested ones too, relative ones resolved) rather than trusting what
happens to be imported at start-up. tests/test_layering.py runs these checks in CI, and the Mermaid
diagram in docs/architecture.md is this file's `--diagram` output, so the doc cannot drift.

    python scripts/import_graph.py            # edge counts and violations; exit 1 on any violation
    python scripts/import_graph.py --diagram  # the Mermaid flowchart for docs/architecture.md
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS: tuple[str, ...] = ("parallel", "workers", "cluster", "engine", "router", "tandem")
MAX_FUNCTION_LINES = 80


def _files() -> list[Path]:
    """Every .py file of the six packages, skipping the generated gRPC stubs (not committed)."""
    return sorted(p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


@lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, at any depth; relative ones resolved."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]  # the package the file's relative imports start from (same for __init__)
    found: list[tuple[int, str]] = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> ["file:line -> module", ...], between the six only."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in _files():
        src = path.relative_to(ROOT).parts[0]
        for line, module in _imports(path):
            dst = module.split(".")[0]
            if dst in LAYERS and dst != src:
                edges[(src, dst)].append(f"{_rel(path)}:{line} -> {module}")
    return dict(sorted(edges.items()))


def upward_imports() -> list[str]:
    """Every import from a lower layer into a higher one."""
    return [f"{site} ({src} may not import {dst})" for (src, dst), sites in package_edges().items()
            if LAYERS.index(dst) > LAYERS.index(src) for site in sites]


def package_cycles() -> list[list[str]]:
    """Groups of packages that reach each other through imports (strongly connected, size > 1)."""
    succ: dict[str, set[str]] = {p: set() for p in LAYERS}
    for src, dst in package_edges():
        succ[src].add(dst)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in succ[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reachable = {p: reach(p) for p in LAYERS}
    groups = {tuple(q for q in LAYERS if q == p or (q in reachable[p] and p in reachable[q])) for p in LAYERS}
    return sorted(list(g) for g in groups if len(g) > 1)


def _is_triton(decorator: ast.expr) -> bool:
    """`@triton.jit`, `@triton.autotune(...)`, `@triton.heuristics(...)` and the like."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    while isinstance(target, ast.Attribute):
        target = target.value
    return isinstance(target, ast.Name) and target.id == "triton"


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions and methods whose body (docstring included, signature not) spans more than `limit` lines.

    Triton kernels (`@triton.jit`, `@triton.autotune(...)`, ...) are exempt: a kernel is one unit of
    device code that splitting would only scatter.
    """
    found: list[str] = []

    def visit(node: ast.AST, prefix: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, prefix, path)
                continue
            name = prefix + child.name
            lines = (child.end_lineno or child.lineno) - child.lineno + 1
            if (not isinstance(child, ast.ClassDef) and lines > limit
                    and not any(_is_triton(d) for d in child.decorator_list)):
                found.append(f"{_rel(path)}:{child.lineno} {name} ({lines} lines)")
            visit(child, f"{name}.", path)

    for path in _files():
        visit(_parse(path), "", path)
    return found


def mermaid() -> str:
    """The package graph as a Mermaid flowchart (importer --> imported), highest layer first, no counts."""
    order = LAYERS[::-1]
    edges = sorted(package_edges(), key=lambda e: (order.index(e[0]), order.index(e[1])))
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {pkg}" for pkg in order]
    lines += [f"    {src} --> {dst}" for src, dst in edges]
    return "\n".join(lines + ["```"])


def main(argv: list[str]) -> int:
    if "--diagram" in argv:
        print(mermaid())
        return 0
    for (src, dst), sites in package_edges().items():
        print(f"{src:>8} -> {dst:<8} {len(sites):4d} imports")
    violations = {
        "upward imports": upward_imports(),
        "package cycles": [" <-> ".join(c) for c in package_cycles()],
        f"functions over {MAX_FUNCTION_LINES} lines": long_functions(),
    }
    for title, items in violations.items():
        if items:
            print(f"\n{title}:")
            print("\n".join(f"  {item}" for item in items))
    return 1 if any(violations.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
