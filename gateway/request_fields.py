"""A request field declared once: how the gateway reads it from a JSON body and how /openapi.json
describes it, side by side, so the document cannot drift from the validation.

gateway.requests lists each request's fields as tables of `Field`s; its parsers read the body
through them, and gateway.openapi turns the same tables into the request schemas. The readers here
name the field in every error. Every optional field also accepts null: the readers treat null as
"not given", and `optional` says so in the schema.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from shared.errors import InvalidRequestError
from shared.sampling import LIMITS, check

Schema = dict[str, Any]


@dataclass(frozen=True)
class Bounds:
    """What a request's limits depend on besides fixed constants: the config's `max_n`, and (for the
    document only) the model's vocabulary size, which bounds token ids once the prompt is tokenized."""
    max_n: int
    vocab_size: int | None = None


@dataclass(frozen=True)
class Field:
    """`schema(name, bounds)`: the field's JSON Schema. `read(body, name, bounds)`: its value, or an
    InvalidRequestError naming it; None where the parser reads it together with others (`tools`
    with `tool_choice`, gateway.tools), which tests/unit/test_openapi.py holds to the table too."""
    schema: Callable[[str, Bounds], Schema]
    read: Callable[[dict, str, Bounds], Any] | None = None


Fields = dict[str, Field]


def read_fields(fields: Fields, body: dict, bounds: Bounds) -> dict[str, Any]:
    """Every field of the table that has a reader → its value (missing and null ones: their defaults)."""
    return {name: field.read(body, name, bounds) for name, field in fields.items() if field.read is not None}


def properties(fields: Fields, bounds: Bounds) -> Schema:
    return {name: field.schema(name, bounds) for name, field in fields.items()}


# ---- field kinds --------------------------------------------------------------------------------

def flag(default: bool, description: str | None = None) -> Field:
    return Field(lambda name, b: optional("boolean", description=description),
                 lambda body, name, b: read_bool(body, name, default))


def text(description: str | None = None) -> Field:
    return Field(lambda name, b: optional("string", description=description),
                 lambda body, name, b: read_text(body, name))


def integer(default: int | None, low: int | None, high: int | Callable[[Bounds], int] | None,
            description: str | None = None) -> Field:
    """An integer in low..high; `high` may depend on the bounds (`n` ≤ max_n)."""
    def top(bounds: Bounds) -> int | None:
        return high(bounds) if callable(high) else high

    def schema(name: str, bounds: Bounds) -> Schema:
        limits = {key: value for key, value in (("minimum", low), ("maximum", top(bounds))) if value is not None}
        return optional("integer", description=description, **limits)

    return Field(schema, lambda body, name, bounds: read_int(body, name, default, low, top(bounds)))


def limited(kind: str, default: Any, description: str | None = None, *, row: str | None = None) -> Field:
    """A number (`kind` "number" or "integer") within its row of shared.sampling.LIMITS: the field's
    own name's, or `row`'s (max_completion_tokens has max_tokens's)."""
    def read(body: dict, name: str, bounds: Bounds) -> Any:
        if kind == "integer":
            limit = LIMITS[row or name]
            return read_int(body, name, default, limit.low, limit.high)
        return read_number(body, name, default)

    return Field(lambda name, b: optional(kind, description=description, **LIMITS[row or name].schema()), read)


# ---- schema pieces ------------------------------------------------------------------------------

def optional(kind: str | list[str], *, description: str | None = None, **constraints: Any) -> Schema:
    """An optional field of `kind` that may also be null."""
    kinds = [kind] if isinstance(kind, str) else list(kind)
    schema: Schema = {"type": [*kinds, "null"], **constraints}
    if description:
        schema["description"] = description
    return schema


# ---- readers ------------------------------------------------------------------------------------

def read_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def read_text(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"'{name}' must be a string", param=name)
    return value


def read_bool(body: dict, name: str, default: bool, *, label: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        label = label or name
        raise InvalidRequestError(f"'{label}' must be a boolean", param=label)
    return value


def read_int(body: dict, name: str, default: int | None, low: int | None, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    # 5.0 is 5; but orjson reads an integer beyond 64 bits as a float, and above 2**53 a float is
    # no longer the integer that was sent (-2**63 - 1 would become -2**63 and pass the range check).
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2 ** 53:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequestError(f"'{name}' is {value}; it must be {_range(low, high)}", param=name)
    return value


def read_number(body: dict, name: str, default: float) -> float:
    """A number within its row of shared.sampling.LIMITS."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"'{name}' must be a number", param=name)
    check(name, value)
    return float(value)


def _range(low: int | None, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    return f"between {low} and {high}"
