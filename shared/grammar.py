"""Grammars for constrained sampling, in llguidance's serialized form, and its token table.

The gateway turns a request's `response_format` or `grammar` into one grammar string (checked
here, so a bad one is a 400 before any worker sees it); the string travels in
`SamplingParams.grammar`; the worker builds an `llguidance.LLMatcher` from it and the model's
token table (`token_table`), and masks each step's logits with it (worker.sched.constraint).

llguidance (Rust, no torch) is the engine llama.cpp and vLLM use: it computes a 49k-token mask in
~0.1 ms on this host, so no grammar cache of masks is needed.
"""
from __future__ import annotations

import json
from typing import Any

import llguidance

from shared.errors import InvalidRequestError
from shared.vocab import CONTROL, USER_DEFINED, Vocab, piece_table

# JSON output as OpenAI's models write it: ", " and ": " and no other whitespace. With llguidance's
# default (any whitespace anywhere) a 135M model easily fills max_tokens with newlines.
# A schema's own "x-guidance" options still override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The budgets llguidance checks while it builds a grammar and while it computes each mask: a
# grammar over them is refused ("too complex") instead of stalling a worker's step.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)

# Digits a JSON number may have, as llama.cpp's json-schema-to-grammar caps them: without a cap
# a small model under greedy decoding may write `"population": 1111...` until max_tokens.
# llguidance has no option for it, so each integer or number a schema types gets
# bounds (minimum/maximum) and, for numbers, a multipleOf of 1e-10 (llguidance refuses finer
# steps), unless the schema bounds that side itself. Exponents are not written then.
INTEGER_DIGITS = 16
FRACTION_DIGITS = 10
_NUMBER_CAP = 10 ** INTEGER_DIGITS - 1
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties",
                  "unevaluatedItems", "contains", "if", "then", "else")

# What llguidance says when a budget ran out; such grammars are "too complex", not "invalid".
_TOO_COMPLEX_MARKERS = ("fuel", "too complex", "too many", "limit", "max_")


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


def json_schema_grammar(schema: dict[str, Any], param: str) -> str:
    """The grammar of JSON documents that validate against `schema`; InvalidRequestError naming `param`."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"'{param}' is not a usable JSON schema: {_one_line(exc)}", param=param) from None


def bounded_numbers(schema: Any) -> Any:
    """A copy of `schema` whose typed integers and numbers have at most INTEGER_DIGITS digits
    before the point and FRACTION_DIGITS after it (the schema's own bounds win). Walks the
    subschema keywords only (not const, enum or examples, which are data), without recursion:
    a schema may nest as deep as the JSON parser allows."""
    root = _copy(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "integer" in types or "number" in types:
            _bound(node, fractions="number" in types and "integer" not in types)
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node.get(key) for key in _SCHEMA_VALUES)
    return root


def _bound(node: dict, fractions: bool) -> None:
    def number(key: str) -> float | None:
        value = node.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    low = [v for v in (number("minimum"), number("exclusiveMinimum")) if v is not None]
    high = [v for v in (number("maximum"), number("exclusiveMaximum")) if v is not None]
    if not low and (not high or min(high) > -_NUMBER_CAP):
        node["minimum"] = -_NUMBER_CAP
    if not high and (not low or max(low) < _NUMBER_CAP):
        node["maximum"] = _NUMBER_CAP
    if fractions and "multipleOf" not in node:
        node["multipleOf"] = 10.0 ** -FRACTION_DIGITS


def _copy(value: Any) -> Any:
    """A deep copy of JSON data (dicts and lists), without recursion."""
    if not isinstance(value, (dict, list)):
        return value
    root = type(value)(value)
    stack = [root]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in list(items):
            if isinstance(item, (dict, list)):
                node[key] = type(item)(item)
                stack.append(node[key])
    return root


def lark_grammar(text: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(text)


def regex_grammar(text: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(text)


def check_grammar(grammar: str, param: str) -> None:
    """Raise InvalidRequestError naming `param` unless llguidance can build `grammar`.

    Building is bounded by LIMITS (fuel, states, size), so this returns within a fraction of a
    second even for a hostile schema; the gateway still runs it off the event loop."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    if not is_error:
        return
    message = _one_line(messages[0]) if messages else "rejected by the grammar engine"
    if any(marker in message.lower() for marker in _TOO_COMPLEX_MARKERS):
        raise InvalidRequestError(f"'{param}' is too complex to enforce: {message}", param=param,
                                  code="grammar_too_complex")
    raise InvalidRequestError(f"'{param}' is not supported: {message}", param=param)


def token_table(vocab: Vocab, end_ids: list[int], n_vocab: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: each token's bytes, special tokens marked with a 0xFF
    prefix (llguidance's convention) so that no grammar can spell them as text.

    end_ids: the tokens that end generation; a grammar in an accepting state allows them.
    n_vocab: the model's logit count, when its output matrix is padded past the vocabulary."""
    pieces = piece_table(vocab)
    special = [i for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types))
               if kind == CONTROL or (kind == USER_DEFINED and text.startswith("<") and text.endswith(">"))]
    tokens = list(pieces)
    for i in special:
        tokens[i] = b"\xff" + tokens[i]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Pieces(tokens, special, end_ids, vocab.bos_id)),
                                  n_vocab=n_vocab, eos_token=end_ids or None)


class _Pieces:
    """What llguidance.TokenizerWrapper reads. Its encoder is only used for prompt healing, which
    Reame does not do, so a greedy longest-match over the pieces is enough."""

    def __init__(self, tokens: list[bytes], special: list[int], end_ids: list[int], bos_id: int | None):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = end_ids[0] if end_ids else 0
        self.bos_token_id = bos_id
        self._longest = max(len(t) for t in tokens)
        hidden = set(special)
        self._ids = {t: i for i, t in enumerate(tokens) if t and i not in hidden}

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            for size in range(min(self._longest, len(data) - i), 0, -1):
                token = self._ids.get(data[i:i + size])
                if token is not None:
                    out.append(token)
                    i += size
                    break
            else:
                i += 1  # a byte no token spells (cannot happen with a byte-complete vocabulary)
        return out


def schema_text(schema: Any) -> str:
    """Canonical JSON of a schema, for cache keys (key order does not matter)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())[:500] or type(exc).__name__
