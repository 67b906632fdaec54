"""OpenAI response shapes: completion objects, stream chunks, usage and logprobs.

Pure functions from already-computed values to dicts; the routes decide what to send when.
"""
from __future__ import annotations

import secrets
from typing import Callable, Sequence

from gateway.choice import Choice, TokenEntry

TokenText = Callable[[int], bytes]  # token id → its bytes (the tokenizer's token_bytes)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(chat: bool, rid: str, created: int, model: str, choices: Sequence[Choice],
               use: dict, token_bytes: TokenText, logprobs: bool, top: int) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": None,
            "choices": [_final_choice(chat, c, token_bytes, logprobs, top) for c in choices],
            "usage": use}


def _final_choice(chat: bool, choice: Choice, token_bytes: TokenText, logprobs: bool, top: int) -> dict:
    lp = _logprobs(chat, choice.entries, token_bytes, top) if logprobs else None
    if chat:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": lp, "finish_reason": choice.finish_reason}
    return {"index": choice.index, "text": choice.text, "logprobs": lp, "finish_reason": choice.finish_reason}


def chunk(chat: bool, rid: str, created: int, model: str, choices: list[dict], use: dict | None = None,
          with_usage: bool = False) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": None, "choices": choices}
    if with_usage:  # OpenAI sends "usage": null on every chunk but the last when usage is asked for
        body["usage"] = use
    return body


def role_delta(index: int) -> dict:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def delta_choice(chat: bool, index: int, text: str, entries: Sequence[TokenEntry], finish_reason: str | None,
                 token_bytes: TokenText, logprobs: bool, top: int) -> dict:
    lp = _logprobs(chat, entries, token_bytes, top) if logprobs else None
    if chat:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}


def _logprobs(chat: bool, entries: Sequence[TokenEntry], token_bytes: TokenText, top: int) -> dict:
    if chat:
        return {"content": token_logprobs(entries, token_bytes, top), "refusal": None}
    return {"tokens": [_text(token_bytes(e.token)) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(token_bytes(t)): lp for t, lp in e.top[:top]} if top else None
                             for e in entries],
            "text_offset": [e.offset for e in entries]}


def token_logprobs(entries: Sequence[TokenEntry], token_bytes: TokenText, top: int) -> list[dict]:
    """Entries as chat's `logprobs.content` lists them (the Responses API's output_text logprobs too)."""
    return [_chat_entry(e, token_bytes, top) for e in entries]


def _chat_entry(entry: TokenEntry, token_bytes: TokenText, top: int) -> dict:
    raw = token_bytes(entry.token)
    return {"token": _text(raw), "logprob": entry.logprob, "bytes": list(raw),
            "top_logprobs": [{"token": _text(token_bytes(t)), "logprob": lp, "bytes": list(token_bytes(t))}
                             for t, lp in entry.top[:top]]}


def _text(raw: bytes) -> str:
    # A token can hold part of a UTF-8 character; `bytes` carries the exact value.
    return raw.decode("utf-8", errors="replace")
