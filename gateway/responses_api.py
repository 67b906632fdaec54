"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

On the same path as /v1/chat/completions: the body becomes a chat request
(gateway.responses_requests), a `previous_response_id`'s stored conversation is put before the
new input, `routes.chat_prompt` renders and tokenizes it, and `completion.complete` runs it; only
the answer is shaped here: output items (an assistant message, function calls), whole or as the
API's event stream (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done, response.function_call_arguments
.delta / .done, response.output_item.done, then response.completed or response.incomplete).

With `store` (the default) the response, its input items and the conversation so far are kept
per API key (gateway.response_store) before the last event is sent, so the client can continue
from it at once. The continued conversation renders to the same tokens as before, so its prefix
comes from the worker's cache (`usage.input_tokens_details.cached_tokens`).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Awaitable, Callable

from aiohttp import web

from gateway.auth import TENANT
from gateway.completion import complete
from gateway.errors import NotFoundError
from gateway.json_response import json_response
from gateway.reply import Ending, NamedEventStream, Part, parts, stream_events, whole
from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses import token_logprobs
from gateway.responses_requests import MAX_ID, MAX_LIST, ResponsesRequest, check_include, new_id, parse_responses
from gateway.routes import _check_model, _read_json, chat_prompt
from gateway.state import STATE
from gateway.tools import ToolCall
from shared.errors import InvalidRequestError, ReameError

if TYPE_CHECKING:
    from gateway.completion import _Run

class _LazyStore:
    """The store, opened on first use (a server nobody asks to store for creates no file)."""

    def __init__(self) -> None:
        self._store: ResponseStore | None = None
        self._lock = threading.Lock()

    def get(self, config) -> ResponseStore:
        with self._lock:
            if self._store is None:
                path = (config.resolve_path(config.gateway.stored_responses_path) if config.gateway.stored_responses_path
                        else config.resolve_path(config.server.state_dir) / "responses.sqlite")
                self._store = ResponseStore(path, config.gateway.stored_response_hours,
                                            config.gateway.stored_responses_per_key)
            return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


STORE = web.AppKey("response_store", _LazyStore)


def add_responses_routes(app: web.Application) -> None:
    app[STORE] = _LazyStore()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)

    async def close(app: web.Application) -> None:
        app[STORE].close()

    app.on_cleanup.append(close)


async def create(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    state = request.app[STATE]
    parsed = parse_responses(await _read_json(request, state))
    _check_model(state, parsed.chat.model)
    history: list[dict] = []
    if parsed.previous_response_id is not None:
        previous = await _stored(request, parsed.previous_response_id, "previous_response_id")
        history = previous.conversation
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions is not None else []
    req = replace(parsed.chat, messages=tuple(system + history + list(parsed.messages)))
    req, ids = await chat_prompt(state, req)
    reply = _Reply(parsed, req.model or state.model_id)
    if parsed.logprobs:
        reply.logprobs_of = lambda entries: token_logprobs(entries, state.tokenizer.token_bytes, req.top_logprobs)

    async def answer(run: _Run, http: web.Request) -> web.StreamResponse:
        async def save(body: dict) -> None:
            if parsed.store:
                stored = StoredResponse(reply.id, reply.created, body, list(parsed.items),
                                        history + list(parsed.messages) + reply.conversation())
                await asyncio.to_thread(_store(http).put, _owner(http), stored)

        if req.stream:
            return await stream_events(run, http, lambda out: reply.stream(run, out, save), reply.error_event)
        ending = Ending()
        await reply.add(await whole(run, ending))
        body = reply.finish(ending)
        await save(body)
        return json_response(body)

    return await complete(state, request, req, [ids], arrived, extra_stops=state.chat_stops, answer=answer)


async def retrieve(request: web.Request) -> web.Response:
    stored = await _stored(request, request.match_info["response_id"])
    return json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await asyncio.to_thread(_store(request).delete, _owner(request), response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    stored = await _stored(request, request.match_info["response_id"])
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("'order' must be 'asc' or 'desc'", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST:
        raise InvalidRequestError(f"'limit' must be an integer between 1 and {MAX_LIST}", param="limit")
    include = query.getall("include[]", []) + query.getall("include", [])
    check_include(include)  # input items are text: nothing any known value adds; an unknown one is a 400
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError("'after' names no input item of this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


# ---- the reply ---------------------------------------------------------------------------------------

Emit = Callable[[str, dict], Awaitable[None]]


class _Reply:
    """The output items of one response, built from the reply's parts; streamed, each change is
    also sent as its event (`emit`), so the streamed and the whole response have the same items."""

    def __init__(self, parsed: ResponsesRequest, model: str):
        self.parsed = parsed
        self.model = model
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.output: list[dict] = []
        self.text = ""  # all of the reply's text, for the stored conversation
        self.calls: list[ToolCall] = []
        self._open: dict | None = None  # the message item text is being added to
        self._emit: Emit | None = None
        self._sequence = 0
        self.logprobs_of: Callable[[list], list[dict]] = lambda entries: []  # set when `include` asks for them

    async def stream(self, run: _Run, out: NamedEventStream, save: Callable[[dict], Awaitable[None]]) -> None:
        async def emit(name: str, data: dict) -> None:
            await out.emit(name, {"type": name, "sequence_number": self._sequence, **data})
            self._sequence += 1

        ending = Ending()
        started = False
        async for part in parts(run, ending):
            if not started:
                started = True
                await self._start(emit)
            await self.add(part)
        if not started:
            await self._start(emit)
        await self._close_message()
        body = self.finish(ending)
        await save(body)
        await emit("response.completed" if body["status"] == "completed" else "response.incomplete",
                   {"response": body})

    async def _start(self, emit: Emit) -> None:
        self._emit = emit
        shell = self._body("in_progress", None, None)
        await emit("response.created", {"response": shell})
        await emit("response.in_progress", {"response": shell})

    async def add(self, part: Part) -> None:
        if part.text:
            await self._add_text(part.text, self.logprobs_of(part.entries))
        for call in part.calls:
            await self._close_message()
            self.calls.append(call)
            item = {"id": new_id("fc_"), "type": "function_call", "status": "completed", "call_id": call.id,
                    "name": call.name, "arguments": call.arguments}
            index = len(self.output)
            self.output.append(item)
            if self._emit is not None:
                await self._emit("response.output_item.added", {"output_index": index, "item": {
                    **item, "arguments": "", "status": "in_progress"}})
                await self._emit("response.function_call_arguments.delta", {
                    "item_id": item["id"], "output_index": index, "delta": call.arguments})
                await self._emit("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": index, "name": call.name, "arguments": call.arguments})
                await self._emit("response.output_item.done", {"output_index": index, "item": item})

    def finish(self, ending: Ending) -> dict:
        """The response object, once the reply has ended (a message item still open is closed
        here without events: a stream closes it with its events first)."""
        if self._open is not None:
            self._open["status"] = "completed"
            self._open = None
        incomplete = ending.finish_reason == "length"
        usage = {"input_tokens": ending.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": ending.cached_tokens},
                 "output_tokens": ending.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": ending.prompt_tokens + ending.output_tokens}
        return self._body("incomplete" if incomplete else "completed",
                          {"reason": "max_output_tokens"} if incomplete else None, usage)

    def conversation(self) -> list[dict]:
        """The reply as the chat message the next turn's prompt shows."""
        message: dict = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [call.as_openai() for call in self.calls]
        return [message]

    def error_event(self, exc: ReameError) -> tuple[str, dict]:
        error = exc.to_openai()["error"]
        return "error", {"type": "error", "sequence_number": self._sequence, "code": error["code"] or error["type"],
                         "message": error["message"], "param": error["param"]}

    async def _add_text(self, text: str, logprobs: list[dict]) -> None:
        self.text += text
        if self._open is None:
            self._open = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                          "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            self.output.append(self._open)
            if self._emit is not None:
                await self._emit("response.output_item.added", {"output_index": len(self.output) - 1,
                                                                "item": {**self._open, "content": []}})
                await self._emit("response.content_part.added", {**self._where(), "part": {
                    "type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        self._open["content"][0]["text"] += text
        self._open["content"][0]["logprobs"] += logprobs
        if self._emit is not None:
            await self._emit("response.output_text.delta", {**self._where(), "delta": text, "logprobs": logprobs})

    async def _close_message(self) -> None:
        if self._open is None:
            return
        self._open["status"] = "completed"
        if self._emit is not None:
            part = self._open["content"][0]
            await self._emit("response.output_text.done", {**self._where(), "text": part["text"],
                                                            "logprobs": part["logprobs"]})
            await self._emit("response.content_part.done", {**self._where(), "part": part})
            await self._emit("response.output_item.done", {"output_index": self.output.index(self._open),
                                                           "item": self._open})
        self._open = None

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": self.output.index(self._open), "content_index": 0}

    def _body(self, status: str, incomplete: dict | None, usage: dict | None) -> dict:
        echo = self.parsed.echo
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "model": self.model,
                "output": self.output if status != "in_progress" else [],
                "previous_response_id": self.parsed.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "usage": usage, **echo}


# ---- the store ---------------------------------------------------------------------------------------

def _store(request: web.Request) -> ResponseStore:
    return request.app[STORE].get(request.app[STATE].config)


def _owner(request: web.Request) -> str:
    """Whose responses: the SHA-256 of the request's API key ("" on a server without keys)."""
    tenant = request.get(TENANT)
    return tenant.key_digest.hex() if tenant is not None else ""


async def _stored(request: web.Request, response_id: str, param: str = "response_id") -> StoredResponse:
    if len(response_id) > MAX_ID:
        raise _not_found(response_id[:MAX_ID], param)
    stored = await asyncio.to_thread(_store(request).get, _owner(request), response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str = "response_id") -> ReameError:
    if param == "previous_response_id":  # a bad field of a valid route: 400, as OpenAI answers it
        return InvalidRequestError(f"Previous response with id '{response_id}' not found.", param=param)
    return NotFoundError(f"No response found with id '{response_id}'", param=param)
