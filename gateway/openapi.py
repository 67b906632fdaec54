"""The gateway's OpenAPI 3.1 document, served at /openapi.json: every route, what it accepts and answers.

Written as data, next to the code it describes: the limits come from shared.sampling.LIMITS and
gateway.requests (the same ones the validation uses) and from the config (`max_n`, whether a key is required), so the
document describes this server as configured. tests/unit/test_openapi.py checks that every route
is here; tests/e2e/test_openapi_fuzz.py fuzzes the live server against it.

Every optional request field also accepts null (the validation treats null as "not given").
"""
from __future__ import annotations

from typing import Any

from gateway.openapi_apis import agent_api_paths
from gateway.requests import (
    MAX_CACHE_SALT,
    MAX_LOGPROBS_COMPLETION,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOKEN_ID_DIGITS,
    MAX_TOP_LOGPROBS_CHAT,
    ROLES,
)
from gateway.structured import MAX_GRAMMAR_CHARS
from gateway.tools import MAX_TOOLS
from shared.config import Config
from shared.sampling import LIMITS

Schema = dict[str, Any]
CACHE_SALT: Schema = {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_CACHE_SALT,
                      "description": "only requests with the same salt (and API key) share cached prompt prefixes"}


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
    operation = _worker_operation("Fill in the middle (llama.cpp's /infill)", "InfillRequest", ok, secured,
                                  "invalid request: a bad field (named in `param`), a model without "
                                  "fill-in-the-middle tokens, or a prompt over the context")
    operation["description"] = ("Builds the model's fill-in-the-middle prompt (Qwen2.5-Coder: "
                                "`<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`, other files after "
                                "`<|repo_name|>` and `<|file_sep|>`) and completes the text between prefix and suffix.")
    return operation


def _warm_operation(secured: bool) -> Schema:
    ok = _json_response("PrefixWarm", "The prompt is prefilled: its full blocks are in the worker's prefix "
                                      "cache and committed to the host store")
    operation = _worker_operation("Prefill a prompt into the prefix cache", "WarmRequest", ok, secured,
                                  "invalid request: a bad field (named in `param`), neither or both of "
                                  "`messages` and `prompt`, or a prompt that fills the whole context")
    operation["description"] = ("Renders `messages` with the chat template as /v1/chat/completions does, or "
                                "tokenizes `prompt` as /v1/completions does, and has a worker compute its K/V "
                                "without generating, so that later requests starting the same way reuse it.")
    return operation


def _worker_operation(summary: str, request: str, ok: Schema, secured: bool, invalid: str) -> Schema:
    """A POST whose JSON body becomes work for a worker: the errors that can come of that."""
    operation = _operation(summary, ok, secured)
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    operation["responses"].update({
        "400": _error(invalid),
        "404": _error("the requested `model` is not served here"),
        "408": _error("the request body took longer than read_timeout to arrive"),
        "413": _error("the request body is larger than max_body_bytes"),
        "415": _error("the request body is not JSON (Content-Type must be application/json)"),
        "429": _error("too many requests are waiting for a worker", retry_after=True),
        "503": _error("no worker is ready, or the worker running the request was lost", retry_after=True),
    })
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
            operation["responses"]["415"] = _error("the request body is not JSON (Content-Type must be application/json)")
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

def _opt(kind: str | list[str], **constraints: Any) -> Schema:
    """An optional field of `kind` that may also be null."""
    kinds = [kind] if isinstance(kind, str) else list(kind)
    return {"type": [*kinds, "null"], **constraints}


def _limited(kind: str, name: str, **extra: Any) -> Schema:
    """An optional number whose bounds are its row of shared.sampling.LIMITS (the validation's own)."""
    return _opt(kind, **LIMITS[name].schema(), **extra)


def _sampling(max_n: int) -> Schema:
    """Fields both completion requests share (gateway.requests._common)."""
    stop_string = {"type": "string", "maxLength": MAX_STOP_CHARS}
    return {
        "model": _opt("string", description="Optional: this server serves one model"),
        "temperature": _limited("number", "temperature"),
        "top_p": _limited("number", "top_p"),
        "top_k": _limited("integer", "top_k", description="0 or -1: off"),
        "min_p": _limited("number", "min_p"),
        "presence_penalty": _limited("number", "presence_penalty"),
        "frequency_penalty": _limited("number", "frequency_penalty"),
        "repetition_penalty": _limited("number", "repetition_penalty"),
        "logit_bias": _opt("object", propertyNames={"pattern": f"^[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$"},
                           additionalProperties={"type": "number", **LIMITS["logit_bias"].schema()},
                           description="token id → bias; ids must be in the vocabulary (else 400)"),
        "seed": _limited("integer", "seed"),
        "n": _opt("integer", minimum=1, maximum=max_n),
        "stop": {"anyOf": [stop_string, {"type": "array", "maxItems": MAX_STOPS, "items": stop_string},
                           {"type": "null"}],
                 "description": f"up to {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each; "
                                "generation ends before the first one that appears"},
        "stream": _opt("boolean"),
        "stream_options": _opt("object", properties={"include_usage": _opt("boolean")}),
        "user": _opt("string"),
        "cache_salt": CACHE_SALT,
        "speculative": _opt("boolean", description="false: no speculative decoding for this request, and its "
                                                   "completion teaches no drafts (the output is the same either way)"),
        "max_tokens": _limited("integer", "max_tokens",
                               description="prompt + max_tokens must fit the context (else 400)"),
        "response_format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "schema": {"type": "object"}, "strict": _opt("boolean"), "description": {"type": "string"}}}}},
            {"type": "null"}],
            "description": "the output follows the JSON schema; one the engine cannot enforce is a 400 naming "
                           "response_format.json_schema.schema"},
        "grammar": {"anyOf": [
            {"type": "string", "pattern": "\\S", "maxLength": MAX_GRAMMAR_CHARS},
            {"type": "object", "required": ["type", "value"], "properties": {
                "type": {"enum": ["lark", "regex"]},
                "value": {"type": "string", "pattern": "\\S", "maxLength": MAX_GRAMMAR_CHARS}}},
            {"type": "null"}],
            "description": "Reame extension: the output follows this Lark (or llama.cpp GBNF) grammar or regex; "
                           "not together with response_format"},
    }


def _tools() -> Schema:
    """Chat only: OpenAI function tools (gateway.tools)."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"}, "parameters": {"type": "object"}}}
    return {
        "tools": _opt("array", maxItems=MAX_TOOLS, items={"type": "object", "required": ["function"], "properties": {
            "type": {"const": "function"}, "function": function}}),
        "tool_choice": {"anyOf": [
            {"enum": ["auto", "none", "required"]},
            {"type": "object", "required": ["function"], "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
            {"type": "null"}], "description": "a named function must be in tools (else 400); "
                                              "'required' and a name need tools"},
        "parallel_tool_calls": _opt("boolean"),
    }


def _schemas(max_n: int, vocab_size: int | None) -> Schema:
    token = {"type": "integer", "minimum": 0}
    token_id = token if vocab_size is None else {**token, "maximum": vocab_size - 1}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = [{"type": "string"}, {"type": "array", "items": text_part}]
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": token, "completion_tokens": token, "total_tokens": token,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": token}}}}
    finish = {"enum": ["stop", "length", "tool_calls"]}
    tool_call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
    return {
        "ChatMessage": {"anyOf": [
            # An assistant turn may carry only tool calls, so its content may be missing or null.
            {"type": "object", "required": ["role"], "properties": {
                "role": {"const": "assistant"}, "content": {"anyOf": [*content, {"type": "null"}]},
                "tool_calls": {"type": ["array", "null"], "items": {"type": "object"}}}},
            {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"enum": sorted(ROLES - {"assistant"})}, "content": {"anyOf": content}}},
        ]},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            **_sampling(max_n),
            **_tools(),
            "max_completion_tokens": _limited("integer", "max_tokens", description="takes precedence over max_tokens"),
            "logprobs": _opt("boolean"),
            "top_logprobs": _opt("integer", minimum=0, maximum=MAX_TOP_LOGPROBS_CHAT,
                                 description="requires logprobs: true (else 400)"),
        }},
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
            "prompt": {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": token_id},
                {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": token_id}},
            ], "description": "text, texts, token ids, or lists of token ids (one choice set per prompt)"},
            **_sampling(max_n),
            "logprobs": _opt("integer", minimum=0, maximum=MAX_LOGPROBS_COMPLETION),
            "suffix": _opt("string", description="fill in the middle: text after the completion (one text prompt "
                                                 "only; a model without FIM tokens answers 400)"),
        }},
        "InfillRequest": {"type": "object", "properties": {
            "input_prefix": _opt("string", description="code before the cursor"),
            "input_suffix": _opt("string", description="code after the cursor"),
            "prompt": _opt("string", description="text appended to input_prefix (llama.cpp's meaning)"),
            "input_extra": {"type": ["array", "null"], "maxItems": 64, "items": {
                "type": "object", "required": ["text"], "properties": {
                    "filename": {"type": "string"}, "text": {"type": "string"}}},
                "description": "other files of the project, as repository context"},
            "n_predict": _limited("integer", "max_tokens", description="llama.cpp's name for max_tokens"),
            **_sampling(max_n),
        }},
        # Exactly one of `messages` and `prompt`; a null one counts as not given.
        "WarmRequest": {"type": "object", "properties": {"model": _opt("string"), "cache_salt": CACHE_SALT},
                        "oneOf": [
            {"required": ["messages"], "properties": {
                "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
                "prompt": {"type": "null"}}},
            {"required": ["prompt"], "properties": {
                "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "minItems": 1, "items": token_id}],
                           "description": "text or token ids"},
                "messages": {"type": "null"}}},
        ]},
        "PrefixWarm": {"type": "object", "required": ["object", "model", "prompt_tokens", "cached_tokens",
                                                      "reused_tokens"], "properties": {
            "object": {"const": "prefix.warm"}, "model": {"type": "string"},
            "prompt_tokens": {**token, "description": "tokens of the rendered, tokenized prompt"},
            "cached_tokens": {**token, "description": "prompt tokens whose K/V the prefix cache now holds "
                                                      "(whole blocks only)"},
            "reused_tokens": {**token, "description": "prompt tokens whose K/V were already cached"}}},
        "Usage": usage,
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                    "index": token, "finish_reason": finish, "logprobs": {"type": ["object", "null"]},
                    "message": {"type": "object", "required": ["role", "content"], "properties": {
                        "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                        "tool_calls": {"type": "array", "items": tool_call}}}}}}}},
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _ref("Usage"),
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
                    "index": token, "text": {"type": "string"}, "finish_reason": finish,
                    "logprobs": {"type": ["object", "null"]}}}}}},
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
