"""Chat messages and text prompts → token ids: off the event loop, bounded, and with what a client
wrote inside a message kept as plain text.

Off the event loop: rendering and tokenizing a 4 MiB body takes seconds of CPU, and every stream,
/health and every other request would wait for it. A text of more than n_ctx × (bytes of the
longest token) bytes cannot fit the context whatever it tokenizes to, so it is refused before
tokenizing. A short text (the common case) is tokenized on a small thread pool; a long one in a
pool of processes at the lowest CPU priority (EncodeProcesses): in a gateway thread, one regex call
over a 660 KB piece held the GIL (and so the event loop) for ~450 ms, and the threads took the
CPU from the worker beside it, whose stream then stalled for seconds.

Plain text: the rendered template is tokenized with special tokens parsed, so that its own turn
markers become control tokens. A message containing `<|im_end|>\\n<|im_start|>system\\n...` must
not open a system turn, nor one containing `<tool_call>...</tool_call>` (a user-defined token on
Qwen, which llama.cpp cuts out of any text) write a call the model takes for its own. Before
anything is added to them, each marker token's text (control and unknown tokens, and the
user-defined ones that mark structure: Tokenizer.marker_texts) found in a client's strings
(content, name, tool call arguments, any string or key in the message, and the tools' names,
descriptions and schemas) is replaced by a private-use character that occurs nowhere in the
messages, the tools or the template. Then the server's own structure is added (the tool list and
past calls as gateway.tools writes them for the template) and the template renders; the
characters are put back and their spans tokenized with no special token cut out. So every marker
token in the ids comes from the template or from gateway.tools. User-defined tokens that are
pieces of ordinary text (Gemma's "\\n\\n", runs of spaces, "<b>") are cut out as llama.cpp does.
Requests without marker text render and tokenize exactly as before. With `[gateway]
content_specials = reject` such a message is refused instead (400 naming the field).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from gateway.tools import MARKERS, Tool, ToolRequest, native_tools, prompt_messages, with_argument_objects
from shared.errors import ContextLengthError, InvalidRequestError, TokenizerError

T = TypeVar("T")
log = logging.getLogger("reame.gateway")

# Two threads, two processes: one long prompt does not hold up every other behind it.
ENCODE_THREADS = 2
ENCODE_PROCESSES = 2
# Texts longer than this (characters, all strings of the messages together) go to the processes.
# Measured with SmolLM2 (EPYC, 2 cores, busy): 8 K characters encode in 26-46 ms and hold the GIL
# at most 8-11 ms at a time (32 K: 120-175 ms, GIL 20-26 ms), so a thread costs the event loop
# little, but every such request would be CPU taken at full priority from the worker. A process
# adds ~0.4 ms to a 100-character chat (1.16 against 0.72 ms) and is as fast from 16 K on.
SHORT_TEXT = 8_192
# Streams first: a tokenizing process's CPU weight is 15 against the worker's and the event loop's
# 1024 (nice 0), so while they are busy a long prompt waits (~1.5% of a core). Measured under the
# maximal-body attack (tests/e2e/test_large_prompts.py): the stream's longest gap 39 ms, /health
# at most 20 ms; tokenized in gateway threads, 5.5 s (4.1 s quiet, the host busy) and 362 ms.
PROCESS_NICE = 19
_FIRST_PLACEHOLDER = 0xF0000     # Supplementary Private Use Area-A


class PromptEncoder:
    def __init__(self, tokenizer: Any, template: Any, content_specials: str = "text",
                 processes: EncodeProcesses | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.content_specials = content_specials        # "text" | "reject"
        source = getattr(template, "source", "")
        markers = (tokenizer.marker_texts(source, *MARKERS) if hasattr(tokenizer, "marker_texts")
                   else getattr(tokenizer, "control_texts", ()))
        markers = sorted(markers, key=len, reverse=True)
        self._markers = re.compile("|".join(map(re.escape, markers))) if markers else None
        # Whether the template prints the tool list and past calls itself (else gateway.tools writes them).
        self._native = native_tools(source)
        self._executor = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="encode")
        # None (test doubles, the child processes themselves): everything runs on the threads.
        self._processes = processes

    async def chat_ids(self, messages: tuple[dict, ...], n_ctx: int, tools: ToolRequest | None = None) -> list[int]:
        """tools: the request's tools, shown to the model as its template wants (gateway.tools)."""
        if self._processes is not None and sum(len(v) for _, v in _strings((messages, _listed(tools)))) > SHORT_TEXT:
            return await self._processes.run(_child_chat, messages, n_ctx, tools)
        return await self._off_loop(self.encode_chat, messages, n_ctx, tools)

    async def prompt_ids(self, prompt: str | tuple[int, ...], n_ctx: int) -> list[int]:
        if isinstance(prompt, tuple):
            return list(prompt)
        if self._processes is not None and len(prompt) > SHORT_TEXT:
            return await self._processes.run(_child_prompt, prompt, n_ctx)
        return await self._off_loop(self.encode_prompt, prompt, n_ctx)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.close()

    # ---- the work, run on the pool (and called directly by tests) --------------------------------

    def encode_chat(self, messages: tuple[dict, ...], n_ctx: int = 0, tools: ToolRequest | None = None) -> list[int]:
        # Templates render every message's content: content that alone cannot fit is refused before
        # the scan and the render (seconds of CPU for a 4 MiB body), not after.
        self._check_bytes(sum(map(_utf8_size, _contents(messages))), n_ctx, "messages")
        tools = tools if tools is not None and tools.active else None
        # Arguments sent as JSON text are decoded before the scan: it sees the strings printed.
        messages = with_argument_objects(tuple(messages))
        # The tool list reaches the template as it is (Qwen prints it with tojson): its names,
        # descriptions and schema keys are scanned as the messages are.
        (messages, tools), placeholders = self._plain_parts(messages, tools)
        messages = prompt_messages(messages, tools, self._native)
        listed = _listed(tools) if self._native else ()
        try:
            extra = {"tools": list(listed)} if listed else {}
            text = self.template.render(messages, add_generation_prompt=True, **extra)
        except TokenizerError as exc:  # e.g. a template that insists on alternating roles
            raise InvalidRequestError(f"the chat template rejected these messages: {exc.message}",
                                      param="messages") from None
        text, literal = _restore(text, placeholders)
        self._check_size(text, n_ctx, "messages")
        # The template leaves BOS out when the tokenizer adds it, so specials are added here.
        if literal:
            return self.tokenizer.encode(text, add_special=True, parse_special=True, literal=literal)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    def encode_prompt(self, prompt: str, n_ctx: int = 0) -> list[int]:
        # /v1/completions prompts are raw model input: specials in them are meant (as in llama.cpp).
        self._check_size(prompt, n_ctx, "prompt")
        return self.tokenizer.encode(prompt, add_special=True, parse_special=True)

    # ---- parts ------------------------------------------------------------------------------------

    async def _off_loop(self, work: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def _check_size(self, text: str, n_ctx: int, param: str) -> None:
        self._check_bytes(_utf8_size(text), n_ctx, param)

    def _check_bytes(self, size: int, n_ctx: int, param: str) -> None:
        token_bytes = getattr(self.tokenizer, "max_token_bytes", None)
        if not n_ctx or not token_bytes:
            return
        if size > n_ctx * token_bytes:
            raise ContextLengthError(
                f"This model's maximum context length is {n_ctx} tokens. The {param} is {size} bytes, "
                f"more than {n_ctx} tokens of at most {token_bytes} bytes can hold. Please reduce the "
                f"length of the {param}.", param=param)

    def _plain_parts(self, messages: tuple[dict, ...], tools: ToolRequest | None
                     ) -> tuple[tuple[tuple[dict, ...], ToolRequest | None], dict[str, str]]:
        """(messages, tools) with marker-token text in any string replaced by placeholders (or refused)."""
        if self._markers is None:
            return (messages, tools), {}
        listed = _listed(tools)
        found: dict[str, str] = {}      # marker text → where it was first seen
        for where, value in [*_strings(messages), *_strings(listed, "tools")]:
            for match in self._markers.finditer(value):
                found.setdefault(match.group(), where)
        if not found:
            return (messages, tools), {}
        if self.content_specials == "reject":
            text, where = next(iter(found.items()))
            raise InvalidRequestError(f"'{where}' contains the special token {text!r}; this server refuses "
                                      "special-token text in messages and tools",
                                      param=where.split(".")[0])
        placeholder_of = dict(zip(found, self._free_characters((messages, listed), len(found))))

        def swap(value: Any) -> Any:
            return _map_strings(value, lambda text: self._markers.sub(lambda m: placeholder_of[m.group()], text))

        if tools is not None:
            tools = replace(tools, choice=swap(tools.choice), tools=tuple(
                Tool(swap(t.name), swap(t.description), swap(t.parameters)) for t in tools.tools))
        return (tuple(swap(m) for m in messages), tools), {p: text for text, p in placeholder_of.items()}

    def _free_characters(self, values: object, count: int) -> list[str]:
        """`count` characters that occur in no string of `values` nor in the template's source."""
        texts = [value for _, value in _strings(values)] + [getattr(self.template, "source", "")]
        free, code = [], _FIRST_PLACEHOLDER
        while len(free) < count:
            ch = chr(code)
            if not any(ch in t for t in texts):
                free.append(ch)
            code += 1
        return free


class EncodeProcesses:
    """Processes that tokenize long texts, each with its own tokenizer and template built once from
    the GGUF (`[model]` and `[gateway]` settings as the gateway's), at nice PROCESS_NICE.

    'spawn', not fork: the gateway has ZeroMQ's and asyncio's threads running by then. A process
    that dies (killed, out of memory) breaks the whole pool: the pool is replaced, and the requests
    it held are answered 503, not retried (the request may be what killed it)."""

    def __init__(self, model_path: Path, config: Any, size: int = ENCODE_PROCESSES):
        self._initargs = (str(model_path), config)
        self._size = size
        self._pool = self._start()

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        from gateway.errors import ServiceUnavailableError

        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, work, *args)
        except BrokenProcessPool:
            if pool is self._pool:      # the first request to see it replaces it
                log.error("gateway: a tokenizing process died; starting new ones")
                _stop(pool)
                self._pool = self._start()
            raise ServiceUnavailableError("the process tokenizing this request stopped unexpectedly; "
                                          "the request may be retried") from None

    def close(self) -> None:
        _stop(self._pool)

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self._size, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_child, initargs=self._initargs)
        # One process starts now, so the first long prompt does not wait for a tokenizer to be built.
        pool.submit(_child_ready)
        return pool


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut the pool down now: a process still tokenizing an attacker's 4 MiB body is killed, not
    waited for. `_processes` is the executor's own table; it has no public handle on them."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


# ---- inside a tokenizing process ------------------------------------------------------------------

_child: PromptEncoder | None = None


def _start_child(model_path: str, config: Any) -> None:
    global _child
    _lower_priority()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the gateway's to handle
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    from gateway.chat_template import template_for
    from gateway.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model_path)
    _child = PromptEncoder(tokenizer, template_for(tokenizer, config), config.gateway.content_specials)


def _lower_priority() -> None:
    """Nice PROCESS_NICE, in a session of its own. With autogroups (Linux's default for desktops and
    for this dev host), CPU is shared between sessions first and nice only counts inside one: the
    harness and `reame serve` start the gateway and the worker in sessions of their own, and a nice-19
    process in the gateway's session still took half the CPU the worker wanted (3.5 s each in one
    stream). A session of its own puts it in its own autogroup, whose nice is set here too. (Under
    systemd the gateway's cgroup, not nice, sets what its processes may take.)"""
    os.nice(PROCESS_NICE)
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(PROCESS_NICE))
    except OSError:
        pass    # no autogroups here: nice alone counts


def _exit_with_parent(parent: int) -> None:
    """A gateway killed with SIGKILL cannot stop its pool, and a process waiting for work waits
    forever (tried: a spawn pool's process outlived its killed parent); so it leaves when the parent
    is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _child_ready() -> None:
    pass


def _child_chat(messages: tuple[dict, ...], n_ctx: int, tools: ToolRequest | None = None) -> list[int]:
    return _child.encode_chat(messages, n_ctx, tools)


def _child_prompt(prompt: str, n_ctx: int) -> list[int]:
    return _child.encode_prompt(prompt, n_ctx)


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def _listed(tools: ToolRequest | None) -> tuple[dict, ...]:
    """The tools as OpenAI tool objects: what a template that prints them is given."""
    return tuple(t.as_openai() for t in tools.tools) if tools is not None else ()


def _contents(messages: tuple[dict, ...]) -> Iterator[str]:
    """Each message's content: the string, or the text of each of its parts."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [content] if isinstance(content, str) else content if isinstance(content, (list, tuple)) else ()
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                yield text


def _strings(value: Any, where: str = "messages") -> Iterator[tuple[str, str]]:
    """(path, string) for every string value inside `value`, keys too. Roles are scanned as well:
    a "role" key deeper down (a tool's property, a call's arguments) is text like any other."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, f"{where}.{key}")   # a key, too, can reach the text (tojson)
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_map_strings(k, change): _map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, change) for v in value]
    return value


def _restore(text: str, placeholders: dict[str, str]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text with placeholders put back, and the (start, end) spans they fill."""
    if not placeholders:
        return text, []
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = size = 0
    for match in re.finditer("[" + "".join(placeholders) + "]", text):
        before = text[pos:match.start()]
        original = placeholders[match.group()]
        parts += (before, original)
        size += len(before)
        spans.append((size, size + len(original)))
        size += len(original)
        pos = match.end()
    parts.append(text[pos:])
    return "".join(parts), spans
