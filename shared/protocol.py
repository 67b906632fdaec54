"""Messages between the gateway (ZeroMQ ROUTER) and its workers (DEALER).

A frame is one kind byte followed by the message's fields as an orjson object. Every message
is a frozen dataclass defined here and nowhere else; `decode` refuses unknown kinds and fields
so a gateway and a worker from different versions fail loudly at registration, not mid-stream.

Flow: the worker connects and sends Register, then a Heartbeat every `heartbeat_interval`
carrying its load and its prefix-cache counters (cumulative since it started);
the gateway answers a Heartbeat from a worker it does not know with Heartbeat(registered=False),
and the worker registers again (the gateway restarted, or had given up on it).
For each request: Generate → TokenChunk* → Finished | Error, exactly one of the last two.
A Generate with `warm` set only fills the prefix caches: the worker prefills the prompt, commits
its blocks to the host store, and answers Finished (with `prefix_tokens`), no tokens expected.
Abort may cross a Finished in flight; the worker answers an Abort it can act on with
Finished(finish_reason="abort"). Drain (worker → gateway) stops new work being routed to the
worker; Drain(done=True) says it is leaving now and that any request it still had is lost.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Union

import orjson

from shared.sampling import SamplingParams

PROTOCOL_VERSION = 2  # 2: Generate.warm, Finished.prefix_tokens, Heartbeat counters


class Kind(IntEnum):
    REGISTER = 1
    HEARTBEAT = 2
    GENERATE = 3
    TOKEN_CHUNK = 4
    FINISHED = 5
    ERROR = 6
    ABORT = 7
    DRAIN = 8


@dataclass(frozen=True)
class Register:
    """Worker → gateway, once the model is loaded and warm."""
    worker_id: str
    numa_node: int
    cpus: list[int]
    model_name: str  # the GGUF's general.name
    model_path: str
    arch: str
    n_ctx: int
    vocab_size: int
    capacity: int  # sequences the worker runs at once
    host: str
    pid: int
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Heartbeat:
    """Both ways. From a worker: its load and counters. From the gateway: whether it knows the worker.

    The prefix-cache counters are cumulative since the worker process started (the gateway turns
    them into Prometheus increments); `store_bytes` and the `kv_blocks*` fields are levels. The gateway's own Heartbeats leave
    them at 0.
    """
    worker_id: str
    active: int = 0
    queued: int = 0
    registered: bool = True
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens_ram: int = 0  # of those, found in this worker's RAM cache
    prefix_hit_tokens_store: int = 0  # of those, found in the host store
    prefix_restores: int = 0  # requests that chose to restore blocks from the store
    prefix_recomputes: int = 0  # requests that chose to recompute although the store had the blocks
    store_bytes: int = 0  # the host store's size now (one store per host, shared by its workers)
    store_evictions: int = 0
    store_writes: int = 0
    kv_blocks: int = 0  # the worker's KV pool now: all blocks,
    kv_blocks_used: int = 0  # those some request holds,
    kv_blocks_cached: int = 0  # and those free that still hold a reusable prefix


# The Heartbeat fields a worker's counters fill (worker.pulse); the rest are load and control.
HEARTBEAT_COUNTERS = ("prefix_query_tokens", "prefix_hit_tokens_ram", "prefix_hit_tokens_store", "prefix_restores",
                      "prefix_recomputes", "store_bytes", "store_evictions", "store_writes",
                      "kv_blocks", "kv_blocks_used", "kv_blocks_cached")


@dataclass(frozen=True)
class Generate:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    warm: bool = False  # prefill only: fill the prefix caches (RAM and host store), flush the store writes, finish


@dataclass(frozen=True)
class TokenChunk:
    """Tokens generated since the last chunk; `top_logprobs[i]` lists [token, logprob] pairs."""
    request_id: str
    tokens: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: str  # stop | length | abort
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V were reused from the prefix cache
    prefix_tokens: int = 0  # prompt tokens whose K/V the prefix cache now holds (full blocks)


@dataclass(frozen=True)
class Error:
    """A request failed (`request_id` set) or the worker is failing (`request_id` "" and fatal)."""
    request_id: str
    error: str  # class name in shared.errors, e.g. ContextLengthError
    message: str
    param: str | None = None
    code: str | None = None
    fatal: bool = False


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Drain:
    worker_id: str
    done: bool = False  # False: finishing in-flight work; True: leaving now


Message = Union[Register, Heartbeat, Generate, TokenChunk, Finished, Error, Abort, Drain]

_KIND_OF: dict[type, Kind] = {
    Register: Kind.REGISTER, Heartbeat: Kind.HEARTBEAT, Generate: Kind.GENERATE,
    TokenChunk: Kind.TOKEN_CHUNK, Finished: Kind.FINISHED, Error: Kind.ERROR,
    Abort: Kind.ABORT, Drain: Kind.DRAIN,
}
_CLASS_OF: dict[int, type] = {int(kind): cls for cls, kind in _KIND_OF.items()}
_FIELDS: dict[type, frozenset[str]] = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _KIND_OF}
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol version."""


def encode(message: Message) -> bytes:
    # orjson serialises dataclasses natively (nested SamplingParams included); int dict keys
    # (logit_bias) need OPT_NON_STR_KEYS and come back as strings, which `_params` undoes.
    body = orjson.dumps(message, option=orjson.OPT_NON_STR_KEYS)
    return bytes((_KIND_OF[type(message)],)) + body


def decode(frame: bytes) -> Message:
    if not frame:
        raise ProtocolError("empty frame")
    cls = _CLASS_OF.get(frame[0])
    if cls is None:
        raise ProtocolError(f"unknown message kind {frame[0]}")
    try:
        data = orjson.loads(frame[1:])
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{cls.__name__}: bad body: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.__name__}: body is not an object")
    unknown = data.keys() - _FIELDS[cls]
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    if cls is Generate and "params" in data:
        data["params"] = _params(data["params"])
    try:
        return cls(**data)
    except TypeError as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


def _params(data: object) -> SamplingParams:
    if not isinstance(data, dict) or data.keys() - _PARAM_FIELDS:
        raise ProtocolError("Generate: bad params")
    data = dict(data)
    data["logit_bias"] = {int(k): float(v) for k, v in (data.get("logit_bias") or {}).items()}
    data["stop_token_ids"] = tuple(data.get("stop_token_ids") or ())
    return SamplingParams(**data)
