"""`tandem bench NAME [ARGS...]`: the benchmarks of scripts/ behind one entry point.

Each benchmark stays a plain script (scripts/bench_NAME.py, runnable with python as documented in
docs/benchmarks.md); this runs it as `__main__` with the remaining arguments, so its own `--help`,
flags and JSON output are unchanged.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def benchmarks() -> dict[str, str]:
    """name -> the first line of the script's docstring."""
    found = {}
    for path in sorted(SCRIPTS.glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem.removeprefix("bench_")] = doc.splitlines()[0] if doc else ""
    return found


def listing() -> str:
    names = benchmarks()
    if not names:
        return f"no benchmarks found in {SCRIPTS} (they ship with a source checkout of Tandem)"
    width = max(map(len, names))
    return "\n".join(f"  {name:<{width}}  {summary}" for name, summary in names.items())


def run(name: str, argv: list[str]) -> int:
    path = SCRIPTS / f"bench_{name}.py"
    if not path.is_file():
        print(f"error: no benchmark {name!r}; available:\n{listing()}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [f"tandem bench {name}", *argv]
    try:
        # Not runpy.run_path: it resets argv[0] to the file, and the usage line should read `tandem bench NAME`.
        exec(compile(path.read_text(), str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})
    except SystemExit as e:  # a script's sys.exit(code) or argparse's exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
