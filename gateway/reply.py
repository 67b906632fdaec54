"""One choice's reply as an API other than OpenAI's completions sees it: content text and tool
calls as they complete, then how it ended; and an event stream with named events.

The Anthropic Messages API (gateway.anthropic_api) and the OpenAI Responses API
(gateway.responses_api) run on `completion.complete` like /v1/chat/completions: the same jobs,
choices, stop strings and tool-call parser. They pass an `answer` that reads the run through
`parts` and writes their own shapes; only the shapes differ.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from gateway.choice import Choice, TokenEntry
from gateway.sse import EventStream, until_the_client_leaves
from gateway.tools import ToolCall, ToolCallParser
from shared.errors import ReameError

if TYPE_CHECKING:
    from gateway.completion import _Run

log = logging.getLogger("reame.gateway")


@dataclass
class Part:
    """What one batch of worker events added to the reply."""
    text: str = ""  # content the client may see now
    calls: list[ToolCall] = field(default_factory=list)  # tool calls completed in this part
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls", on the last part only
    entries: list[TokenEntry] = field(default_factory=list)  # the tokens released with `text` (log-probabilities)


@dataclass
class Ending:
    """How the reply ended, known once `parts` is exhausted."""
    finish_reason: str = "stop"
    stop_string: str | None = None  # the client's stop string that ended it, if one did
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def parts(run: _Run, ending: Ending) -> AsyncIterator[Part]:
    """A streamed run's one choice as it arrives. Calls are taken out of the content by the
    run's tool-call parser (when the request has tools); a reply that made calls ends "tool_calls"."""
    (job,) = run.choices
    parser = run.parsers.get(job)
    made_calls = False
    while run.pending:
        batch = await run.next_deltas()
        for done, _ in batch:  # before any await: from here on the job may not move workers
            done.delivered = True
        for _, delta in batch:
            part = Part(delta.text, entries=_shown(run.choices[job], delta.entries))
            if parser is not None:
                part.text, part.calls = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    rest, more = parser.finish()
                    part.text, part.calls = part.text + rest, part.calls + more
            made_calls = made_calls or bool(part.calls)
            if delta.finish_reason is not None:
                part.finish_reason = "tool_calls" if made_calls and delta.finish_reason == "stop" else delta.finish_reason
            if part.text or part.calls or part.finish_reason or part.entries:
                yield part
    _end(run, made_calls, ending)


async def whole(run: _Run, ending: Ending) -> Part:
    """A run's one choice once it has ended, read as `_Run.collect` reads it: from the final text
    (a job moved to another worker after its first tokens starts its choice again)."""
    while run.pending:
        await run.next_deltas()
    (job,) = run.choices
    part = Part(run.choices[job].text, entries=_shown(run.choices[job], run.choices[job].entries))
    parser = run.parsers.get(job)
    if parser is not None:
        fresh = ToolCallParser(parser.family, parser.names)
        part.text, part.calls = fresh.feed(part.text)
        rest, more = fresh.finish()
        part.text, part.calls = part.text + rest, part.calls + more
    _end(run, bool(part.calls), ending)
    part.finish_reason = ending.finish_reason
    return part


def _shown(choice: Choice, entries: list[TokenEntry]) -> list[TokenEntry]:
    """The entries of the tokens whose text the reply shows: not the end-of-generation token."""
    return [e for e in entries if e.token not in choice.hidden_ids]


def _end(run: _Run, made_calls: bool, ending: Ending) -> None:
    (choice,) = run.choices.values()
    matched = choice.matcher.matched
    ending.finish_reason = "tool_calls" if made_calls and choice.finish_reason == "stop" else choice.finish_reason
    ending.stop_string = matched if matched in run.req.stop else None
    ending.output_tokens = choice.num_tokens
    ending.prompt_tokens = run.prompt_tokens
    ending.cached_tokens = run.cached_tokens


class NamedEventStream(EventStream):
    """Server-sent events with an `event:` line, as both Anthropic's and the Responses API's
    streams have (the anthropic SDK skips events without one), and no `[DONE]`."""

    async def emit(self, name: str, data: dict) -> None:
        await self._write(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    async def end(self) -> None:
        await self.response.write_eof()


async def stream_events(run: _Run, request: web.Request, body: Callable[[NamedEventStream], Awaitable[None]],
                        failure: Callable[[ReameError], tuple[str, dict]]) -> web.StreamResponse:
    """Run `body` over a named-event stream, as `_Run.stream` runs OpenAI's: an error before the
    first event is an ordinary HTTP error; after it, the `failure` event ends the stream; a client
    that left or stopped reading ends it quietly (`complete` then aborts the job)."""
    out = NamedEventStream(request, run.state.config.gateway.write_timeout)

    async def send() -> None:
        try:
            await body(out)
        except ReameError as exc:
            if not out.started:
                raise
            await _fail(out, *failure(exc))
            return
        except Exception as exc:
            if not out.started or isinstance(exc, ConnectionError):
                raise
            log.exception("request %s: failed mid-stream", run.request_id)
            await _fail(out, *failure(ReameError("internal server error")))
            return
        await out.end()

    return await until_the_client_leaves(out, run.request_id, send)


async def _fail(out: NamedEventStream, name: str, data: dict) -> None:
    await out.emit(name, data)
    await out.end()
