"""The gateway's OpenAPI 3.1 document, served at /openapi.json: every route, what it accepts and answers.

Written as data, next to the code it describes. The request bodies come from the tables the
validation reads them with (gateway.requests, gateway.infill: field, type and limits declared once)
and from the config (`max_n`, whether a key is required), so the document describes this server
as configured. tests/unit/test_openapi.py checks that every route
is here; tests/e2e/test_openapi_fuzz.py fuzzes the live server against it.

Every optional request field also accepts null (the validation treats null as "not given").
"""
from __future__ import annotations

from typing import Any

from gateway.infill import INFILL
from gateway.openapi_apis import WORKER_ERRORS, agent_api_paths
from gateway.request_fields import Bounds, Fields, properties
from gateway.requests import CHAT, COMPLETION, WARM, chat_message_schema
from shared.config import Config

Schema = dict[str, Any]


def openapi_document(config: Config, vocab_size: int | None = None) -> Schema:
    """The document for this config; `vocab_size` (the model's) bounds token ids when known."""
    secured = config.gateway.authenticated
    document: Schema = {
        "openapi": "3.1.0",
        "info": {"title": "Reame", "version": "1",
                 "description": "OpenAI-compatible completions served by Reame's CPU workers. Every response "
                                "carries X-Request-Id: the client's own (reduced to plain characters) or a new one."},
        "paths": {
            "/v1/chat/completions": {"post": _completion_operation(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", secured)},
            "/v1/completions": {"post": _completion_operation(
                "Text completion", "CompletionRequest", "Completion", secured)},
            "/infill": {"post": _infill_operation(secured)},
            "/v1/warm": {"post": _warm_operation(secured)},
            "/v1/models": {"get": _operation("The model this server serves", _json_response("ModelList"), secured)},
            "/metrics": {"get": _operator(_operation("Prometheus metrics (host-wide: the operator's)", {
                "description": "Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}, secured), secured)},
            "/health": {"get": _open_operation("Whether a worker is ready (open to load balancers)", {
                "200": _json_response("Health", "a worker is ready"),
                "503": _json_response("Health", "no worker is ready")})},
            "/openapi.json": {"get": _open_operation("This document", {
                "200": {"description": "OpenAPI 3.1 document", "content": {"application/json": {
                    "schema": {"type": "object"}}}}})},
            **_admin_paths(secured),
            **agent_api_paths(secured),
        },
        "components": {"schemas": _schemas(config.gateway.max_n, vocab_size), "headers": {
            "Retry-After": {"description": "Seconds to wait before retrying", "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9]+$"}}}},
    }
    if secured:
        document["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearerAuth": []}]
    return document


# ---- operations ---------------------------------------------------------------------------------

def _completion_operation(summary: str, request: str, response: str, secured: bool) -> Schema:
    ok = {"description": "The completion; with `stream: true`, server-sent events of chunks, then `data: [DONE]`",
          "content": {"application/json": {"schema": _ref(response)},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return _worker_operation(summary, request, ok, secured, "invalid request: a bad field (named in `param`), "
                             "prompt + max_tokens over the context, or more choices (prompts × n) than max_queue")


def _infill_operation(secured: bool) -> Schema:
    ok = {"description": "A text completion of the middle; not streamed, it also carries `content` (llama.cpp's "
                         "field: the first choice's text)",
          "content": {"application/json": {"schema": {"allOf": [_ref("Completion"), {
              "type": "object", "properties": {"content": {"type": "string"}}}]}},
              "text/event-stream": {"schema": {"type": "string"}}}}
    return _worker_operation("Fill in the middle (llama.cpp's /infill)", "InfillRequest", ok, secured,
                             "invalid request: a bad field (named in `param`), a model without "
                             "fill-in-the-middle tokens, or a prompt over the context",
                             description="Builds the model's fill-in-the-middle prompt (Qwen2.5-Coder: "
                             "`<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`, other files after `<|repo_name|>` "
                             "and `<|file_sep|>`) and completes the text between prefix and suffix.")


def _warm_operation(secured: bool) -> Schema:
    ok = _json_response("PrefixWarm", "The prompt is prefilled: its full blocks are in the worker's prefix "
                                      "cache and committed to the host store")
    return _worker_operation("Prefill a prompt into the prefix cache", "WarmRequest", ok, secured,
                             "invalid request: a bad field (named in `param`), neither or both of "
                             "`messages` and `prompt`, or a prompt that fills the whole context",
                             description="Renders `messages` with the chat template as /v1/chat/completions does, "
                             "or tokenizes `prompt` as /v1/completions does, and has a worker compute its K/V "
                             "without generating, so that later requests starting the same way reuse it.")


def _worker_operation(summary: str, request: str, ok: Schema, secured: bool, invalid: str,
                      description: str | None = None) -> Schema:
    """A POST whose JSON body becomes work for a worker: the errors that can come of that."""
    operation = _operation(summary, ok, secured)
    if description:
        operation["description"] = description
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    operation["responses"].update({"400": _error(invalid), "404": _error("the requested `model` is not served here")})
    operation["responses"].update({status: _error(description, retry_after=status in ("429", "503"))
                                   for status, description in WORKER_ERRORS.items()})
    return operation


def _operation(summary: str, ok: Schema, secured: bool) -> Schema:
    responses = {"200": ok}
    if secured:
        responses["401"] = _error("missing or wrong API key")
    else:
        responses["403"] = _error("the Host header is not this server's host, a loopback name or in allowed_hosts")
    return {"summary": summary, "responses": responses}


def _admin_paths(secured: bool) -> Schema:
    """The tuning controls (gateway.admin)."""
    ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    off = _error("adaptivity is off ([tuning] adaptive = false): nothing to freeze or pin")

    def control(summary: str, body: bool = False) -> Schema:
        operation = _operation(summary, ok, secured)
        operation["responses"]["409"] = off
        if not secured:  # a bodyless POST too: an empty form from another site's page (gateway.browsers)
            operation["responses"]["415"] = _error("Content-Type is not application/json")
        if body:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"type": "object", "description": "a strategy as GET /admin/strategy returns it: "
                           "{\"workers\": {SLOT or \"*\": {\"knobs\": {...}}}}"}}}}
            operation["responses"]["400"] = _error("not a strategy (the bad part is named)")
            operation["responses"]["415"] = _error(WORKER_ERRORS["415"])
        return operation

    series = _operation("The dashboard's curves since boot", ok, secured)
    series["parameters"] = [{"name": "bucket", "in": "query", "required": False,
                             "schema": {"type": "number", "minimum": 1, "maximum": 3600},
                             "description": "seconds per point (default 5)"}]
    series["responses"]["400"] = _error("bucket is not a number of seconds in 1..3600")
    paths = {
        "/admin/strategy": {"get": _operation("The tuning strategy: knobs per worker, version, frozen", ok, secured),
                            "post": control("Pin a strategy (and freeze it)", body=True)},
        "/admin/strategy/freeze": {"post": control("Stop every adaptive change (knobs and kernels)")},
        "/admin/strategy/unfreeze": {"post": control("Let adaptive changes resume")},
        "/admin/report": {"get": _operation("The adaptive report, with the strategy history", ok, secured)},
        "/admin/series": {"get": series},
    }
    gone = _error("the standalone tuning coordinator ([tuning] coordinator) is unreachable; the workers keep "
                  "their strategy")
    for operations in paths.values():
        for operation in operations.values():
            operation["responses"]["503"] = gone
            _operator(operation, secured)
    return {
        **paths,
        "/dashboard": {"get": _open_operation("Live charts of throughput, latency, prefix hits and strategy changes",
                                              {"200": {"description": "a self-contained HTML page", "content": {
                                                  "text/html": {"schema": {"type": "string"}}}}})},
    }


def _operator(operation: Schema, secured: bool) -> Schema:
    """An operator's route (gateway.auth.OPERATOR_PATHS): a tenant's key gets 403."""
    if secured:
        operation["responses"]["403"] = _error("a tenant's API key: this route needs an operator's ([gateway] api_key, "
                                               "or a key marked admin in api_keys_file)")
    return operation


def _open_operation(summary: str, responses: Schema) -> Schema:
    responses = {**responses, "403": _error("the Host header is not this server's host, a loopback name or "
                                            "in allowed_hosts (servers without an api_key)")}
    return {"summary": summary, "security": [], "responses": responses}


def _error(description: str, retry_after: bool = False) -> Schema:
    response = _json_response("Error", description)
    if retry_after:
        response["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
    return response


def _json_response(schema: str, description: str = "OK") -> Schema:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


# ---- schemas ------------------------------------------------------------------------------------

def _request(fields: Fields, bounds: Bounds, required: tuple[str, ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "properties": properties(fields, bounds)}
    if required:
        schema["required"] = list(required)
    return schema


def _warm_request(bounds: Bounds) -> Schema:
    """Exactly one of `messages` and `prompt`; a null one counts as not given."""
    fields = properties(WARM, bounds)
    messages, prompt = fields.pop("messages"), fields.pop("prompt")
    return {"type": "object", "properties": fields, "oneOf": [
        {"required": ["messages"], "properties": {"messages": messages, "prompt": {"type": "null"}}},
        {"required": ["prompt"], "properties": {"prompt": prompt, "messages": {"type": "null"}}},
    ]}


def _completion(kind: str, output: str, output_schema: Schema) -> Schema:
    """A completion as both APIs answer it; each choice holds its `output` ("message" or "text")."""
    token = {"type": "integer", "minimum": 0}
    choice = {"type": "object", "required": ["index", output, "finish_reason"], "properties": {
        "index": token, output: output_schema, "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
        "logprobs": {"type": ["object", "null"]}}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": _ref("Usage"),
        "choices": {"type": "array", "minItems": 1, "items": choice}}}


def _schemas(max_n: int, vocab_size: int | None) -> Schema:
    bounds = Bounds(max_n, vocab_size)
    token = {"type": "integer", "minimum": 0}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": token, "completion_tokens": token, "total_tokens": token,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": token}}}}
    tool_call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
    return {
        "ChatMessage": chat_message_schema(),
        "ChatCompletionRequest": _request(CHAT, bounds, required=("messages",)),
        "CompletionRequest": _request(COMPLETION, bounds, required=("prompt",)),
        "InfillRequest": _request(INFILL, bounds),
        "WarmRequest": _warm_request(bounds),
        "PrefixWarm": {"type": "object", "required": ["object", "model", "prompt_tokens", "cached_tokens",
                                                      "reused_tokens"], "properties": {
            "object": {"const": "prefix.warm"}, "model": {"type": "string"},
            "prompt_tokens": {**token, "description": "tokens of the rendered, tokenized prompt"},
            "cached_tokens": {**token, "description": "prompt tokens whose K/V the prefix cache now holds "
                                                      "(whole blocks only)"},
            "reused_tokens": {**token, "description": "prompt tokens whose K/V were already cached"}}},
        "Usage": usage,
        "ChatCompletion": _completion("chat.completion", "message", {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": tool_call}}}),
        "Completion": _completion("text_completion", "text", {"type": "string"}),
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                                                "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                                               "created": {"type": "integer"},
                                                               "owned_by": {"type": "string"}}}}}},
        "Health": {"type": "object", "required": ["status", "workers", "queued"], "properties": {
            "status": {"enum": ["ok", "unavailable"]}, "workers": token, "queued": token}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    }
