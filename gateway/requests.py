"""Request bodies → a typed `CompletionRequest` (the OpenAI routes) or `WarmRequest` (/v1/warm),
or InvalidRequestError naming the field.

Pure functions (no I/O, no tokenizer): the checks here are about shapes, types and ranges.
Checks that need the model (context length, token ids in range) happen once the prompt is
tokenized. Unknown fields are ignored, as OpenAI's own server does for forward compatibility; in a
message they are dropped, so that they never reach the chat template.

Each request's fields are one table at the end of this file (gateway.request_fields): the parsers
read the body through it and gateway.openapi describes the request from it, so /openapi.json
lists exactly the fields read here, with the same limits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from gateway.request_fields import (
    Bounds,
    Field,
    Fields,
    Schema,
    flag,
    integer,
    limited,
    optional,
    read_bool,
    read_fields,
    read_int,
    read_object,
    text,
)
from gateway.structured import CONSTRAINT_FIELDS, Constraint, constraint_of
from gateway.tools import MAX_TOOLS, ToolRequest, parse_tools
from shared.errors import InvalidRequestError
from shared.sampling import LIMITS, MAX_LOGPROBS, SamplingParams

MAX_STOPS = 16
MAX_CACHE_SALT = 256
# Every stop string is searched for in the held-back text after each token; 16 × 256 bytes keeps
# that small, and real stop strings (end markers, "\n\n", "User:") are far shorter.
MAX_STOP_CHARS = 256
# Token ids have at most 7 digits (vocabularies stay under 10 million); a longer key is refused
# before int(), which raises on more than 4,300 digits.
MAX_TOKEN_ID_DIGITS = 9
# The message fields of OpenAI's schema; others are dropped before the chat template sees them.
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal"})
MAX_TOP_LOGPROBS_CHAT = MAX_LOGPROBS
MAX_LOGPROBS_COMPLETION = 5
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    model: str | None
    messages: tuple[dict, ...]  # chat: {"role", "content": str, ...}
    prompts: tuple[str | tuple[int, ...], ...]  # completions: text or token ids, one choice set each
    max_tokens: int | None  # None: the server's default
    sampling: SamplingParams  # every field but max_tokens and stop_token_ids
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    user: str | None
    cache_salt: str | None = None  # only requests with the same salt (and key) share cached prefixes
    constraint: Constraint | None = None  # response_format / grammar, as asked
    grammar: str = ""  # the constraint compiled (gateway.structured.GrammarCache); "" = free text
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls
    speculative: bool = True  # false: the worker drafts nothing for it (speculative decoding opt-out)

    def params(self, max_tokens: int, stop_token_ids: tuple[int, ...], choice: int) -> SamplingParams:
        """Sampling parameters for one choice; choice i of a seeded request uses seed + i."""
        seed = None if self.sampling.seed is None else self.sampling.seed + choice
        # Ask the engine for at least one alternative so the sampled token's own logprob comes back.
        top = max(self.top_logprobs, 1) if self.logprobs else 0
        return replace(self.sampling, max_tokens=max_tokens, stop_token_ids=stop_token_ids, seed=seed, logprobs=top,
                       grammar=self.grammar)


@dataclass(frozen=True)
class WarmRequest:
    """POST /v1/warm: one prompt to prefill into the prefix caches, given as a chat or as a completion."""
    model: str | None
    messages: tuple[dict, ...]  # as for /v1/chat/completions; () when `prompt` is given
    prompt: str | tuple[int, ...] | None  # text or token ids, as one /v1/completions prompt; None when `messages`
    cache_salt: str | None = None


def translated_tools(value: Any, function: Callable[[dict, str], dict]) -> list[dict]:
    """Another API's `tools` array as chat tools: each object becomes `function(tool, 'tools[i]')`."""
    if not isinstance(value, list):
        raise InvalidRequestError("'tools' must be an array", param="tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"'{where}' must be an object", param=where)
        tools.append({"type": "function", "function": function(tool, where)})
    return tools


def parse_chat(body: Any, *, max_n: int) -> CompletionRequest:
    body = read_object(body)
    values = read_fields(CHAT, body, Bounds(max_n))
    if values["top_logprobs"] and not values["logprobs"]:
        raise InvalidRequestError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    max_tokens = values["max_completion_tokens"]
    if max_tokens is None:
        max_tokens = values["max_tokens"]
    return completion_request(body, values, chat=True, messages=values["messages"], tools=parse_tools(body),
                              prompts=(), max_tokens=max_tokens, logprobs=values["logprobs"],
                              top_logprobs=values["top_logprobs"])


def parse_completion(body: Any, *, max_n: int) -> CompletionRequest:
    body = read_object(body)
    values = read_fields(COMPLETION, body, Bounds(max_n))
    logprobs = values["logprobs"]
    return completion_request(body, values, chat=False, messages=(), prompts=values["prompt"],
                              max_tokens=values["max_tokens"], logprobs=logprobs is not None,
                              top_logprobs=logprobs or 0)


def parse_warm(body: Any) -> WarmRequest:
    body = read_object(body)
    values = read_fields(WARM, body, Bounds(max_n=1))
    messages, prompt = body.get("messages"), body.get("prompt")
    if (messages is None) == (prompt is None):
        raise InvalidRequestError("give exactly one of 'messages' (a chat) and 'prompt' (text or token ids)",
                                  param="messages" if messages is None else "prompt")
    if messages is not None:
        return WarmRequest(values["model"], _messages(messages), None, values["cache_salt"])
    return WarmRequest(values["model"], (), _one_prompt(prompt), values["cache_salt"])


def completion_request(body: dict, values: dict[str, Any], **fields: Any) -> CompletionRequest:
    """The request from the values of SAMPLING's fields (read_fields) and what its route reads its own way."""
    sampling = SamplingParams(
        temperature=values["temperature"], top_p=values["top_p"], top_k=values["top_k"], min_p=values["min_p"],
        presence_penalty=values["presence_penalty"], frequency_penalty=values["frequency_penalty"],
        repetition_penalty=values["repetition_penalty"], logit_bias=values["logit_bias"], seed=values["seed"])
    return CompletionRequest(model=values["model"], sampling=sampling, stop=values["stop"], n=values["n"],
                             stream=values["stream"], include_usage=values["stream_options"], user=values["user"],
                             cache_salt=values["cache_salt"], constraint=constraint_of(body),
                             speculative=values["speculative"], **fields)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError("'stop' must be a string or an array of strings", param="stop")
    if len(value) > MAX_STOPS:
        raise InvalidRequestError(f"'stop' has {len(value)} entries; at most {MAX_STOPS} are allowed", param="stop")
    longest = max(value, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise InvalidRequestError(f"a 'stop' string is {len(longest)} characters long; at most {MAX_STOP_CHARS} "
                                  "are allowed", param="stop")
    return tuple(s for s in value if s)


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
        raise InvalidRequestError(f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT} characters",
                                  param="cache_salt")
    return salt


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("'logit_bias' must be an object of token id → bias", param="logit_bias")
    bias = {}
    for key, amount in value.items():
        # ASCII digits only: int() would also take " 7", "+7", "7_0" and other scripts' digits.
        if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
            raise InvalidRequestError(f"'logit_bias' key {key[:20]!r} is not a token id", param="logit_bias")
        token = int(key)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not LIMITS["logit_bias"].contains(amount):
            raise InvalidRequestError(f"'logit_bias' value for {key} must be a number, "
                                      f"{LIMITS['logit_bias'].describe()}", param="logit_bias")
        bias[token] = float(amount)
    return bias


def message_list(value: Any) -> list:
    """`messages` of any API (this one, Anthropic's): a conversation needs at least one message."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'messages' must be a non-empty array", param="messages")
    return value


def _messages(value: Any) -> tuple[dict, ...]:
    return tuple(_message(m, i) for i, m in enumerate(message_list(value)))


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"'{where}' must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a dict or list would not even hash
        raise InvalidRequestError(f"'{where}.role' must be one of {sorted(ROLES)}", param=f"{where}.role")
    content = message.get("content")
    if content is None:
        if role != "assistant":  # an assistant turn may carry only tool calls
            raise InvalidRequestError(f"'{where}.content' is required", param=f"{where}.content")
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{i}]") for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequestError(f"'{where}.content' must be a string or an array of text parts",
                                  param=f"{where}.content")
    for name in ("name", "tool_call_id", "refusal"):
        if message.get(name) is not None and not isinstance(message[name], str):
            raise InvalidRequestError(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise InvalidRequestError(f"'{where}.tool_calls' must be an array of objects", param=f"{where}.tool_calls")
    if message.get("function_call") is not None and not isinstance(message["function_call"], dict):
        raise InvalidRequestError(f"'{where}.function_call' must be an object", param=f"{where}.function_call")
    # Keys the template was not written for could steer it (a template may print any key it finds).
    kept = {key: value for key, value in message.items() if key in MESSAGE_FIELDS}
    return {**kept, "content": content}


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise InvalidRequestError(f"'{where}' must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                                  "this server serves text-only models", param=where)
    return part["text"]


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """`prompt` may be a string, an array of strings, an array of token ids, or an array of those;
    none of them empty (an empty prompt gives the model nothing to continue)."""
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and value:
        if all(_is_token(v) for v in value):
            return (tuple(int(v) for v in value),)
        if all(isinstance(v, str) and v for v in value):
            return tuple(value)
        if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
            return tuple(tuple(int(t) for t in v) for v in value)
    raise InvalidRequestError("'prompt' must be a non-empty string, an array of those, an array of token ids, "
                              "or an array of token-id arrays (none empty)", param="prompt")


def _one_prompt(value: Any) -> str | tuple[int, ...]:
    """One prompt: a non-empty string or a non-empty array of token ids."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(_is_token(v) for v in value):
        return tuple(int(v) for v in value)
    raise InvalidRequestError("'prompt' must be a non-empty string or a non-empty array of token ids", param="prompt")


def _is_token(value: Any) -> bool:
    # 7.0 is an integer to JSON Schema (and to `_int`), so it is a token id here too.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---- the fields of each request, read by the parsers above and described by gateway.openapi ------

def _of(reader: Callable[[Any], Any]) -> Callable[[dict, str, Bounds], Any]:
    """A reader of the field's value alone."""
    return lambda body, name, bounds: reader(body.get(name))


def _stream_options(body: dict, name: str, bounds: Bounds) -> bool:
    """stream_options.include_usage."""
    options = body.get(name)
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
    return read_bool(options or {}, "include_usage", False, label="stream_options.include_usage")


def _top_k(body: dict, name: str, bounds: Bounds) -> int:
    limit = LIMITS[name]
    return max(read_int(body, name, 0, limit.low, limit.high), 0)  # -1 is llama.cpp's "off"


def _token_id(bounds: Bounds) -> Schema:
    token = {"type": "integer", "minimum": 0}
    return token if bounds.vocab_size is None else {**token, "maximum": bounds.vocab_size - 1}


def _stop_schema(name: str, bounds: Bounds) -> Schema:
    stop = {"type": "string", "maxLength": MAX_STOP_CHARS}
    return {"anyOf": [stop, {"type": "array", "maxItems": MAX_STOPS, "items": stop}, {"type": "null"}],
            "description": f"up to {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each; "
                           "generation ends before the first one that appears"}


def _tools_schema(name: str, bounds: Bounds) -> Schema:
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"}, "parameters": {"type": "object"}}}
    return optional("array", maxItems=MAX_TOOLS, items={"type": "object", "required": ["function"], "properties": {
        "type": {"const": "function"}, "function": function}})


def _tool_choice_schema(name: str, bounds: Bounds) -> Schema:
    return {"anyOf": [
        {"enum": ["auto", "none", "required"]},
        {"type": "object", "required": ["function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
        {"type": "null"}], "description": "a named function must be in tools (else 400); "
                                          "'required' and a name need tools"}


def chat_message_schema() -> Schema:
    """One message as `_message` takes it (components/schemas/ChatMessage in the document)."""
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = [{"type": "string"}, {"type": "array", "items": text_part}]
    return {"anyOf": [
        # An assistant turn may carry only tool calls, so its content may be missing or null.
        {"type": "object", "required": ["role"], "properties": {
            "role": {"const": "assistant"}, "content": {"anyOf": [*content, {"type": "null"}]},
            "tool_calls": {"type": ["array", "null"], "items": {"type": "object"}}}},
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": sorted(ROLES - {"assistant"})}, "content": {"anyOf": content}}},
    ]}


def _messages_schema(name: str, bounds: Bounds) -> Schema:
    return {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}}


def _prompts_schema(name: str, bounds: Bounds) -> Schema:
    token_id = _token_id(bounds)
    return {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": token_id},
        {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": token_id}},
    ], "description": "text, texts, token ids, or lists of token ids (one choice set per prompt)"}


def _one_prompt_schema(name: str, bounds: Bounds) -> Schema:
    return {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": _token_id(bounds)}],
            "description": "text or token ids"}


MODEL = text("Optional: this server serves one model")
CACHE_SALT = Field(lambda name, b: optional("string", minLength=1, maxLength=MAX_CACHE_SALT, description=(
                       "only requests with the same salt (and API key) share cached prompt prefixes")),
                   lambda body, name, b: _cache_salt(body))
# Both completion APIs (and /infill).
SAMPLING: Fields = {
    "model": MODEL,
    "temperature": limited("number", 1.0),
    "top_p": limited("number", 1.0),
    "top_k": Field(limited("integer", 0, "0 or -1: off").schema, _top_k),
    "min_p": limited("number", 0.0),
    "presence_penalty": limited("number", 0.0),
    "frequency_penalty": limited("number", 0.0),
    "repetition_penalty": limited("number", 1.0),
    "logit_bias": Field(lambda name, b: optional(
        "object", propertyNames={"pattern": f"^[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}$"},
        additionalProperties={"type": "number", **LIMITS["logit_bias"].schema()},
        description="token id → bias; ids must be in the vocabulary (else 400)"), _of(_logit_bias)),
    "seed": limited("integer", None),
    "n": integer(1, 1, lambda bounds: bounds.max_n),
    "stop": Field(_stop_schema, _of(_stops)),
    "stream": flag(False),
    "stream_options": Field(lambda name, b: optional("object", properties={"include_usage": optional("boolean")}),
                            _stream_options),
    "user": text(),
    "cache_salt": CACHE_SALT,
    "speculative": flag(True, "false: no speculative decoding for this request, and its completion teaches no "
                              "drafts (the output is the same either way)"),
    "max_tokens": limited("integer", None, "prompt + max_tokens must fit the context (else 400)"),
    **CONSTRAINT_FIELDS,
}
# Chat only, read by gateway.tools.parse_tools: OpenAI function tools.
TOOLS: Fields = {
    "tools": Field(_tools_schema),
    "tool_choice": Field(_tool_choice_schema),
    "parallel_tool_calls": Field(lambda name, b: optional("boolean")),
}
CHAT: Fields = {
    "messages": Field(_messages_schema, _of(_messages)),
    **SAMPLING,
    **TOOLS,
    "max_completion_tokens": limited("integer", None, "takes precedence over max_tokens", row="max_tokens"),
    "logprobs": flag(False),
    "top_logprobs": integer(0, 0, MAX_TOP_LOGPROBS_CHAT, "requires logprobs: true (else 400)"),
}
COMPLETION_LOGPROBS = integer(None, 0, MAX_LOGPROBS_COMPLETION)
COMPLETION: Fields = {
    "prompt": Field(_prompts_schema, _of(_prompts)),
    **SAMPLING,
    "logprobs": COMPLETION_LOGPROBS,
    # Read by gateway.infill.completion_infill.
    "suffix": Field(lambda name, b: optional("string", description=(
        "fill in the middle: text after the completion (one text prompt only; a model without FIM tokens "
        "answers 400)"))),
    "echo": flag(False, "not supported: ignored, and a 400 together with suffix"),
}
# /v1/warm: exactly one of messages and prompt (parse_warm reads them; the document says oneOf).
WARM: Fields = {
    "model": MODEL,
    "messages": Field(_messages_schema),
    "prompt": Field(_one_prompt_schema),
    "cache_salt": CACHE_SALT,
}
