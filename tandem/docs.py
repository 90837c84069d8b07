"""Reference tables generated from the config models, pasted into README.md between markers.

    python -m tandem.docs          # prints the tables; tests/test_cli.py checks README.md holds them
"""
from __future__ import annotations

import typing

from pydantic.fields import FieldInfo

from tandem.flags import _default_text, _unwrap_optional, flag_name

BEGIN, END = "<!-- engine-args:begin -->", "<!-- engine-args:end -->"


def _type_text(info: FieldInfo) -> str:
    base = _unwrap_optional(info.annotation)
    if typing.get_origin(base) is typing.Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(base))
    return getattr(base, "__name__", str(base)).replace("dict", "JSON object")


def _rows(model, names) -> list[str]:
    rows = []
    for name in names:
        info = model.model_fields[name]
        default = _default_text(info)
        rows.append(f"| `{name}` / `{flag_name(name)}` | {_type_text(info)} | `{default}` | {info.description or ''} |")
    return rows


def engine_args_table() -> str:
    from router.config import AppConfig
    from tandem.cli import SECTION_TITLES, SERVED_FIELDS
    from workers.config import SECTIONS, EngineArgs

    lines = [BEGIN]
    for section, model in SECTIONS.items():
        lines += ["", f"**{SECTION_TITLES[section][0].upper()}{SECTION_TITLES[section][1:]}**", "",
                  "| argument / flag | type | default | meaning |", "|---|---|---|---|"]
        lines += _rows(EngineArgs, model.model_fields)
    lines += ["", "**Served app only** (`tandem serve`, the Serve YAML's `args`)", "",
              "| argument / flag | type | default | meaning |", "|---|---|---|---|"]
    lines += _rows(AppConfig, SERVED_FIELDS)
    lines += ["", END]
    return "\n".join(lines)


if __name__ == "__main__":
    print(engine_args_table())
