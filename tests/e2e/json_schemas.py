"""The structured-output suite: JSON schemas of the kinds agents send (nested objects, arrays,
enums, anyOf, numbers with ranges, string patterns and formats, required and optional keys, $ref),
each with the request that asks for it. tests/e2e/test_schema_suite.py runs every one on SmolLM2
and validates the answer with `jsonschema`.

Strings and arrays carry maxLength / maxItems where a 135M model would otherwise fill max_tokens:
the suite checks that what the model writes is valid, and an answer cut by max_tokens is not JSON.
"""
from __future__ import annotations

S = {"type": "string", "maxLength": 24}  # a short free string
WORD = {"type": "string", "pattern": "^[A-Za-z]{1,12}$"}
INT = {"type": "integer", "minimum": -1_000_000, "maximum": 1_000_000}
BOOL = {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, "additionalProperties": False, **extra}


SCHEMAS: dict[str, tuple[str, dict]] = {
    # ---- flat objects ----------------------------------------------------------------------------
    "person": ("a person called Ann aged 31", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}})),
    "city": ("the city of Paris", obj({"city": S, "country": S, "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000}})),
    "book": ("a book", obj({"title": S, "author": S, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    "flags": ("a user's settings", obj({"dark_mode": BOOL, "notifications": BOOL, "beta": BOOL})),
    "point": ("a point in 2D", obj({"x": {"type": "number"}, "y": {"type": "number"}})),
    "rgb": ("the colour orange", obj({c: {"type": "integer", "minimum": 0, "maximum": 255} for c in "rgb"})),
    "temperature": ("today's weather", obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60},
                                             "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}})),
    "probability": ("a forecast", obj({"chance_of_rain": {"type": "number", "minimum": 0, "maximum": 1}})),
    "exclusive": ("a positive price", obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}})),
    "percent": ("a test score", obj({"score": {"type": "integer", "minimum": 0, "maximum": 100}, "passed": BOOL})),
    "negative": ("a temperature below zero", obj({"value": {"type": "integer", "maximum": -1, "minimum": -273}})),
    # ---- optional keys ---------------------------------------------------------------------------
    "optional_middle": ("a contact", obj({"name": S, "email": S, "phone": S}, ["name"])),
    "all_optional": ("anything about a dog", obj({"name": S, "breed": S, "age": INT}, [])),
    "optional_bool": ("a task", obj({"title": S, "done": BOOL, "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
                                    ["title", "done"])),
    # ---- enums and consts ------------------------------------------------------------------------
    "sentiment": ("the sentiment of 'I love it'", obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    "enum_ints": ("a dice roll", obj({"roll": {"enum": [1, 2, 3, 4, 5, 6]}})),
    "enum_mixed": ("a setting", obj({"value": {"enum": ["auto", 0, 1, True, None]}})),
    "const": ("a version-1 message", obj({"version": {"const": 1}, "text": S})),
    "top_enum": ("a yes or no answer", {"enum": ["yes", "no"]}),
    "label_and_score": ("a classification", obj({"label": {"enum": ["spam", "ham"]},
                                                 "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    # ---- string patterns and formats -------------------------------------------------------------
    "zip": ("a US zip code", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    "phone": ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3} [0-9]{4}$"}})),
    "hex_colour": ("a colour in hex", obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    "identifier": ("a variable name", obj({"name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,15}$"}})),
    "date": ("a date", obj({"date": {"type": "string", "format": "date"}})),
    "time": ("a time of day", obj({"time": {"type": "string", "format": "time"}})),
    "date_time": ("a meeting", obj({"title": S, "starts": {"type": "string", "format": "date-time"}})),
    "email": ("an email address", obj({"email": {"type": "string", "format": "email", "maxLength": 40}})),
    "uuid": ("an id", obj({"id": {"type": "string", "format": "uuid"}})),
    "min_length": ("a password", obj({"password": {"type": "string", "minLength": 8, "maxLength": 16}})),
    "words": ("a first and last name", obj({"first": WORD, "last": WORD})),
    # ---- arrays ----------------------------------------------------------------------------------
    "tags": ("tags for a photo of a beach", obj({"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 4}})),
    "numbers": ("three lottery numbers", obj({"numbers": {"type": "array", "minItems": 3, "maxItems": 3,
                                                          "items": {"type": "integer", "minimum": 1, "maximum": 49}}})),
    "top_array": ("a list of two fruits", {"type": "array", "items": WORD, "minItems": 2, "maxItems": 2}),
    "matrix": ("a 2x2 matrix", obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                                             "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": INT}}})),
    "tuple": ("a name and an age", {"type": "array", "prefixItems": [S, {"type": "integer", "minimum": 0}],
                                    "items": False, "minItems": 2}),
    "empty_ok": ("a shopping list, possibly empty", obj({"items": {"type": "array", "items": WORD, "maxItems": 3}})),
    "array_of_objects": ("two people", obj({"people": {"type": "array", "minItems": 1, "maxItems": 2,
                                                       "items": obj({"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}})}})),
    "enum_array": ("the primary colours", obj({"colours": {"type": "array", "maxItems": 3,
                                                           "items": {"enum": ["red", "green", "blue", "yellow"]}}})),
    # ---- nesting ---------------------------------------------------------------------------------
    "address": ("where Ann lives", obj({"name": S, "address": obj({"street": S, "city": S,
                                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    "order": ("an order of two items", obj({"id": INT, "customer": obj({"name": S}),
                                            "lines": {"type": "array", "minItems": 1, "maxItems": 2,
                                                      "items": obj({"sku": WORD, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})},
                                            "paid": BOOL})),
    "deep": ("a nested config", obj({"a": obj({"b": obj({"c": obj({"d": BOOL})})})})),
    "event": ("a concert", obj({"name": S, "venue": obj({"city": S, "capacity": {"type": "integer", "minimum": 1}}),
                                "date": {"type": "string", "format": "date"}})),
    "product": ("a product", obj({"name": S, "price": obj({"amount": {"type": "number", "minimum": 0},
                                                            "currency": {"enum": ["EUR", "USD", "GBP"]}}),
                                  "in_stock": BOOL})),
    "tool_call_like": ("a call of get_weather for Paris", obj({"name": {"const": "get_weather"},
                                                                "arguments": obj({"city": S, "unit": {"enum": ["c", "f"]}})})),
    # ---- anyOf, nullable, $ref, allOf ------------------------------------------------------------
    "any_of_scalar": ("an id, number or text", obj({"id": {"anyOf": [INT, S]}})),
    "any_of_objects": ("a shape", obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                                                           obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}})]}})),
    "nullable": ("a person whose age is unknown", obj({"name": S, "age": {"type": ["integer", "null"]}})),
    "nullable_any_of": ("a nickname or null", obj({"nickname": {"anyOf": [S, {"type": "null"}]}})),
    "ref": ("two points", {"$defs": {"pt": obj({"x": INT, "y": INT})}, **obj({"a": {"$ref": "#/$defs/pt"},
                                                                              "b": {"$ref": "#/$defs/pt"}})}),
    "nested_ref": ("a line from (0,0) to (3,4)", {"$defs": {"pt": obj({"x": INT, "y": INT}),
                                                            "line": obj({"from": {"$ref": "#/$defs/pt"},
                                                                         "to": {"$ref": "#/$defs/pt"}})},
                                                  "$ref": "#/$defs/line"}),
    "all_of": ("an employee", {"allOf": [obj({"name": S, "id": INT}, ["name"]),
                                         {"type": "object", "required": ["id"]}]}),
    "one_of": ("a pet", obj({"pet": {"oneOf": [obj({"cat": BOOL}), obj({"dog": BOOL})]}})),
    # ---- top-level scalars and free values -------------------------------------------------------
    "top_integer": ("the number of legs of a spider", {"type": "integer", "minimum": 0, "maximum": 100}),
    "top_boolean": ("whether the sky is blue", {"type": "boolean"}),
    "top_string": ("a one-word greeting", {"type": "string", "pattern": "^[A-Za-z]{1,10}$"}),
    "additional_properties": ("word counts", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0},
                                              "maxProperties": 3}),
}
