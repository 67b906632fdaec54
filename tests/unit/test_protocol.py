"""Every message survives encode → decode unchanged; bad frames are refused, not guessed at:
every field is checked against its declared type and range, nested ones included."""
from __future__ import annotations

import dataclasses

import orjson
import pytest

from shared import protocol
from shared.protocol import (
    Abort,
    Drain,
    Error,
    Finished,
    Generate,
    Heartbeat,
    Kind,
    ProtocolError,
    Register,
    TokenChunk,
    decode,
    encode,
)
from shared.sampling import SamplingParams

MESSAGES = [
    Register("host/node0/12", 0, [0, 1, 2], "SmolLM2", "/m/a.gguf", "llama", 8192, 49152, 1, "host", 12),
    Heartbeat("host/node0/12", active=1, queued=3),
    Heartbeat("w", registered=False),
    Heartbeat("w", prefix_query_tokens=96, prefix_hit_tokens_ram=32, prefix_hit_tokens_store=16, prefix_restores=1,
              prefix_recomputes=2, store_bytes=1 << 40, store_evictions=3, store_writes=4),
    Heartbeat("w", kv_blocks=4096, kv_blocks_used=100, kv_blocks_cached=7),
    Generate("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, logit_bias={7: -100.0, 9: 2.5},
                                              seed=42, stop_token_ids=(2, 0), logprobs=3)),
    Generate("r2", [5], SamplingParams()),
    Generate("r3", [5, 6], SamplingParams(max_tokens=1, temperature=0.0), warm=True),
    TokenChunk("r1", [17], [-0.25], [[[17, -0.25], [3, -1.5]]]),
    TokenChunk("r1", [17, 18], [None, None], [[], []]),
    Finished("r1", "length", 3, 5, 0),
    Finished("r3", "length", 40, 0, cached_tokens=16, prefix_tokens=32),
    Error("r1", "ContextLengthError", "too long", "max_tokens", "context_length_exceeded"),
    Error("", "ReameError", "out of memory", fatal=True),
    Abort("r1"),
    Drain("w"),
    Drain("w", done=True),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(encode(message)) == message


def test_kind_byte_leads_the_frame():
    assert encode(Abort("x"))[0] == Kind.ABORT
    assert encode(MESSAGES[0])[0] == Kind.REGISTER


def test_sampling_params_keep_their_types():
    r1 = next(m for m in MESSAGES if isinstance(m, Generate) and m.request_id == "r1")
    params = decode(encode(r1)).params
    assert params.logit_bias == {7: -100.0, 9: 2.5}
    assert isinstance(params.stop_token_ids, tuple)


@pytest.mark.parametrize("frame", [
    b"",
    bytes([99]) + b"{}",
    bytes([Kind.ABORT]) + b"not json",
    bytes([Kind.ABORT]) + b"[1]",
    bytes([Kind.ABORT]) + orjson.dumps({"request_id": "x", "extra": 1}),
    bytes([Kind.ABORT]) + b"{}",
    bytes([Kind.GENERATE]) + orjson.dumps({"request_id": "x", "prompt_ids": [1], "params": {"nope": 1}}),
])
def test_bad_frames_are_refused(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_every_kind_has_one_class():
    assert sorted(protocol._CLASS_OF) == sorted(int(k) for k in Kind)


def test_heartbeat_counters_are_its_int_fields_beyond_load():
    fields = {f.name: f for f in dataclasses.fields(Heartbeat)}
    assert set(protocol.HEARTBEAT_COUNTERS) == fields.keys() - {"worker_id", "active", "queued", "registered",
                                                                "read_request", "read_ms"}
    assert all(fields[name].type == "Count" and fields[name].default == 0 for name in protocol.HEARTBEAT_COUNTERS)


REGISTER = orjson.loads(encode(MESSAGES[0])[1:])


def frame_of(kind: Kind, body: dict) -> bytes:
    return bytes([kind]) + orjson.dumps(body)


@pytest.mark.parametrize("field, value", [
    ("capacity", "x"), ("capacity", 0), ("capacity", 2.0), ("capacity", True), ("capacity", None),
    ("pid", "12"), ("pid", -1), ("pid", 2 ** 40), ("n_ctx", -5), ("vocab_size", 0),
    ("cpus", [0, "1"]), ("cpus", "0-3"), ("numa_node", -1), ("worker_id", 7), ("version", "2"),
])
def test_a_register_with_a_field_of_the_wrong_type_or_range_is_refused(field, value):
    with pytest.raises(ProtocolError, match=f"Register.{field}"):
        decode(frame_of(Kind.REGISTER, {**REGISTER, field: value}))


def test_a_register_missing_a_field_is_refused():
    body = dict(REGISTER)
    del body["capacity"]
    with pytest.raises(ProtocolError, match="missing field capacity"):
        decode(frame_of(Kind.REGISTER, body))


@pytest.mark.parametrize("kind, body", [
    (Kind.HEARTBEAT, {"worker_id": "w", "active": "1"}),
    (Kind.HEARTBEAT, {"worker_id": "w", "store_bytes": -1}),
    (Kind.HEARTBEAT, {"worker_id": "w", "registered": 0}),
    (Kind.TOKEN_CHUNK, {"request_id": "r", "tokens": [1.5]}),
    (Kind.TOKEN_CHUNK, {"request_id": "r", "tokens": [1], "logprobs": ["x"]}),
    (Kind.TOKEN_CHUNK, {"request_id": "r", "tokens": [1], "top_logprobs": [[["a", 1.0]]]}),
    (Kind.FINISHED, {"request_id": "r", "finish_reason": "exploded"}),
    (Kind.FINISHED, {"request_id": "r", "finish_reason": "stop", "completion_tokens": "3"}),
    (Kind.ERROR, {"request_id": "r", "error": "X", "message": 5}),
    (Kind.ERROR, {"request_id": "", "error": "X", "message": "m", "fatal": "yes"}),
    (Kind.ABORT, {"request_id": None}),
    (Kind.DRAIN, {"worker_id": "w", "done": 1}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1, -2], "params": {}}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": []}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"max_tokens": "5"}}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"seed": 1.5}}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"logit_bias": {"x": 1.0}}}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"logit_bias": {"1" * 5000: 1.0}}}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"logit_bias": {"1": "big"}}}),
    (Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"stop_token_ids": ["2"]}}),
])
def test_every_message_kind_checks_its_field_types(kind, body):
    with pytest.raises(ProtocolError):
        decode(frame_of(kind, body))


def test_the_error_names_the_nested_field():
    with pytest.raises(ProtocolError, match=r"Generate.params.logit_bias\['7'\]: expected float"):
        decode(frame_of(Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"logit_bias": {"7": "x"}}}))


def test_ranges_of_sampling_values_are_left_to_the_worker_which_answers_the_request():
    # A Generate whose values are out of range still decodes: the worker's validate_params then
    # answers it with an InvalidRequestError, so the request does not wait for an answer forever.
    message = decode(frame_of(Kind.GENERATE, {"request_id": "r", "prompt_ids": [1], "params": {"temperature": 99}}))
    assert message.params.temperature == 99
