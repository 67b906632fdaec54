"""Anthropic Messages request bodies → the chat request every API shares (gateway.requests).

A body is checked for what only Anthropic's API has (`max_tokens` required, `system` as a
string or text blocks, content blocks, `stop_sequences`, `metadata`, Anthropic's tool and
tool_choice shapes, `output_config.format`) and then written as a /v1/chat/completions body, which `parse_chat` checks
as it checks any other: the sampling limits, stop strings, tools and messages are the same code.
Blocks become chat messages as OpenAI's API would carry them: `tool_use` blocks an assistant's
`tool_calls`, `tool_result` blocks `tool` messages. Images and documents are refused (the
models served are text-only), as are server tools and extended thinking.
"""
from __future__ import annotations

import json
import re
from typing import Any

from gateway.requests import CompletionRequest, message_list, parse_chat, translated_tools
from shared.errors import InvalidRequestError

ROLES = ("user", "assistant")
_UNSUPPORTED = {"image": "image blocks", "document": "document blocks", "search_result": "search results",
                "container_upload": "container uploads"}


def parse_messages(body: Any, *, max_n: int, count_only: bool = False) -> CompletionRequest:
    """POST /v1/messages (and, with `count_only`, /v1/messages/count_tokens, where max_tokens,
    sampling and streaming do not apply) → a chat CompletionRequest."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    chat: dict[str, Any] = {"model": body.get("model")}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise InvalidRequestError("'max_tokens' is required", param="max_tokens")
        chat["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "stream"):
            chat[name] = body.get(name)
        chat["stop"] = _stop_sequences(body.get("stop_sequences"))
        chat["user"] = _user(body.get("metadata"))
    _check_thinking(body.get("thinking"))
    system = _system(body.get("system"))
    messages = _messages(body.get("messages"))
    chat["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body["tool_choice"])
    if not count_only:
        chat["response_format"] = _output_format(body.get("output_config"))
    try:
        return parse_chat({k: v for k, v in chat.items() if v is not None}, max_n=max_n)
    except InvalidRequestError as exc:  # name this API's fields, not the chat fields they became
        param, message = exc.param or "", exc.message
        for chat_name, name in (("stop", "stop_sequences"), ("response_format.json_schema.schema",
                                                             "output_config.format.schema")):
            if param == chat_name or param.startswith(chat_name + "."):
                param = name + param[len(chat_name):]
                message = re.sub(f"'{re.escape(chat_name)}(?=['.])", f"'{name}", message)
        raise InvalidRequestError(message, param=param or None, code=exc.code) from None


def _stop_sequences(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError("'stop_sequences' must be an array of strings", param="stop_sequences")
    return value


def _user(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequestError("'metadata' must be an object", param="metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise InvalidRequestError("'metadata.user_id' must be a string", param="metadata.user_id")
    return user


def _output_format(config: Any) -> dict | None:
    """`output_config.format` (JSON schema output) → `response_format`, the same grammar path.
    `effort` has no meaning for these models and is ignored."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise InvalidRequestError("'output_config' must be an object", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                                  param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _check_thinking(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled"):
        raise InvalidRequestError("'thinking' must be {\"type\": \"enabled\" | \"disabled\", ...}", param="thinking")
    if value["type"] == "enabled":
        raise InvalidRequestError("extended thinking is not supported by this server", param="thinking")


def _system(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text_block(block, f"system[{i}]") for i, block in enumerate(value))
    raise InvalidRequestError("'system' must be a string or an array of text blocks", param="system")


def _messages(value: Any) -> list[dict]:
    out: list[dict] = []
    for i, message in enumerate(message_list(value)):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"'{where}' must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"'{where}.role' must be 'user' or 'assistant'", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(role, content, f"{where}.content")
        else:
            raise InvalidRequestError(f"'{where}.content' must be a string or an array of content blocks",
                                      param=f"{where}.content")
    return out


def _blocks(role: str, blocks: list, where: str) -> list[dict]:
    """One message's blocks → chat messages, in order: an assistant's text and tool_use blocks one
    assistant message; a user's tool_result blocks `tool` messages and its text a user message."""
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_text_block(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's reasoning is not part of the prompt
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            out.append(_tool_result(block, at))
        else:
            raise InvalidRequestError(_block_error(kind, role), param=f"{at}.type")
    if role == "assistant":
        message: dict = {"role": "assistant", "content": "\n".join(text)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _block_error(kind: Any, role: str) -> str:
    if kind in _UNSUPPORTED:
        return f"{_UNSUPPORTED[kind]} are not supported: this server serves text-only models"
    if kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
        return f"a '{kind}' block cannot be in a '{role}' message"
    return f"unknown content block type {kind!r:.40}; this server takes 'text', 'tool_use' and 'tool_result'"


def _text_block(block: Any, where: str) -> str:
    if isinstance(block, dict) and block.get("type") in _UNSUPPORTED:
        raise InvalidRequestError(_block_error(block["type"], "user"), param=f"{where}.type")
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"'{where}' must be a text block ({{\"type\": \"text\", \"text\": ...}})",
                                  param=where)
    return block["text"]


def _tool_use(block: dict, where: str) -> dict:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidRequestError(f"'{where}' needs string 'id' and 'name'", param=where)
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"'{where}.input' must be an object", param=f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"'{where}.tool_use_id' must be a string", param=f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{where}.content[{i}]") for i, b in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequestError(f"'{where}.content' must be a string or an array of text blocks",
                                  param=f"{where}.content")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tools(value: Any) -> list:
    return translated_tools(value, _function)


def _function(tool: dict, where: str) -> dict:
    if tool.get("type", "custom") != "custom":
        raise InvalidRequestError(f"'{where}.type' is {tool['type']!r:.60}: server tools are not supported, "
                                  "only custom tools with an 'input_schema'", param=f"{where}.type")
    if not isinstance(tool.get("input_schema"), dict):
        raise InvalidRequestError(f"'{where}.input_schema' must be a JSON Schema object", param=f"{where}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return function


def _tool_choice(value: Any) -> tuple[Any, bool]:
    """Anthropic's tool_choice → OpenAI's tool_choice and parallel_tool_calls."""
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise InvalidRequestError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                                  param="tool_choice")
    serial = value.get("disable_parallel_tool_use", False)
    if not isinstance(serial, bool):
        raise InvalidRequestError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                                  param="tool_choice.disable_parallel_tool_use")
    kind = value["type"]
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise InvalidRequestError("'tool_choice.name' must name a tool", param="tool_choice.name")
        return {"type": "function", "function": {"name": value["name"]}}, not serial
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not serial
