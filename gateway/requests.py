"""Request bodies → a typed `CompletionRequest` (the OpenAI routes) or `WarmRequest` (/v1/warm),
or InvalidRequestError naming the field.

Pure functions (no I/O, no tokenizer): the checks here are about shapes, types and ranges.
Checks that need the model (context length, token ids in range) happen once the prompt is
tokenized. Unknown fields are ignored, as OpenAI's own server does for forward compatibility; in a
message they are dropped, so that they never reach the chat template.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from gateway.structured import Constraint, constraint_of
from gateway.tools import ToolRequest, parse_tools
from shared.errors import InvalidRequestError
from shared.sampling import LIMITS, MAX_LOGPROBS, SamplingParams, check

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
    body = _object(body)
    messages = _messages(body.get("messages"))
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS_CHAT)
    if top and not logprobs:
        raise InvalidRequestError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", None, LIMITS["max_tokens"].low, None)
    if max_tokens is None:
        max_tokens = _limited_int(body, "max_tokens", None)
    return _common(body, max_n, chat=True, messages=messages, tools=parse_tools(body),
                   prompts=(), max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top)


def parse_completion(body: Any, *, max_n: int) -> CompletionRequest:
    body = _object(body)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS_COMPLETION)
    return _common(body, max_n, chat=False, messages=(), prompts=_prompts(body.get("prompt")),
                   max_tokens=_limited_int(body, "max_tokens", None),
                   logprobs=logprobs is not None, top_logprobs=logprobs or 0)


def parse_warm(body: Any) -> WarmRequest:
    body = _object(body)
    model = _model(body)
    messages, prompt = body.get("messages"), body.get("prompt")
    if (messages is None) == (prompt is None):
        raise InvalidRequestError("give exactly one of 'messages' (a chat) and 'prompt' (text or token ids)",
                                  param="messages" if messages is None else "prompt")
    if messages is not None:
        return WarmRequest(model, _messages(messages), None, _cache_salt(body))
    return WarmRequest(model, (), _one_prompt(prompt), _cache_salt(body))


def _common(body: dict, max_n: int, **fields: Any) -> CompletionRequest:
    model = _model(body)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
    include_usage = _bool(options or {}, "include_usage", False, label="stream_options.include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequestError("'user' must be a string", param="user")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=max(_limited_int(body, "top_k", 0), 0),  # -1 is llama.cpp's "off"
        min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        seed=_limited_int(body, "seed", None),
    )
    return CompletionRequest(model=model, sampling=sampling, stop=_stops(body.get("stop")),
                             n=_int(body, "n", 1, 1, max_n), stream=stream, include_usage=include_usage,
                             user=user, cache_salt=_cache_salt(body), constraint=constraint_of(body),
                             speculative=_bool(body, "speculative", True), **fields)


# ---- field readers: each names the field in its error -------------------------------------------

def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("'model' must be a string", param="model")
    return model


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


def _bool(body: dict, name: str, default: bool, *, label: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        label = label or name
        raise InvalidRequestError(f"'{label}' must be a boolean", param=label)
    return value


def _int(body: dict, name: str, default: int | None, low: int | None, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    # 5.0 is 5; but orjson reads an integer beyond 64 bits as a float, and above 2**53 a float is
    # no longer the integer that was sent (-2**63 - 1 would become -2**63 and pass the range check).
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2 ** 53:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequestError(f"'{name}' is {value}; it must be {_range(low, high)}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    """A sampling number within its row of shared.sampling.LIMITS."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"'{name}' must be a number", param=name)
    check(name, value)
    return float(value)


def _limited_int(body: dict, name: str, default: int | None) -> int | None:
    """An integer within its row of shared.sampling.LIMITS."""
    limit = LIMITS[name]
    return _int(body, name, default, limit.low, limit.high)


def _range(low: int | None, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    return f"between {low} and {high}"


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


def _messages(value: Any) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'messages' must be a non-empty array", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(value))


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
