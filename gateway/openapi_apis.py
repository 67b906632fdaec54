"""The Anthropic Messages and OpenAI Responses routes in /openapi.json (gateway.openapi adds them).

Their request bodies are described loosely (an object, with the fields each API requires; an
optional field may be null, as everywhere in the document): the
full shapes are Anthropic's and OpenAI's own published schemas, and the checks are in
gateway.anthropic_requests and gateway.responses_requests. What the document promises, and
tests/e2e/test_openapi_fuzz.py holds the server to, is the statuses: a bad body is a 4xx in the
API's own envelope, never a 5xx.
"""
from __future__ import annotations

from typing import Any

from gateway.responses_requests import INCLUDABLE, MAX_ID, MAX_LIST

Schema = dict[str, Any]
# What can go wrong with any POST whose body becomes a worker's job (gateway.openapi's routes too).
WORKER_ERRORS = {
    "408": "the request body took longer than read_timeout to arrive",
    "413": "the request body is larger than max_body_bytes",
    "415": "the request body is not JSON (Content-Type must be application/json)",
    "429": "too many requests are waiting for a worker",
    "503": "no worker is ready, or the worker running the request was lost",
}
_OBJECT: Schema = {"type": "object"}
_EVENTS = {"text/event-stream": {"schema": {"type": "string"}}}


def agent_api_paths(secured: bool) -> Schema:
    messages_body = {"type": "object", "required": ["max_tokens", "messages"], "properties": {
        "max_tokens": {"type": "integer", "minimum": 1}, "messages": {"type": "array", "minItems": 1},
        "model": {"type": ["string", "null"]}, "stream": {"type": ["boolean", "null"]}}}
    count_body = {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1}, "model": {"type": ["string", "null"]}}}
    responses_body = {"type": "object", "required": ["input"], "properties": {
        "input": {"type": ["string", "array"], "minLength": 1, "minItems": 1}, "model": {"type": ["string", "null"]},
        "stream": {"type": ["boolean", "null"]}, "store": {"type": ["boolean", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "include": {"type": ["array", "null"], "items": {"type": "string", "enum": INCLUDABLE}}}}
    response_id = {"name": "response_id", "in": "path", "required": True,
                   "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID}}
    items = _operation("The input items of a stored response", _ok(), secured, _error("no such response (of this "
                       "API key)"), _error("a bad `order`, `limit` or `after`"))
    items["parameters"] = [response_id,
                           {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
                           {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                       "maximum": MAX_LIST}},
                           {"name": "after", "in": "query", "schema": {"type": "string"}},
                           {"name": "include", "in": "query", "schema": {"type": "array", "items": {
                               "type": "string", "enum": INCLUDABLE}}}]
    one = {"get": _operation("A stored response (of this API key)", _ok(), secured, _error("no such response")),
           "delete": _operation("Delete a stored response", _ok(), secured, _error("no such response"))}
    for operation in one.values():
        operation["parameters"] = [response_id]
    return {
        "/v1/messages": {"post": _generation("Anthropic Messages: a reply, or its event stream", messages_body,
                                             _ok(events=True), secured)},
        "/v1/messages/count_tokens": {"post": _generation("Anthropic Messages: the prompt's token count",
                                                          count_body, _ok(), secured)},
        "/v1/responses": {"post": _generation("OpenAI Responses: a response, or its event stream", responses_body,
                                              _ok(events=True), secured)},
        "/v1/responses/{response_id}": one,
        "/v1/responses/{response_id}/input_items": {"get": items},
    }


def _generation(summary: str, body: Schema, ok: Schema, secured: bool) -> Schema:
    operation = _operation(summary, ok, secured, _error("the requested `model` is not served here, or "
                           "`previous_response_id` names no stored response"),
                           _error("invalid request: a bad field, or prompt + max tokens over the context"))
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    operation["responses"].update({status: _error(description) for status, description in WORKER_ERRORS.items()})
    return operation


def _operation(summary: str, ok: Schema, secured: bool, not_found: Schema, invalid: Schema | None = None) -> Schema:
    responses = {"200": ok, "404": not_found, **({"400": invalid} if invalid is not None else {})}
    if secured:
        responses["401"] = _error("missing or wrong API key (`Authorization: Bearer` or, under /v1/messages, "
                                  "`x-api-key`)")
    else:
        responses["403"] = _error("the Host header is not this server's host, a loopback name or in allowed_hosts")
    return {"summary": summary, "responses": responses}


def _ok(events: bool = False) -> Schema:
    content = {"application/json": {"schema": _OBJECT}, **(_EVENTS if events else {})}
    return {"description": "OK" + ("; with `stream: true`, server-sent events" if events else ""), "content": content}


def _error(description: str) -> Schema:
    return {"description": description + " (Anthropic's error envelope under /v1/messages, OpenAI's elsewhere)",
            "content": {"application/json": {"schema": _OBJECT}}}
