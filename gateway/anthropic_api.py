"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

On the same path as /v1/chat/completions: the body becomes a chat request
(gateway.anthropic_requests), its prompt is rendered and tokenized by `routes.chat_prompt`, and
`completion.complete` runs it; only the answer is shaped here, whole or as Anthropic's event
stream (message_start, ping, content_block_start / _delta / _stop per text or tool_use block,
message_delta with the stop reason and usage, message_stop).

Errors under /v1/messages are Anthropic's envelope, `{"type": "error", "error": {"type", "message"}}`,
with the same status: `anthropic_middleware` rewrites the OpenAI one that the error middleware
made. It also takes the key from `x-api-key` (what the anthropic SDK sends) when no
Authorization header came, so the bearer check in gateway.auth applies to it unchanged.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from gateway.anthropic_requests import parse_messages
from gateway.completion import complete
from gateway.json_response import json_response
from gateway.reply import Ending, NamedEventStream, Part, parts, stream_events, whole
from gateway.routes import _check_model, _read_json, chat_prompt
from gateway.state import STATE
from gateway.tools import ToolCall
from shared.errors import ReameError

if TYPE_CHECKING:
    from gateway.completion import _Run

PATH = "/v1/messages"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


async def messages(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    state = request.app[STATE]
    req = parse_messages(await _read_json(request, state), max_n=1)
    _check_model(state, req.model)
    req, ids = await chat_prompt(state, req)
    model = req.model or state.model_id

    async def answer(run: _Run, http: web.Request) -> web.StreamResponse:
        if req.stream:
            return await stream_events(run, http, lambda out: _stream(run, out, model), _error_event)
        return await _whole(run, model)

    return await complete(state, request, req, [ids], arrived, extra_stops=state.chat_stops, answer=answer)


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_messages(await _read_json(request, state), max_n=1, count_only=True)
    _check_model(state, req.model)
    _, ids = await chat_prompt(state, req)
    return json_response({"input_tokens": len(ids)})


def add_anthropic_routes(app: web.Application) -> None:
    app.router.add_post(PATH, messages)
    app.router.add_post(PATH + "/count_tokens", count_tokens)


@web.middleware
async def anthropic_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Under /v1/messages: `x-api-key` as the bearer key, and errors in Anthropic's envelope."""
    if request.path != PATH and not request.path.startswith(PATH + "/"):
        return await handler(request)
    key = request.headers.get("x-api-key")
    if key and "Authorization" not in request.headers:
        headers = request.headers.copy()
        headers["Authorization"] = f"Bearer {key}"
        request = request.clone(headers=headers)
    response = await handler(request)
    if response.status < 400 or not isinstance(response, web.Response) or response.body is None:
        return response
    try:
        error = orjson.loads(response.body)["error"]
        message, code = error["message"], error.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return response
    kept = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "allow", "x-request-id")}
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(response.status, "api_error"), "message": message}}
    if code is not None:  # Reame's finer kind (e.g. invalid_api_key, context_length_exceeded), kept
        body["error"]["code"] = code
    answer = json_response(body, response.status, kept)
    if not response.keep_alive:
        answer.force_close()
    return answer


# ---- shapes ----------------------------------------------------------------------------------------

async def _whole(run: _Run, model: str) -> web.Response:
    ending = Ending()
    reply = await whole(run, ending)
    text, calls = reply.text, reply.calls
    content = ([{"type": "text", "text": text}] if text or not calls else []) + [_tool_use(c) for c in calls]
    return json_response({"id": _message_id(), "type": "message", "role": "assistant", "model": model,
                          "content": content, **_stop(ending), "usage": _usage(ending)})


async def _stream(run: _Run, out: NamedEventStream, model: str) -> None:
    ending = Ending()
    index = -1  # of the block being sent
    text_open = False
    started = False

    async def start() -> None:
        nonlocal started
        if started:
            return
        started = True
        message = {"id": _message_id(), "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {**_usage(Ending(prompt_tokens=run.prompt_tokens)), "output_tokens": 0}}
        await out.emit("message_start", {"type": "message_start", "message": message})
        await out.emit("ping", {"type": "ping"})

    async def open_block(block: dict) -> None:
        nonlocal index
        index += 1
        await out.emit("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})

    async def close_block() -> None:
        await out.emit("content_block_stop", {"type": "content_block_stop", "index": index})

    part: Part
    async for part in parts(run, ending):
        await start()
        if part.text:
            if not text_open:
                await open_block({"type": "text", "text": ""})
                text_open = True
            await out.emit("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": part.text}})
        for call in part.calls:
            if text_open:
                await close_block()
                text_open = False
            await open_block({**_tool_use(call), "input": {}})
            await out.emit("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(_input(call.arguments))}})
            await close_block()
    await start()
    if index < 0:  # nothing at all was generated: one empty text block, as the whole answer has
        await open_block({"type": "text", "text": ""})
        text_open = True
    if text_open:
        await close_block()
    # The final usage: the cached share of the prompt is known only now (message_start had none).
    await out.emit("message_delta", {"type": "message_delta", "delta": _stop(ending), "usage": _usage(ending)})
    await out.emit("message_stop", {"type": "message_stop"})


def _error_event(exc: ReameError) -> tuple[str, dict]:
    return "error", {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"),
                                                "message": exc.message}}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": _input(call.arguments)}


def _input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` must be (text that is not a JSON
    object is kept under "arguments" rather than dropped)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(ending: Ending) -> dict:
    if ending.stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": ending.stop_string}
    return {"stop_reason": STOP_REASONS.get(ending.finish_reason, "end_turn"), "stop_sequence": None}


def _usage(ending: Ending) -> dict:
    # Anthropic counts prompt tokens read from its cache apart from `input_tokens`.
    return {"input_tokens": ending.prompt_tokens - ending.cached_tokens, "output_tokens": ending.output_tokens,
            "cache_read_input_tokens": ending.cached_tokens, "cache_creation_input_tokens": 0}


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)
