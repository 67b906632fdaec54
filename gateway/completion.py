"""Running one completion request: jobs out to the worker pool, choices back, as JSON or SSE.

One job per choice (`n` per prompt). Events from every job of the request arrive on one queue;
whatever is waiting is applied at once so a slow client gets fewer, larger chunks instead of
a growing backlog. Jobs are released in `finally`, whatever happened: a finished job is a
no-op, a running one is aborted on its worker — that is how a client that disconnects (the
handler is cancelled, or a write fails) stops its generation within one engine step.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Awaitable, Callable

from aiohttp import web

from gateway import responses
from gateway.auth import tenant_name
from gateway.cache_namespace import request_namespace
from gateway.choice import Choice, Delta
from gateway.errors import error_from_worker
from gateway.json_response import json_response
from gateway.request_id import current_request_id
from gateway.requests import CompletionRequest
from gateway.router import prefix_key
from gateway.sse import EventStream, until_the_client_leaves
from gateway.tools import ToolCall, ToolCallParser, family_of
from gateway.workers import Job, Restarted
from shared.errors import ContextLengthError, InvalidRequestError, ReameError
from shared.protocol import Error, Finished, TokenChunk

if TYPE_CHECKING:
    from gateway.state import GatewayState

log = logging.getLogger("reame.gateway")


async def complete(state: GatewayState, request: web.Request, req: CompletionRequest, prompts: list[list[int]],
                   arrived: float, extra_stops: tuple[str, ...] = (),
                   answer: Callable[[_Run, web.Request], Awaitable[web.StreamResponse]] | None = None,
                   extra_stop_ids: tuple[int, ...] = ()) -> web.StreamResponse:
    """`answer`: how an API other than OpenAI's completions shapes the reply (gateway.reply); it
    reads the run's choices as they arrive, and the jobs are released here whatever it does.
    `extra_stop_ids`: tokens that end this request's choices besides the model's end of turn."""
    await state.pool.wait_ready(state.config.gateway.queue_timeout)  # n_ctx is known from here on
    param = "messages" if req.chat else "prompt"
    _check_vocab(state, req, prompts)
    if req.constraint is not None:
        req = replace(req, grammar=await state.grammars.compile(req.constraint, tenant_name(request)))
    most = state.config.gateway.max_jobs_per_request
    if len(prompts) * req.n > most:  # one request must not take every place in the queue
        raise InvalidRequestError(f"this request asks for {len(prompts) * req.n} choices ({len(prompts)} prompt(s) × "
                                  f"n = {req.n}); at most {most} are allowed per request", param="n")
    namespace = request_namespace(state.config.prefix_cache.isolation, request, req.cache_salt)
    tenant = tenant_name(request)
    sink: asyncio.Queue = asyncio.Queue()
    jobs = []
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(state, req, ids, param)
        for j in range(req.n):
            params = req.params(max_tokens, state.stop_token_ids + extra_stop_ids, j)
            jobs.append(Job(uuid.uuid4().hex, p * req.n + j, ids, params,
                            sink, prefix_key(ids, namespace), cache_namespace=namespace, tenant=tenant,
                            speculative=req.speculative))
    if len(jobs) > state.config.gateway.max_queue:  # could never be queued: retrying would not help
        raise InvalidRequestError(f"this request asks for {len(jobs)} choices ({len(prompts)} prompt(s) × n = "
                                  f"{req.n}); at most {state.config.gateway.max_queue} can wait at once", param="n")
    state.pool.submit(jobs)
    rid = current_request_id()
    log.debug("request %s: %d job(s) on the workers: %s", rid, len(jobs), " ".join(j.request_id for j in jobs))
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
    run = _Run(state, req, jobs, sink, arrived, sum(len(ids) for ids in prompts), req.stop + extra_stops, rid)
    try:
        if answer is not None:
            return await answer(run, request)
        if req.stream:
            return await run.stream(request)
        return await run.collect()
    finally:
        for job in jobs:
            state.pool.release(job)
        run.log(prompts)


def _max_tokens(state: GatewayState, req: CompletionRequest, ids: list[int], param: str) -> int:
    room = state.pool.n_ctx - len(ids)
    if req.max_tokens is not None:
        wanted = req.max_tokens
    else:
        wanted = min(state.config.gateway.default_max_tokens or room, room)
    check_fits(state, ids, wanted, param)
    return wanted


def check_fits(state: GatewayState, ids: list[int], wanted: int, param: str) -> None:
    """The prompt, with `wanted` tokens after it, fits the workers' context. (An empty prompt is the
    worker's to refuse, as for every caller of the engine: worker.engine.Engine.validate.)"""
    n_ctx = state.pool.n_ctx
    if wanted < 1 or len(ids) + wanted > n_ctx:
        wanted = max(wanted, 1)
        raise ContextLengthError(
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{len(ids) + wanted} tokens ({len(ids)} in the {param}, {wanted} in the completion). "
            f"Please reduce the length of the {param} or completion.", param=param)


def check_token_ids(state: GatewayState, prompts: list[list[int]]) -> None:
    """Token ids a client sent are inside the vocabulary."""
    vocab = state.tokenizer.vocab_size
    for ids in prompts:
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} in 'prompt' is outside the vocabulary (size {vocab})",
                                      param="prompt")


def _check_vocab(state: GatewayState, req: CompletionRequest, prompts: list[list[int]]) -> None:
    check_token_ids(state, prompts)
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in req.sampling.logit_bias if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"'logit_bias' token id {bad} is outside the vocabulary (size {vocab})",
                                  param="logit_bias")


class _Run:
    def __init__(self, state: GatewayState, req: CompletionRequest, jobs: list[Job], sink: asyncio.Queue,
                 arrived: float, prompt_tokens: int, stops: tuple[str, ...], request_id: str):
        self.state = state
        self.request_id = request_id  # names the request in logs; `id` is the response's id
        self.stops = stops
        self.req = req
        self.sink = sink
        self.arrived = arrived
        self.prompt_tokens = prompt_tokens
        self.choices = {job: self._new_choice(job) for job in jobs}
        self.pending = set(jobs)
        self.cached_tokens = 0
        self.id = responses.new_id(req.chat)
        self.created = int(time.time())
        self.model = req.model or state.model_id
        self._first_token = True
        self._last_token: dict[Job, float] = {}
        tools = req.tools if req.chat and req.tools is not None and req.tools.active else None
        family = family_of(getattr(state.template, "source", ""))
        names = frozenset(t.name for t in tools.tools) if tools is not None else frozenset()
        # Replies that may hold tool calls are parsed as they come (gateway.tools).
        self.parsers = {job: ToolCallParser(family, names) for job in jobs} if tools is not None else {}
        self.calls_sent: dict[Job, int] = {}

    def _new_choice(self, job: Job) -> Choice:
        return Choice(job.index, self.state.decoder, self.stops, self.state.hidden_ids)

    # ---- the two ways to answer --------------------------------------------------------------

    async def collect(self) -> web.Response:
        while self.pending:
            await self._next()
        body = responses.completion(self.req.chat, self.id, self.created, self.model, self._ordered(),
                                    self._usage(), self.state.tokenizer.token_bytes,
                                    self.req.logprobs, self.req.top_logprobs)
        if self.parsers:
            by_index = {job.index: parser for job, parser in self.parsers.items()}
            for choice in body["choices"]:
                parser = by_index[choice["index"]]
                content, calls = parser.feed(choice["message"]["content"])
                rest, more = parser.finish()
                calls += more
                if calls:
                    choice["message"]["content"] = (content + rest) or None
                    choice["message"]["tool_calls"] = [call.as_openai() for call in calls]
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
        return json_response(body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        out = EventStream(request, self.state.config.gateway.write_timeout)
        return await until_the_client_leaves(out, self.request_id, lambda: self._send_events(out))

    async def _send_events(self, out: EventStream) -> None:
        try:
            while self.pending:
                batch = await self._next()
                for job, _ in batch:  # before any await: from here on the job may not move workers
                    job.delivered = True
                if batch and not out.started and self.req.chat:
                    for choice in self._ordered():  # OpenAI's first chunk per choice carries the role
                        await out.send(self._chunk([responses.role_delta(choice.index)]))
                for job, delta in batch:
                    if job in self.parsers:
                        await self._send_with_tools(out, job, delta)
                        continue
                    await out.send(self._chunk([responses.delta_choice(
                        self.req.chat, job.index, delta.text, delta.entries, delta.finish_reason,
                        self.state.tokenizer.token_bytes, self.req.logprobs, self.req.top_logprobs)]))
        except ReameError as exc:
            if not out.started:
                raise  # nothing sent yet: an ordinary HTTP error response
            await out.fail(exc)
            return
        except Exception as exc:
            if not out.started or isinstance(exc, ConnectionError):
                raise
            log.exception("request %s: failed mid-stream", self.request_id)
            await out.fail(ReameError("internal server error"))
            return
        if self.req.include_usage:
            await out.send(responses.chunk(self.req.chat, self.id, self.created, self.model, [],
                                           self._usage(), with_usage=True))
        await out.done()

    async def _send_with_tools(self, out: EventStream, job: Job, delta: Delta) -> None:
        """A delta of a reply that may call tools: its content as usual, each completed call as
        OpenAI streams one (index, id and name first, then the arguments), and finish_reason
        "tool_calls" when the reply made calls."""
        parser = self.parsers[job]
        content, calls = parser.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        token_bytes, logprobs, top = self.state.tokenizer.token_bytes, self.req.logprobs, self.req.top_logprobs
        if content or delta.entries:
            await out.send(self._chunk([responses.delta_choice(True, job.index, content, delta.entries, None,
                                                               token_bytes, logprobs, top)]))
        for call in calls:
            await self._send_call(out, job, call)
        if delta.finish_reason is not None:
            reason = "tool_calls" if delta.finish_reason == "stop" and self.calls_sent.get(job) else delta.finish_reason
            await out.send(self._chunk([responses.delta_choice(True, job.index, "", [], reason,
                                                               token_bytes, logprobs, top)]))

    async def _send_call(self, out: EventStream, job: Job, call: ToolCall) -> None:
        index = self.calls_sent.get(job, 0)
        self.calls_sent[job] = index + 1
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        for part in (head, {"index": index, "function": {"arguments": call.arguments}}):
            await out.send(self._chunk([{"index": job.index, "delta": {"tool_calls": [part]}, "logprobs": None,
                                         "finish_reason": None}]))

    # ---- applying worker events --------------------------------------------------------------

    async def next_deltas(self) -> list[tuple[Job, Delta]]:
        """Wait for events, apply all that are waiting, and return the merged delta per choice."""
        return await self._next()

    async def _next(self) -> list[tuple[Job, Delta]]:
        """Wait for events, apply all that are waiting, and return the merged delta per choice."""
        events = [await self.sink.get()]
        while not self.sink.empty():
            events.append(self.sink.get_nowait())
        merged: dict[Job, Delta] = {}
        for job, message in events:
            if job not in self.pending:
                continue
            choice = self.choices[job]
            if isinstance(message, TokenChunk):
                self._observe(job, len(message.tokens))
                delta = choice.add(message.tokens, message.logprobs, message.top_logprobs)
                if choice.done:  # a stop string matched: the worker need not go on
                    self.state.pool.release(job)
            elif isinstance(message, Finished):
                delta = choice.finish(message.finish_reason)
                self.cached_tokens = max(self.cached_tokens, message.cached_tokens)
            elif isinstance(message, Error):
                raise error_from_worker(message.error, message.message, message.param, message.code)
            elif isinstance(message, Restarted):
                self.choices[job] = self._new_choice(job)
                merged.pop(job, None)
                continue
            else:
                continue
            if choice.done:
                self.pending.discard(job)
            if delta:
                _merge(merged, job, delta)
        return list(merged.items())

    def _observe(self, job: Job, count: int) -> None:
        now = time.perf_counter()
        if self._first_token:
            self._first_token = False
            self.state.metrics.ttft.observe(now - self.arrived)
        last = self._last_token.get(job)
        if last is not None:
            self.state.metrics.itl.observe((now - last) / count)
        self._last_token[job] = now

    def log(self, prompts: list[list[int]]) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        tokens = sum(c.num_tokens for c in self.choices.values())
        log.debug("request %s (%s): %d prompt + %d generated tokens in %.3fs", self.request_id, self.id,
                  self.prompt_tokens, tokens, time.perf_counter() - self.arrived)
        if self.state.config.logging.log_prompts:  # user data: only when asked for
            for ids in prompts:
                text = self.state.tokenizer.decode(ids, skip_special=False)
                log.debug("request %s prompt: %r", self.request_id, text)
            for choice in self._ordered():
                log.debug("request %s choice %d: %r", self.request_id, choice.index, choice.text)

    # ---- shapes ------------------------------------------------------------------------------

    def _ordered(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    def _usage(self) -> dict:
        generated = sum(c.num_tokens for c in self.choices.values())
        return responses.usage(self.prompt_tokens, generated, self.cached_tokens)

    def _chunk(self, choices: list[dict]) -> dict:
        return responses.chunk(self.req.chat, self.id, self.created, self.model, choices,
                               None, with_usage=self.req.include_usage)


def _merge(merged: dict[Job, Delta], job: Job, delta: Delta) -> None:
    into = merged.get(job)
    if into is None:
        merged[job] = delta
        return
    into.text += delta.text
    into.entries.extend(delta.entries)
    into.finish_reason = delta.finish_reason or into.finish_reason
