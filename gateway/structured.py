"""Structured output at the gateway: `response_format` and the `grammar` extension → one
llguidance grammar string (shared.grammar), checked before any worker sees it.

Parsing (`constraint_of`) is pure and names the field in every error. Compiling (`GrammarCache`)
runs llguidance in processes that are killed past a CPU limit (gateway.grammar_compiler), and
remembers each grammar or refusal by the SHA-256 of what was asked, so an agent that sends the
same schema with every call pays for it once; a timeout is never remembered for other tenants.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from llguidance.gbnf_to_lark import any_to_lark

from gateway.grammar_compiler import COMPILE_PROCESSES, CPU_LIMIT_S, CompilePool, CompileTimeout
from gateway.request_fields import Bounds, Field, Fields, Schema, optional
from shared import grammar as grammars
from shared.errors import InvalidRequestError

log = logging.getLogger("reame.structured")

COMPILE_TIMEOUT_S = CPU_LIMIT_S  # CPU seconds: a grammar llguidance cannot check in this long is too complex
TIMEOUT_MEMORY_S = 60.0  # how long a tenant's compile that timed out is refused to it again without compiling
CACHE_ENTRIES = 256
MAX_GRAMMAR_CHARS = 32768
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


@dataclass(frozen=True)
class Constraint:
    """What a request's output must follow, before compilation."""
    kind: Literal["json_schema", "lark", "regex"]
    source: str  # canonical JSON of the schema, or the grammar / regex text
    param: str  # the request field it came from, for errors


def constraint_of(body: dict) -> Constraint | None:
    """The request's `response_format` or `grammar` (at most one of them), or None for free text."""
    response_format = _response_format(body.get("response_format"))
    grammar = _grammar(body.get("grammar"))
    if response_format is not None and grammar is not None:
        raise InvalidRequestError("give 'response_format' or 'grammar', not both", param="grammar")
    return response_format or grammar


def _response_format_schema(name: str, bounds: Bounds) -> Schema:
    return {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": f"^{_SCHEMA_NAME.pattern}$"},
                "schema": {"type": "object"}, "strict": optional("boolean"), "description": {"type": "string"}}}}},
        {"type": "null"}],
        "description": "the output follows the JSON schema; one the engine cannot enforce is a 400 naming "
                       "response_format.json_schema.schema"}


def _grammar_schema(name: str, bounds: Bounds) -> Schema:
    return {"anyOf": [
        {"type": "string", "pattern": "\\S", "maxLength": MAX_GRAMMAR_CHARS},
        {"type": "object", "required": ["type", "value"], "properties": {
            "type": {"enum": ["lark", "regex"]},
            "value": {"type": "string", "pattern": "\\S", "maxLength": MAX_GRAMMAR_CHARS}}},
        {"type": "null"}],
        "description": "Reame extension: the output follows this Lark (or llama.cpp GBNF) grammar or regex; "
                       "not together with response_format"}


# The fields constraint_of reads, as /openapi.json describes them (gateway.requests.SAMPLING holds them).
CONSTRAINT_FIELDS: Fields = {
    "response_format": Field(_response_format_schema),
    "grammar": Field(_grammar_schema),
}


def json_schema_constraint(schema: Any, param: str) -> Constraint:
    """A JSON-schema constraint (also used for tool calls, gateway.tools)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"'{param}' must be a JSON Schema object", param=param)
    return Constraint("json_schema", grammars.schema_text(schema), param)


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", grammars.schema_text({"type": "object"}), "response_format")
    if kind != "json_schema":
        raise InvalidRequestError(f"'response_format.type' is {kind!r:.40}; it must be 'text', 'json_object' or "
                                  "'json_schema'", param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("'response_format.json_schema' must be an object with 'name' and 'schema'",
                                  param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise InvalidRequestError("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
                                  param="response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("'response_format.json_schema.strict' must be a boolean",
                                  param="response_format.json_schema.strict")
    schema = spec.get("schema", {})  # OpenAI: absent means any JSON value
    return json_schema_constraint(schema, "response_format.json_schema.schema")


def _grammar(value: Any) -> Constraint | None:
    """`grammar`: a Lark (or llama.cpp GBNF) grammar text, or {"type": "lark"|"regex", "value": text}."""
    if value is None:
        return None
    kind = "lark"
    if isinstance(value, dict):
        kind = value.get("type")
        if kind not in ("lark", "regex"):
            raise InvalidRequestError("'grammar.type' must be 'lark' or 'regex'", param="grammar.type")
        value = value.get("value")
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError("'grammar' must be a non-empty grammar text, or an object with 'type' "
                                  "('lark' or 'regex') and 'value'", param="grammar")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"'grammar' is {len(value)} characters; at most {MAX_GRAMMAR_CHARS} are allowed",
                                  param="grammar")
    return Constraint(kind, value, "grammar")


class GrammarCache:
    """Constraint → llguidance grammar string, compiled once per distinct constraint in a pool of
    processes (gateway.grammar_compiler) with a share per tenant.

    Grammars and llguidance's refusals are remembered for everyone: they depend only on what was
    asked. A compile stopped at its CPU limit is remembered for its sender only, for
    TIMEOUT_MEMORY_S (its retries cost nothing; nobody else inherits the refusal), and a compile
    that failed for the server's sake (busy, a process lost) is not remembered at all.
    compiler: for tests, a module-level stand-in for `_compile`."""

    def __init__(self, entries: int = CACHE_ENTRIES, timeout: float = COMPILE_TIMEOUT_S,
                 compiler: Callable[[Constraint], str] | None = None, processes: int = COMPILE_PROCESSES):
        self._entries = entries
        self._done: OrderedDict[str, str | InvalidRequestError] = OrderedDict()
        self._timed_out: OrderedDict[tuple[str, str], float] = OrderedDict()  # (tenant, key) -> until
        self._compiling: dict[tuple[str, str], asyncio.Future] = {}  # one compile per tenant and key at a time
        self.pool = CompilePool(compiler or _compile, size=processes, cpu_limit=timeout)
        self.compile_seconds = 0.0  # total, for bench/structured.py and logs
        self.hits = 0

    async def compile(self, constraint: Constraint, tenant: str = "") -> str:
        key = hashlib.sha256(f"{constraint.kind}\0{constraint.param}\0{constraint.source}".encode()).hexdigest()
        while (pending := self._compiling.get((tenant, key))) is not None:
            await asyncio.shield(pending)  # the same tenant sent it again before it compiled: its answer
        result = self._done.get(key)
        if result is not None:
            self.hits += 1
            self._done.move_to_end(key)
        elif self._timed_out.get((tenant, key), 0.0) > time.monotonic():
            self.hits += 1
            result = CompileTimeout(f"'{constraint.param}' is too complex to enforce: it did not compile within "
                                    f"{self.pool.cpu_limit:g} s of CPU time", param=constraint.param)
        else:
            pending = self._compiling[(tenant, key)] = asyncio.get_running_loop().create_future()
            try:
                result = await self._compile(constraint, tenant, key)
            finally:
                del self._compiling[(tenant, key)]
                pending.set_result(None)  # those waiting read what was remembered, or compile it themselves
        if isinstance(result, InvalidRequestError):
            raise type(result)(result.message, param=result.param, code=result.code)
        return result

    async def _compile(self, constraint: Constraint, tenant: str, key: str) -> str | InvalidRequestError:
        """Compile and remember; the refusal to give is returned, errors not about the grammar raised."""
        started = time.perf_counter()
        try:
            result: str | InvalidRequestError = await self.pool.compile(constraint, constraint.param, tenant)
        except CompileTimeout as exc:
            self._timed_out[(tenant, key)] = time.monotonic() + TIMEOUT_MEMORY_S
            while len(self._timed_out) > self._entries:
                self._timed_out.popitem(last=False)
            return exc
        except InvalidRequestError as exc:
            result = exc
        seconds = time.perf_counter() - started
        self.compile_seconds += seconds
        log.debug("%s %s compiled in %.1f ms%s", constraint.param, key[:12], seconds * 1e3,
                  "" if isinstance(result, str) else f" (refused: {result.message})")
        self._done[key] = result
        while len(self._done) > self._entries:
            self._done.popitem(last=False)
        return result


def _compile(constraint: Constraint) -> str:
    if constraint.kind == "json_schema":
        grammar = grammars.json_schema_grammar(orjson.loads(constraint.source), constraint.param)
    elif constraint.kind == "regex":
        grammar = grammars.regex_grammar(constraint.source)
    else:
        try:
            text = any_to_lark(constraint.source)  # GBNF (llama.cpp's `grammar`) becomes Lark; Lark stays
        except Exception as exc:  # the converter raises plain exceptions for text it cannot read
            raise InvalidRequestError(f"'{constraint.param}' is not a Lark or GBNF grammar: {exc}",
                                      param=constraint.param) from None
        grammar = grammars.lark_grammar(text)
    grammars.check_grammar(grammar, constraint.param)
    return grammar
