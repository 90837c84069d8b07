"""Command-line flags generated from the pydantic config models, so a flag cannot drift from its field.

Every field becomes `--field-name` with the field's type, choices (Literal), default and description
in its help. Flags default to `argparse.SUPPRESS`: only what the user typed reaches the namespace, so
`collect` returns exactly the given arguments and the models' own defaults and rules apply to the rest
(as for `LLM(...)` and the Serve YAML).
"""
from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Iterable

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from workers.config import DEFAULT_MODEL


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _json_value(kind: str):
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
        if kind == "dict" and not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{{\"key\": 1}}', not {text!r}")
        return value
    parse.__name__ = f"JSON {kind}"  # argparse names the type in its error messages
    return parse


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return json.dumps(info.default_factory())
    if info.default is PydanticUndefined:
        return "required"
    if info.default is None:
        return "unset"
    if info.default == DEFAULT_MODEL:
        return "the shipped models/tandem-tiny"
    return str(info.default).lower() if isinstance(info.default, bool) else str(info.default)


def add_field_flag(group: argparse._ActionsContainer, name: str, info: FieldInfo) -> None:
    """One flag for one field: its type, choices and default shown in the help."""
    base = _unwrap_optional(info.annotation)
    help_text = f"{(info.description or '').rstrip('.')} (default: {_default_text(info)})".lstrip(" ")
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text, "dest": name}
    origin = typing.get_origin(base)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is typing.Literal:
        choices = typing.get_args(base)
        kwargs.update(choices=choices, type=type(choices[0]))
    elif base in (int, float, str):
        kwargs.update(type=base, metavar=base.__name__.upper())
    elif origin is dict or base is dict:
        kwargs.update(type=_json_value("dict"), metavar="JSON")
    elif origin is list and typing.get_args(base) == (str,):
        kwargs.update(type=_comma_list, metavar="A,B,...")
    else:
        raise TypeError(f"no command-line form for field {name!r} of type {info.annotation!r}")
    group.add_argument(flag_name(name), **kwargs)


def add_model_flags(group: argparse._ActionsContainer, model: type[BaseModel], names: Iterable[str]) -> None:
    for name in names:
        add_field_flag(group, name, model.model_fields[name])


def collect(ns: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The given flags among `names`, as keyword arguments."""
    return {name: getattr(ns, name) for name in names if hasattr(ns, name)}
