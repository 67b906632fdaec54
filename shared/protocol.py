"""Messages between the gateway (ZeroMQ ROUTER) and its workers (DEALER).

A frame is one kind byte followed by the message's fields as an orjson object. Every message
is a frozen dataclass defined here and nowhere else; `decode` refuses unknown kinds and fields
so a gateway and a worker from different versions fail loudly at registration, not mid-stream.
It also checks every field against its declared type and range (`Annotated[int, Range(..)]`), so a
peer on the endpoint cannot plant a value (`"capacity": "x"`) that breaks later code: a frame that
does not match is refused whole, never half-used.

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
Tuning: every `[tuning] profile_interval` a worker's pulse thread sends a Profile of the window
since the last one; the tuning coordinator answers, when it decides a change, with a Strategy
(versioned scheduler knobs) that the worker's loop applies between two steps.

A standalone coordinator (`reame-coordinator`, for several gateways) speaks to each gateway on
its own socket (the gateway a DEALER, the coordinator a ROUTER): the gateway sends Attach every
`heartbeat_interval` and the coordinator answers Attached (`fresh`: it has not seen this gateway
since it started, so the gateway forwards a Register for each of its workers again). The gateway
forwards its workers' Register and Profile frames unchanged; the coordinator answers with
Advice (a Strategy for one worker, which the gateway relays). The operator's /admin calls travel
as AdminCall → AdminReply. The workers never talk to the coordinator: they keep the knobs they
run when it is gone.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Annotated, Any, Callable, Literal, NamedTuple, Union, get_args, get_origin, get_type_hints

import orjson

from shared.errors import ConfigError
from shared.knobs import Knobs
from shared.sampling import SamplingParams

# gateway ↔ standalone coordinator (Attach, Attached, Advice, AdminCall, AdminReply); 2: Advice's
# Strategy carries its knobs whole (Strategy.knobs)
COORDINATOR_PROTOCOL_VERSION = 2
# 2: Generate.warm, Finished.prefix_tokens, Heartbeat counters; 3: params.grammar; 4: Profile, Strategy;
# 5: Generate.speculative, spec_* counters; 6: CPU placement (Strategy.cpus, bind_memory; Profile.cpus_in_use,
# cpu_others_each, numa_nodes, memory_bound); 7: Heartbeat.read_request, read_ms (liveness from the data path);
# 8: Strategy.knobs (shared.knobs.Knobs) instead of one field per knob, and no Strategy.threads (the
# worker's kernel tuner decides the thread count)
PROTOCOL_VERSION = 8


class Range(NamedTuple):
    """The inclusive bounds of an int field, checked by `decode`."""
    low: int
    high: int


Count = Annotated[int, Range(0, 2 ** 63 - 1)]  # sizes, counters, token ids (the worker checks them against its vocabulary)
Positive = Annotated[int, Range(1, 2 ** 63 - 1)]
ProcessId = Annotated[int, Range(0, 2 ** 31 - 1)]  # pid_t; 0 for a worker whose process is not checked


class Kind(IntEnum):
    REGISTER = 1
    HEARTBEAT = 2
    GENERATE = 3
    TOKEN_CHUNK = 4
    FINISHED = 5
    ERROR = 6
    ABORT = 7
    DRAIN = 8
    PROFILE = 9
    STRATEGY = 10
    ATTACH = 11
    ATTACHED = 12
    ADVICE = 13
    ADMIN_CALL = 14
    ADMIN_REPLY = 15


@dataclass(frozen=True)
class Register:
    """Worker → gateway, once the model is loaded and warm."""
    worker_id: str
    numa_node: Count
    cpus: list[Count]
    model_name: str  # the GGUF's general.name
    model_path: str
    arch: str  # general.architecture
    n_ctx: Positive
    vocab_size: Positive
    capacity: Positive  # sequences the worker runs at once
    host: str
    pid: ProcessId
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Heartbeat:
    """Both ways. From a worker: its load and counters. From the gateway: whether it knows the worker.

    The prefix-cache counters are cumulative since the worker process started (the gateway turns
    them into Prometheus increments); `store_bytes` and the `kv_blocks*` and `kv_bytes*` fields are
    levels. The gateway's own Heartbeats leave them at 0.
    """
    worker_id: str
    active: Count = 0
    queued: Count = 0
    registered: bool = True
    # The data path, as the serve loop last saw it: the id of the last Generate it read, and how
    # long ago (ms) it last finished reading its socket. The gateway checks that what it sent was
    # read, so a worker whose jobs go elsewhere (or nowhere) is dropped although its pulse beats.
    read_request: str = ""
    read_ms: Count = 0
    prefix_query_tokens: Count = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens_ram: Count = 0  # of those, found in this worker's RAM cache
    prefix_hit_tokens_store: Count = 0  # of those, found in the host store
    prefix_restores: Count = 0  # requests that chose to restore blocks from the store
    prefix_recomputes: Count = 0  # requests that chose to recompute although the store had the blocks
    store_bytes: Count = 0  # the host store's size now (one store per host, shared by its workers)
    store_evictions: Count = 0
    store_writes: Count = 0
    kv_blocks: Count = 0  # the worker's KV pool now: all blocks,
    kv_blocks_used: Count = 0  # those some request holds,
    kv_blocks_cached: Count = 0  # and those free that still hold a reusable prefix
    kv_bytes: Count = 0  # the KV pool's bytes, all of it (main pool and window slots)
    kv_bytes_used: Count = 0  # of those, the bytes of blocks (and window slots) some request holds
    spec_drafts: Count = 0  # speculative drafts verified
    spec_drafted_tokens: Count = 0  # tokens in them
    spec_accepted_tokens: Count = 0  # of those, accepted (emitted without a step of their own)
    spec_switched_off: Count = 0  # times a sequence's speculation switched off (acceptance below break-even)


# The Heartbeat fields a worker's counters fill (worker.pulse); the rest are load and control.
HEARTBEAT_COUNTERS = ("prefix_query_tokens", "prefix_hit_tokens_ram", "prefix_hit_tokens_store", "prefix_restores",
                      "prefix_recomputes", "store_bytes", "store_evictions", "store_writes",
                      "kv_blocks", "kv_blocks_used", "kv_blocks_cached", "kv_bytes", "kv_bytes_used",
                      "spec_drafts", "spec_drafted_tokens", "spec_accepted_tokens", "spec_switched_off")


@dataclass(frozen=True)
class Generate:
    request_id: str
    prompt_ids: list[Count]
    params: SamplingParams
    warm: bool = False  # prefill only: fill the prefix caches (RAM and host store), flush the store writes, finish
    cache_namespace: str = ""  # hex: the prefix blocks it may reuse (shared.hashing.namespace_root); "" = shared
    speculative: bool = True  # False: the worker never drafts tokens for it (the request's "speculative")


@dataclass(frozen=True)
class TokenChunk:
    """Tokens generated since the last chunk; `top_logprobs[i]` lists [token, logprob] pairs."""
    request_id: str
    tokens: list[Count]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: Literal["stop", "length", "abort"]
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_tokens: Count = 0  # prompt tokens whose K/V were reused from the prefix cache
    prefix_tokens: Count = 0  # prompt tokens whose K/V the prefix cache now holds (full blocks)


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


@dataclass(frozen=True)
class Profile:
    """Worker → gateway: its traffic and its steps over the last `seconds` (rates, distributions
    and counts are of that window; `prefix_*` and `kv_*` come from the worker's counters).
    Percentiles are 0 when the window saw nothing to measure."""
    worker_id: str
    seconds: float  # the window's length
    knobs_version: Count  # the Strategy version in force at the window's end (0: the defaults)
    arrivals: Count = 0  # requests accepted
    finished: Count = 0
    prompt_tokens_p50: float = 0.0
    prompt_tokens_p95: float = 0.0
    output_tokens_p50: float = 0.0  # generated tokens of the requests that finished
    output_tokens_p95: float = 0.0
    burstiness: float = 0.0  # coefficient of variation of the gaps between arrivals (1: Poisson)
    queue_wait_ms_p50: float = 0.0  # arrival → first scheduled step
    queue_wait_ms_p95: float = 0.0
    ttft_ms_p95: float = 0.0  # arrival → first token, inside the worker
    latency_ms_p95: float = 0.0  # arrival → finish
    token_gap_ms_p95: float = 0.0  # between two tokens of one request (0: no request had two)
    token_gap_ms_mean: float = 0.0
    steps: Count = 0
    busy_seconds: float = 0.0  # wall time spent in steps
    batch_size_mean: float = 0.0  # sequences per step
    prefill_tokens: Count = 0  # prompt tokens fed
    output_tokens: Count = 0  # tokens generated
    step_ms_prefill: float = 0.0  # mean engine time of steps that feed prompt chunks
    step_ms_decode: float = 0.0  # mean engine time of decode-only steps
    step_ms_overhead: float = 0.0  # mean time per step outside the engine (scheduling, sampling)
    decoders_waiting_on_prefill: float = 0.0  # mean decode rows in steps that also prefill
    waiting_mean: float = 0.0  # requests queued in the worker, sampled each step
    preemptions: Count = 0
    kv_blocks: Count = 0
    kv_blocks_used_max: Count = 0
    kv_block_tokens: Count = 0
    prefix_query_tokens: Count = 0
    prefix_hit_tokens: Count = 0  # RAM and store together
    prefix_hit_tokens_store: Count = 0
    store_evictions: Count = 0
    cpus: list[Count] = field(default_factory=list)  # the CPUs the worker may run on (its slot: fixed at start)
    cpu_busy: float = 0.0  # share of those CPUs' time this worker used
    cpu_others: float = 0.0  # share used by other processes (neighbours)
    cpu_steal: float = 0.0  # share taken by the hypervisor
    threads: Count = 0  # threads of the engine's parallel kernels now
    cpus_in_use: list[Count] = field(default_factory=list)  # of `cpus`, those its threads run on now ([]: all)
    cpu_others_each: list[float] = field(default_factory=list)  # per CPU of `cpus`: share other processes used
    numa_nodes: Count = 1  # NUMA nodes of the worker's host
    memory_bound: bool = False  # its memory is bound to its node
    sources: dict[str, dict[str, float | str]] = field(default_factory=dict)  # kernels, speculation, ...


@dataclass(frozen=True)
class Strategy:
    """Gateway (tuning coordinator) → worker: the scheduler knobs and placement from the next step on.

    A version not newer than the one in force is ignored, so late or repeated ones are harmless."""
    version: Positive
    reason: str
    knobs: Knobs  # declared, with their bounds, in shared.knobs
    frozen: bool = False  # an operator froze the strategy: whatever else learns (kernels) stops too


@dataclass(frozen=True)
class Attach:
    """Gateway → standalone coordinator, every heartbeat_interval: "I am here"."""
    gateway_id: str
    version: int = COORDINATOR_PROTOCOL_VERSION


@dataclass(frozen=True)
class Attached:
    """Coordinator → gateway, the answer to each Attach."""
    fresh: bool  # the coordinator did not know this gateway: forward your workers' Register again
    version: int = COORDINATOR_PROTOCOL_VERSION


@dataclass(frozen=True)
class Advice:
    """Coordinator → gateway: relay this Strategy to one of your workers."""
    worker_id: str
    strategy: Strategy


AdminAction = Literal["strategy", "import", "freeze", "unfreeze", "report", "series"]


@dataclass(frozen=True)
class AdminCall:
    """Gateway → coordinator: one operator call (/admin/...); `argument` is JSON (the imported
    strategy, the series' bucket seconds) or ""."""
    call_id: str
    action: AdminAction
    argument: str = ""


@dataclass(frozen=True)
class AdminReply:
    """Coordinator → gateway: the JSON answer, or the shared.errors class and message of a refusal."""
    call_id: str
    body: str = ""
    error: str = ""
    message: str = ""


Message = Union[Register, Heartbeat, Generate, TokenChunk, Finished, Error, Abort, Drain, Profile, Strategy,
                Attach, Attached, Advice, AdminCall, AdminReply]

_KIND_OF: dict[type, Kind] = {
    Register: Kind.REGISTER, Heartbeat: Kind.HEARTBEAT, Generate: Kind.GENERATE,
    TokenChunk: Kind.TOKEN_CHUNK, Finished: Kind.FINISHED, Error: Kind.ERROR,
    Abort: Kind.ABORT, Drain: Kind.DRAIN, Profile: Kind.PROFILE, Strategy: Kind.STRATEGY,
    Attach: Kind.ATTACH, Attached: Kind.ATTACHED, Advice: Kind.ADVICE, AdminCall: Kind.ADMIN_CALL,
    AdminReply: Kind.ADMIN_REPLY,
}
_CLASS_OF: dict[int, type] = {int(kind): cls for cls, kind in _KIND_OF.items()}


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol version."""


def encode(message: Message) -> bytes:
    # orjson serialises dataclasses natively (nested SamplingParams included); int dict keys
    # (logit_bias) need OPT_NON_STR_KEYS and come back as strings, which the key decoder undoes.
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
    try:
        return _DECODERS[cls](data)
    except _Invalid as exc:
        raise ProtocolError(f"{cls.__name__}{exc.where}: {exc.problem}") from None


# ---- the decoder: one per field type, built once from the dataclasses' annotations ----------

class _Invalid(Exception):
    """A value that does not match its declared type; `where` grows as it climbs out (.params.seed)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem
        self.where = ""

    def within(self, step: str) -> _Invalid:
        self.where = step + self.where
        return self


_INT_KEY = re.compile(r"-?[0-9]{1,19}")  # JSON object keys are strings; bounded, so int() stays cheap


def _scalar(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        # bool is an int in Python but not in the protocol; an int is a valid float (kept as is).
        if isinstance(value, bool) and kind is not bool:
            raise _Invalid(f"expected {kind.__name__}, got {value!r}")
        if kind is float and isinstance(value, (int, float)):
            if not math.isfinite(value):
                raise _Invalid(f"expected a finite number, got {value!r}")
            return value
        if not isinstance(value, kind):
            raise _Invalid(f"expected {kind.__name__}, got {type(value).__name__}")
        return value
    return check


def _decoder(hint: Any) -> Callable[[Any], Any]:
    """A function that checks (and, for tuples and dataclasses, builds) a value of type `hint`."""
    origin, args = get_origin(hint), get_args(hint)
    if hint in (int, float, str, bool):
        return _scalar(hint)
    if hint is type(None):
        return _scalar(type(None))
    if origin is Annotated:
        inner = _decoder(args[0])
        bounds = [a for a in args[1:] if isinstance(a, Range)]

        def in_range(value: Any) -> Any:
            value = inner(value)
            for low, high in bounds:
                if not low <= value <= high:
                    raise _Invalid(f"{value} is outside {low}..{high}")
            return value
        return in_range
    if origin is Literal:
        def one_of(value: Any) -> Any:
            if not any(type(value) is type(a) and value == a for a in args):
                raise _Invalid(f"expected one of {list(args)}, got {value!r:.40}")
            return value
        return one_of
    if origin in (Union, types.UnionType):
        nullable = type(None) in args
        options = [_decoder(a) for a in args if a is not type(None)]

        def either(value: Any) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value)
                except _Invalid:
                    pass
            raise _Invalid(f"expected {hint}, got {value!r:.40}")
        return either
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = _decoder(args[0])
        build = list if origin is list else tuple
        # Token ids are most of the traffic: a list of in-range ints is checked without a call per item.
        int_bounds = _int_bounds(args[0])

        def sequence(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Invalid(f"expected a list, got {type(value).__name__}")
            if int_bounds is not None and all(type(v) is int for v in value) and (
                    not value or int_bounds[0] <= min(value) and max(value) <= int_bounds[1]):
                return value if build is list else tuple(value)
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(item(v))
                except _Invalid as exc:
                    raise exc.within(f"[{i}]") from None
            return build(out)
        return sequence
    if origin is dict:
        key, val = _key_decoder(args[0]), _decoder(args[1])

        def mapping(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _Invalid(f"expected an object, got {type(value).__name__}")
            out = {}
            for k, v in value.items():
                try:
                    out[key(k)] = val(v)
                except _Invalid as exc:
                    raise exc.within(f"[{k!r:.40}]") from None
            return out
        return mapping
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    raise TypeError(f"protocol: no decoder for the field type {hint!r}")  # a message defined here is wrong


def _int_bounds(hint: Any) -> tuple[int, int] | None:
    """(low, high) when hint is int or a ranged int; None for any other type."""
    if hint is int:
        return -2 ** 63, 2 ** 64 - 1  # what orjson parses as an int
    args = get_args(hint)
    if get_origin(hint) is Annotated and args[0] is int:
        ranges = [a for a in args[1:] if isinstance(a, Range)]
        return (max(r.low for r in ranges), min(r.high for r in ranges)) if ranges else _int_bounds(int)
    return None


def _key_decoder(hint: Any) -> Callable[[Any], Any]:
    """Object keys arrive as strings; an int key is parsed from its decimal digits, then checked."""
    check = _decoder(hint)
    if hint is not int and get_args(hint)[:1] != (int,):
        return check

    def int_key(text: Any) -> Any:
        if not isinstance(text, str) or not _INT_KEY.fullmatch(text):
            raise _Invalid(f"expected an integer key, got {text!r:.40}")
        return check(int(text))
    return int_key


def _dataclass_decoder(cls: type) -> Callable[[Any], Any]:
    hints = get_type_hints(cls, include_extras=True)
    fields = [(f.name, _decoder(hints[f.name]),
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(cls)]
    names = frozenset(name for name, _, _ in fields)

    def build(data: Any) -> Any:
        if not isinstance(data, dict):
            raise _Invalid("body is not an object")
        unknown = data.keys() - names
        if unknown:
            raise _Invalid(f"unknown fields {sorted(unknown)}")
        values = {}
        for name, check, required in fields:
            if name in data:
                try:
                    values[name] = check(data[name])
                except _Invalid as exc:
                    raise exc.within(f".{name}") from None
            elif required:
                raise _Invalid(f"missing field {name}")
        try:
            return cls(**values)
        except ConfigError as exc:  # a dataclass that checks its own bounds (shared.knobs)
            raise _Invalid(exc.message) from None
    return build


_DECODERS: dict[type, Callable[[Any], Any]] = {cls: _dataclass_decoder(cls) for cls in _KIND_OF}
