"""Structured-output request fields -> one `StructuredOutputs` for the engine, as vLLM reads them:

- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} (the schema is always enforced, strict or not);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"};
- vLLM's older names `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (`guided_decoding_backend` may only name xgrammar or auto);
- chat's `tool_choice` "required" / a named function (router/openai_protocol.py builds their schema).

At most one constraint per request. Each is checked here with the engine's grammar builder
(engine/grammar.py), so a spec the engine cannot honour is a 400 that says why, naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from engine.grammar import GrammarError, check_structured_outputs
from router.errors import bad_request
from workers.sampling_params import StructuredOutputs

BACKENDS = (None, "", "auto", "xgrammar")  # guided_decoding_backend values that mean this engine
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def _spec(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(kind="json", spec=_schema_text(value, param))
    if kind == "json_object":
        return StructuredOutputs(kind="json_object")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        return StructuredOutputs(kind="choice", spec=json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return StructuredOutputs(kind=kind, spec=value)


def from_field(kind: str, value: Any, param: str) -> StructuredOutputs:
    """One constraint of `kind` (json, json_object, regex, choice, grammar) from a front end's field
    `param` (gRPC's json_schema, regex, ...), a bad value a 400 naming that field."""
    return _spec(kind, value, param)


def from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputs | None:
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(kind="json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        return _spec("json", spec["schema"], "response_format.json_schema.schema")
    raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format")


def from_structured_outputs(so: dict[str, Any] | None) -> StructuredOutputs | None:
    if not so:
        return None
    unknown = sorted(k for k, v in so.items() if k not in _SO_KINDS and v not in (None, False, "", [], {}))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported ({', '.join(_SO_KINDS)} are)",
                          f"structured_outputs.{unknown[0]}")
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"structured_outputs needs exactly one of {', '.join(_SO_KINDS)}, got {given or 'none'}",
                          "structured_outputs")
    return _spec(given[0], so[given[0]], f"structured_outputs.{given[0]}")


def from_guided(fields: dict[str, Any]) -> list[tuple[str, StructuredOutputs]]:
    """(field name, spec) of each guided_* field set."""
    out = []
    for kind in ("json", "regex", "choice", "grammar"):
        value = fields.get(f"guided_{kind}")
        if value is not None:
            out.append((f"guided_{kind}", _spec(kind, value, f"guided_{kind}")))
    backend = fields.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
                          "guided_decoding_backend")
    return out


def resolve(candidates: list[tuple[str, StructuredOutputs | None]]) -> StructuredOutputs | None:
    """The request's one constraint among (field, spec) candidates, checked against the engine: 400
    for two at once, or for one the grammar engine cannot honour (the message says why)."""
    given = [(name, so) for name, so in candidates if so is not None]
    if len(given) > 1:
        raise bad_request(f"give one structured-output constraint, not {len(given)} ({', '.join(n for n, _ in given)})",
                          given[1][0])
    if not given:
        return None
    name, so = given[0]
    try:
        check_structured_outputs(so)
    except GrammarError as e:
        raise bad_request(f"{name}: {e}", name) from None
    return so
