"""OpenAI Responses request bodies → the chat request every API shares (gateway.requests).

`input` (a string, or items: messages, `function_call`, `function_call_output`) becomes chat
messages as /v1/chat/completions carries them: a function call joins an assistant message's
`tool_calls`, its output is a `tool` message. `instructions` is a system message before the
conversation; a stored conversation (`previous_response_id`) goes between the two, as it was
rendered the first time, so its tokens are the same prefix and the worker's prefix cache (RAM
or the LMDB store) finds them. Function `tools` (flat, as this API writes them), `tool_choice`
and `text.format` (→ `response_format`, the same grammar path) are translated; everything is
then checked by `parse_chat`. Images, files, audio and built-in tools are refused.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from gateway.requests import CompletionRequest, parse_chat, translated_tools
from shared.errors import InvalidRequestError

MAX_ID = 128  # longest response id accepted in a path or `previous_response_id`
MAX_LIST = 100  # most input items GET /v1/responses/{id}/input_items answers at once
MAX_METADATA = 16
INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_REFUSED_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}
LOGPROBS = "message.output_text.logprobs"
# `include` values for items this server never makes (built-in tools, images, reasoning): nothing to add
NOTHING_TO_INCLUDE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url",
                      "file_search_call.results", "message.input_image.image_url", "reasoning.encrypted_content",
                      "web_search_call.action.sources", "web_search_call.results")
INCLUDABLE = [LOGPROBS, *NOTHING_TO_INCLUDE]


@dataclass(frozen=True)
class ResponsesRequest:
    chat: CompletionRequest  # its `messages` are the input's only; the handler adds history and instructions
    instructions: str | None
    items: tuple[dict, ...]  # the input as items with ids, as GET .../input_items lists them
    messages: tuple[dict, ...]  # the input as chat messages
    previous_response_id: str | None
    store: bool
    echo: dict  # request fields the response object repeats
    logprobs: bool = False  # `include` asks for the output text's log-probabilities


def parse_responses(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    for name in ("background", "conversation", "prompt"):
        if body.get(name) not in (None, False):
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
    instructions = _optional_str(body, "instructions")
    previous = _optional_str(body, "previous_response_id")
    if previous is not None and not 0 < len(previous) <= MAX_ID:
        raise InvalidRequestError("'previous_response_id' is not a response id", param="previous_response_id")
    store = body.get("store")
    store = True if store is None else store  # the API's default
    if not isinstance(store, bool):
        raise InvalidRequestError("'store' must be a boolean", param="store")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise InvalidRequestError("'truncation' must be 'disabled': this server does not drop history",
                                  param="truncation")
    items, messages = _input(body.get("input"))
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": ""}]}  # checked here; replaced later
    for name in ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls"):
        chat[name] = body.get(name)
    chat["max_tokens"] = body.get("max_output_tokens")
    logprobs = check_include(body.get("include"))
    if logprobs or body.get("top_logprobs") is not None:
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs")
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object", param="text")
    chat["response_format"] = _format((text or {}).get("format"))
    try:
        request = parse_chat({k: v for k, v in chat.items() if v is not None}, max_n=1)
    except InvalidRequestError as exc:  # name this API's fields, not the chat fields they became
        param = (exc.param or "").replace("max_tokens", "max_output_tokens").replace(
            "response_format.json_schema", "text.format").replace("response_format", "text.format")
        message = exc.message.replace("'max_tokens'", "'max_output_tokens'").replace(
            "'response_format.json_schema", "'text.format").replace("'response_format", "'text.format")
        raise InvalidRequestError(message, param=param or None, code=exc.code) from None
    echo = {"instructions": instructions, "metadata": _metadata(body.get("metadata")),
            "max_output_tokens": chat["max_tokens"], "parallel_tool_calls": chat.get("parallel_tool_calls", True)
            is not False, "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "text": {"format": (text or {}).get("format") or {"type": "text"}}, "user": chat.get("user"),
            "store": store, "truncation": "disabled", "top_logprobs": request.top_logprobs}
    return ResponsesRequest(request, instructions, tuple(items), tuple(messages), previous, store, echo,
                            request.logprobs)


def check_include(value: Any) -> bool:
    """Check `include`; whether it asks for the output text's log-probabilities."""
    if value is None:
        return False
    known = INCLUDABLE
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequestError("'include' must be an array of strings", param="include")
    for i, name in enumerate(value):
        if name not in known:
            raise InvalidRequestError(f"'include[{i}]' is {name!r:.60}; this server knows {list(known)}",
                                      param=f"include[{i}]")
    return LOGPROBS in value


def _optional_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"'{name}' must be a string", param=name)
    return value


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise InvalidRequestError(f"'metadata' must be an object of at most {MAX_METADATA} string values "
                                  "(keys up to 64 characters, values up to 512)", param="metadata")
    return value


# ---- input -----------------------------------------------------------------------------------------

def _input(value: Any) -> tuple[list[dict], list[dict]]:
    """`input` → (items with ids, chat messages)."""
    if isinstance(value, str) and value:
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a non-empty string or a non-empty array of items", param="input")
    items: list[dict] = []
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message(item, where))
            text = "".join(part["text"] for part in items[-1]["content"])
            messages.append({"role": items[-1]["role"], "content": text})
        elif kind == "function_call":
            items.append(_function_call(item, where))
            call = {"id": items[-1]["call_id"], "type": "function",
                    "function": {"name": items[-1]["name"], "arguments": items[-1]["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # one turn's calls are one message
                messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            items.append(_function_output(item, where))
            messages.append({"role": "tool", "tool_call_id": items[-1]["call_id"], "content": items[-1]["output"]})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning is not part of the prompt
        else:
            raise InvalidRequestError(f"'{where}.type' is {kind!r:.40}; this server takes 'message', "
                                      "'function_call' and 'function_call_output' items", param=f"{where}.type")
    return items, messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise InvalidRequestError(f"'{where}.role' must be one of {list(INPUT_ROLES)}", param=f"{where}.role")
    part_type = "output_text" if role == "assistant" else "input_text"
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": part_type, "text": content}]
    elif isinstance(content, list):
        parts = [{"type": part_type, "text": _text_part(part, f"{where}.content[{i}]")}
                 for i, part in enumerate(content)]
    else:
        raise InvalidRequestError(f"'{where}.content' must be a string or an array of content parts",
                                  param=f"{where}.content")
    out = {"id": _item_id(item, "msg_"), "type": "message", "role": role, "content": parts, "status": "completed"}
    if role == "assistant":
        for part in parts:
            part["annotations"] = []
    return out


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _REFUSED_PARTS:
        raise InvalidRequestError(f"{_REFUSED_PARTS[kind]} are not supported: this server serves text-only models",
                                  param=f"{where}.type")
    text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS or not isinstance(text, str):
        raise InvalidRequestError(f"'{where}' must be a text part ({{\"type\": \"input_text\", \"text\": ...}})",
                                  param=where)
    return text


def _function_call(item: dict, where: str) -> dict:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise InvalidRequestError(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
    return {"id": _item_id(item, "fc_"), "type": "function_call", "call_id": item["call_id"], "name": item["name"],
            "arguments": item["arguments"], "status": "completed"}


def _function_output(item: dict, where: str) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise InvalidRequestError(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_text_part(part, f"{where}.output[{i}]") for i, part in enumerate(output))
    if not isinstance(output, str):
        raise InvalidRequestError(f"'{where}.output' must be a string or an array of text parts",
                                  param=f"{where}.output")
    return {"id": _item_id(item, "fco_"), "type": "function_call_output", "call_id": item["call_id"],
            "output": output, "status": "completed"}


def _item_id(item: dict, prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and 0 < len(given) <= MAX_ID else new_id(prefix)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# ---- tools and format --------------------------------------------------------------------------------

def _tools(value: Any) -> list:
    return translated_tools(value, _function)


def _function(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise InvalidRequestError(f"'{where}.type' is {tool.get('type')!r:.40}: only function tools are supported",
                                  param=f"{where}.type")
    return {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value  # auto | none | required, checked by parse_chat
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise InvalidRequestError("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                              "\"name\": ...}", param="tool_choice")


def _format(value: Any) -> dict | None:
    """`text.format` → `response_format`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("'text.format' must be an object with a 'type'", param="text.format")
    if value.get("type") != "json_schema":
        return value  # text | json_object (anything else is refused by parse_chat)
    spec = {key: value[key] for key in ("name", "schema", "strict") if key in value}
    return {"type": "json_schema", "json_schema": spec}
