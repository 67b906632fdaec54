"""OpenAI tools: `tools`, `tool_choice` and `parallel_tool_calls` in; the prompt that shows them
to the model; the grammar that forces a call; and the model's call syntax parsed back out.

Families (how a model writes a call, chosen from its chat template):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
  (Qwen 2.5/3, Hermes, and the format Reame teaches models whose template has no tool support,
  such as SmolLM2);
- llama3: a bare JSON object `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`.
A reply in neither form that is exactly a JSON call object (or a list of them) naming a known
tool is read as calls too (the generic fallback).

A template that mentions `tools` renders the tool list and the history's calls itself; for any
other, the tool list goes into the system message and past calls and results are written in the
hermes form, so every model sees its tools.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.structured import Constraint
from shared.errors import InvalidRequestError
from shared.grammar import JSON_OPTIONS, bounded_numbers

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # a forced reply holds at most this many calls
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# The markers this module writes itself for a template without tool support (see prompt_messages).
MARKERS = (OPEN, CLOSE, PYTHON_TAG, "<tool_response>", "</tool_response>")

Family = Literal["hermes", "llama3"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments object

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "auto" | "none" | "required" | a tool's name
    parallel: bool

    @property
    def active(self) -> bool:
        """The model may call: the tool list is in the prompt and its reply is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    def forced(self) -> tuple[Tool, ...]:
        """The tools one of which the reply must call: all for "required", one when named, none otherwise."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---- the request ---------------------------------------------------------------------------------

def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` → ToolRequest (None without tools), or a 400 naming the field."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if raw is None:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidRequestError(f"'tools' must be an array of at most {MAX_TOOLS} tools", param="tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("'tools' names a function twice", param="tools")
    return ToolRequest(tools, _choice(choice, names), parallel is not False)


def _tool(value: Any, where: str) -> Tool:
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise InvalidRequestError(f"'{where}' must be an object with type 'function'", param=f"{where}.type")
    function = value.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"'{where}.function' must be an object", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
                                  param=f"{where}.function.name")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise InvalidRequestError(f"'{where}.function.description' must be a string",
                                  param=f"{where}.function.description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"'{where}.function.parameters' must be a JSON Schema object",
                                  param=f"{where}.function.parameters")
    return Tool(name, description, parameters)


def _choice(value: Any, names: list[str]) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise InvalidRequestError("'tool_choice' must be 'auto', 'none', 'required' or a function",
                                      param="tool_choice")
        return value
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("'tool_choice' must be 'auto', 'none', 'required' or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if name not in names:
        raise InvalidRequestError(f"'tool_choice' names '{name[:64]}', which is not in 'tools'",
                                  param="tool_choice.function.name")
    return name


def family_of(template_source: str) -> Family:
    return "llama3" if PYTHON_TAG in template_source or "ipython" in template_source else "hermes"


def native_tools(template_source: str) -> bool:
    """Whether the chat template renders `tools` itself (Qwen, Llama 3.1, Hermes do; SmolLM2 does not)."""
    return "tools" in template_source


# ---- the grammar that forces a call ----------------------------------------------------------------

def call_constraint(request: ToolRequest, family: Family) -> Constraint | None:
    """With `required` or a named tool, a Lark grammar whose every sentence is a valid call (or,
    with parallel calls, up to MAX_PARALLEL_CALLS of them); None when the model chooses freely."""
    forced = request.forced()
    if not forced:
        return None
    key = "parameters" if family == "llama3" else "arguments"
    # Numbers get bounded digits as response_format's do: unbounded, greedy decoding may write
    # digits until max_tokens (shared.grammar.INTEGER_DIGITS).
    schema = {"anyOf": [{"type": "object",
                         "properties": {"name": {"const": t.name}, key: bounded_numbers(t.parameters)},
                         "required": ["name", key], "additionalProperties": False} for t in forced],
              "x-guidance": JSON_OPTIONS}
    call = f"%json {json.dumps(schema)}"
    if family == "llama3":
        lark = f"start: call\ncall: {call}"  # Llama 3 writes one call per reply
    else:
        repeat = f' ("\\n" tc){{0,{MAX_PARALLEL_CALLS - 1}}}' if request.parallel and request.choice == "required" else ""
        lark = f'start: tc{repeat}\ntc: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: {call}'
    return Constraint("lark", lark, "tools")


# ---- the prompt -----------------------------------------------------------------------------------

def prompt_messages(messages: tuple[dict, ...], request: ToolRequest | None, native: bool) -> tuple[dict, ...]:
    """Messages as the template should see them. With `native` the template renders tools and
    calls itself (only the arguments become objects, as templates expect); otherwise the tool list
    joins the system message and past calls and results are written out in the hermes form."""
    if native:
        return with_argument_objects(messages)
    out: list[dict] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            blocks = [f"{OPEN}\n{json.dumps(_call_object(c), ensure_ascii=False)}\n{CLOSE}"
                      for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [message.get("content"), *blocks]))})
        elif role in ("tool", "function"):
            text = f"<tool_response>\n{message.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # results of one turn's calls share a user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
        else:
            out.append(dict(message))
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if request is not None and request.active:
        out = _with_tool_list(out, request.tools)
    return tuple(out)


def _with_tool_list(messages: list[dict], tools: tuple[Tool, ...]) -> list[dict]:
    # Unescaped (ensure_ascii=False), as Qwen's tojson prints it: a \u escape would hide the
    # stand-ins gateway.prompts puts for special-token text, and the model reads the text itself.
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    text = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "role": "system", "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def with_argument_objects(messages: tuple[dict, ...]) -> tuple[dict, ...]:
    """The messages with each past call's arguments (JSON text, as OpenAI sends them) as objects."""
    return tuple(_native_message(m) for m in messages)


def _native_message(message: dict) -> dict:
    if message["role"] != "assistant" or not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c.get("function", {}), "arguments": _call_object(c)["arguments"]}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _call_object(call: dict) -> dict:
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown to the model as the text it was
    return {"name": function.get("name", ""), "arguments": arguments}


# ---- the reply --------------------------------------------------------------------------------------

class ToolCallParser:
    """Splits a reply, as it streams, into content and tool calls.

    `feed` returns the content that can be shown now and the calls completed so far; text that may
    still turn out to be a call (a partial `<tool_call>`, or a reply that opens with `{`) is held
    back until `finish`."""

    def __init__(self, family: Family, names: frozenset[str]):
        self.family = family
        self.names = names
        self._pending = ""  # text not yet released as content or taken as calls
        self._calls_seen = False
        self._released_any = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content, calls = "", []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content += self._release(self._pending[:start])
                self._pending = self._pending[start:]
                return content, calls
            call = _parse_call(self._pending[start + len(OPEN):end])
            content += self._release(self._pending[:start])
            if call is not None and call.name in self.names:
                calls.append(call)
                self._calls_seen = True
            elif call is not None:  # a tool that was not offered: what the model wrote stays text
                content += self._release(self._pending[start:end + len(CLOSE)])
            self._pending = self._pending[end + len(CLOSE):]
        if self._may_be_json_call():
            return content, calls
        keep = _partial_suffix(self._pending, OPEN)
        content += self._release(self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: an unclosed `<tool_call>` block, a whole-reply JSON call, or plain content."""
        text, self._pending = self._pending, ""
        if text.startswith(OPEN):
            call = _parse_call(text[len(OPEN):])
            if call is not None and call.name in self.names:
                return "", [call]
        if not self._calls_seen and not self._released_any:
            calls = self._json_calls(text)
            if calls:
                return "", calls
        return self._release(text), []

    def _may_be_json_call(self) -> bool:
        """Nothing released yet and the reply opens like a JSON call: wait for the whole reply."""
        head = self._pending.lstrip()
        return not self._released_any and not self._calls_seen and (
            head.startswith(("{", "[", PYTHON_TAG)) or PYTHON_TAG.startswith(head))

    def _json_calls(self, text: str) -> list[ToolCall]:
        text = text.strip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].strip()
        try:
            value = json.loads(text)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = [_call_from(item) for item in items]
        if not calls or any(c is None or c.name not in self.names for c in calls):
            return []
        return calls

    def _release(self, text: str) -> str:
        if text:
            self._released_any = True
        return text


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body.strip())
    except ValueError:
        return None
    return _call_from(value)


def _call_from(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker` (it may complete later)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
