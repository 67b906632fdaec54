"""HTTP handlers: the OpenAI routes, /v1/warm, /health and /metrics.

Handlers turn a request into token ids (gateway.prompts, off the event loop) and hand them to
`completion.complete` (or `warm.prefill`); everything they raise is a ReameError, which the error
middleware turns into the OpenAI envelope. Chat messages and text prompts become token ids in one
place each, so that a warmed prompt and a later request with the same beginning share their
token prefix.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import orjson
from aiohttp import web

from gateway.auth import tenant_name
from gateway.cache_namespace import request_namespace
from gateway.completion import complete
from gateway.infill import check_size, completion_infill, fim_tokens, infill_ids, parse_infill
from gateway.errors import ModelNotFoundError, PayloadTooLargeError, RequestTimeoutError
from gateway.json_response import json_response
from gateway.metrics import CONTENT_TYPE
from gateway.openapi import openapi_document
from gateway.requests import CompletionRequest, parse_chat, parse_completion, parse_warm
from gateway.state import STATE, GatewayState
from gateway.tools import call_constraint, family_of
from gateway.warm import prefill
from shared.errors import InvalidRequestError

ROUTES = web.RouteTableDef()  # the OpenAI routes and the server's own (health, metrics, openapi)


@ROUTES.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    state = request.app[STATE]
    req = parse_chat(await _read_json(request, state), max_n=state.config.gateway.max_n)
    _check_model(state, req.model)
    req, ids = await chat_prompt(state, req)
    return await complete(state, request, req, [ids], arrived, extra_stops=state.chat_stops)


async def chat_prompt(state: GatewayState, req: CompletionRequest) -> tuple[CompletionRequest, list[int]]:
    """A chat request's token ids (its tools shown to the model as its template wants), and the
    request with a forced tool call's grammar as its constraint. /v1/messages and /v1/responses
    come here too, so the same conversation is the same prompt (and prefix) through every API."""
    source = getattr(state.template, "source", "")
    tools = req.tools if req.tools is not None and req.tools.active else None
    forced = call_constraint(tools, family_of(source)) if tools is not None else None
    if forced is not None:
        if req.constraint is not None:
            raise InvalidRequestError("'response_format' and a forced 'tool_choice' cannot be combined",
                                      param="tool_choice")
        req = replace(req, constraint=forced)
    # The encoder adds the tool list and past calls (gateway.tools) after its scan of the client's text.
    return req, await state.prompts.chat_ids(req.messages, state.pool.n_ctx, tools)


@ROUTES.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    state = request.app[STATE]
    body = await _read_json(request, state)
    req = parse_completion(body, max_n=state.config.gateway.max_n)
    _check_model(state, req.model)
    fill = completion_infill(body, req)
    if fill is not None:  # `suffix`: fill in the middle
        tokens = fim_tokens(state.tokenizer, "suffix")
        check_size(state.tokenizer, fill, state.pool.n_ctx, "prompt")
        ids = await asyncio.get_running_loop().run_in_executor(None, infill_ids, state.tokenizer, tokens, fill)
        return await complete(state, request, req, [ids], arrived, extra_stop_ids=tokens.stop_ids)
    prompts = [await state.prompts.prompt_ids(p, state.pool.n_ctx) for p in req.prompts]
    return await complete(state, request, req, prompts, arrived)


@ROUTES.post("/infill")
async def infill(request: web.Request) -> web.StreamResponse:
    """llama.cpp's /infill (gateway.infill), answered as a text completion; not streamed, the
    answer also carries llama.cpp's `content` (the first choice's text), which editors read."""
    arrived = time.perf_counter()
    state = request.app[STATE]
    req, fill = parse_infill(await _read_json(request, state), max_n=state.config.gateway.max_n)
    _check_model(state, req.model)
    tokens = fim_tokens(state.tokenizer, "input_prefix")
    check_size(state.tokenizer, fill, state.pool.n_ctx, "input_prefix")
    ids = await asyncio.get_running_loop().run_in_executor(None, infill_ids, state.tokenizer, tokens, fill)
    response = await complete(state, request, req, [ids], arrived, extra_stop_ids=tokens.stop_ids)
    if isinstance(response, web.Response) and response.status == 200 and not req.stream:
        answer = orjson.loads(response.body)
        return json_response({**answer, "content": answer["choices"][0]["text"]})
    return response


@ROUTES.post("/v1/warm")
async def warm(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_warm(await _read_json(request, state))
    _check_model(state, req.model)
    if req.messages:
        ids, param = await state.prompts.chat_ids(req.messages, state.pool.n_ctx), "messages"
    else:
        ids, param = await state.prompts.prompt_ids(req.prompt, state.pool.n_ctx), "prompt"
    namespace = request_namespace(state.config.prefix_cache.isolation, request, req.cache_salt)
    finished = await prefill(state, ids, param, namespace, tenant_name(request))
    return json_response({"object": "prefix.warm", "model": state.model_id, "prompt_tokens": len(ids),
                          "cached_tokens": finished.prefix_tokens, "reused_tokens": finished.cached_tokens})


@ROUTES.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    entry = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "reame"}
    return json_response({"object": "list", "data": [entry]})


@ROUTES.get("/health")
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    ready = len(state.pool.ready)
    body = {"status": "ok" if ready else "unavailable", "workers": ready, "queued": len(state.pool.queue)}
    return json_response(body, status=200 if ready else 503)


@ROUTES.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


@ROUTES.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(openapi_document(state.config, state.tokenizer.vocab_size))


async def _read_json(request: web.Request, state: GatewayState) -> object:
    limit = state.config.gateway.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLargeError(f"the request body is {request.content_length} bytes; the limit is {limit}")
    timeout = state.config.gateway.read_timeout
    try:
        # One deadline for the whole body: a client trickling a byte at a time cannot hold the
        # connection (and its place) for longer than read_timeout.
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(f"the request body is over the limit of {limit} bytes") from None
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {timeout:g} seconds") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


def _check_model(state: GatewayState, name: str | None) -> None:
    # A missing `model` means the one model this server has, as with llama.cpp's server.
    if name is None or name in state.model_aliases or name in state.pool.model_names:
        return
    raise ModelNotFoundError(f"The model '{name}' does not exist; this server serves '{state.model_id}'",
                             param="model")
