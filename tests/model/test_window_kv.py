"""Gemma 3's sliding-window layers with their K/V kept to the window (window_kv = bounded).

A tiny gemma3 (window 8 tokens, blocks of 4, prefill chunks of 8) so that every sequence runs
far past its window: the logits still match the float64 forward, the window pool never holds
more than a window and a chunk per sequence, batched and prefix-cached runs give the tokens of
the unbounded layout, and the prefix store round-trips the window layers' K/V.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from shared.config import EngineSection
from shared.sampling import SamplingParams
from tests.model.run_requests import run_requests
from tests.model.tiny_gguf import TinyModel, forward_f64, write_tiny
from worker.engine.batch import StepChunk
from worker.engine.engine import load_engine
from worker.engine.paged_kv import window_blocks_per_sequence
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.prefix_setup import engine_fingerprint
from worker.kv.sequence import Sequence
from worker.kv.store import KVStore
from worker.kv.store_writer import StoreWriter
from worker.sched.generation import BatchGenerator
from worker.sched.one_request import generate_one, solo_generator
from worker.sched.tuning_state import SchedulerKnobs, TuningState

SPEC = TinyModel(arch="gemma3", n_layers=6, n_kv_heads=1, head_dim=32, rope_base=1e6, matrix_type=QT.Q8_0,
                 sliding_window=8)
BLOCK, CHUNK = 4, 8
PER_SEQUENCE = window_blocks_per_sequence(SPEC.sliding_window, CHUNK, BLOCK)
PROMPT = [(i * 37 + 11) % SPEC.vocab for i in range(41)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("window") / "gemma3-window.gguf"
    write_tiny(path, SPEC)
    return path


def _load(path, window_kv="bounded", kernels="auto", sequences=2):
    settings = EngineSection(kernels=kernels, matmul_activations="float32", kv_dtype="float32", kv_block_size=BLOCK,
                             prefill_chunk=CHUNK, kv_cache_memory="16MiB", window_kv=window_kv)
    return load_engine(path, settings, window_sequences=sequences, progress=lambda m: None)


def test_bounded_mode_moves_the_local_layers_to_a_window_pool(tiny_path):
    bounded, full = _load(tiny_path), _load(tiny_path, "full")
    assert full.kv.window is None and full.kv.k.shape[1] == 6
    assert bounded.kv.window.layers == (0, 1, 2, 3, 4)  # layer 5 is global
    assert bounded.kv.k.shape[1] == 1 and bounded.kv.k_window.shape[1] == 5
    assert bounded.kv.window.slots == 2 * PER_SEQUENCE
    assert bounded.kv.layout != full.kv.layout  # stored blocks of one are never served to the other
    assert engine_fingerprint(bounded) != engine_fingerprint(full)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_decode_past_the_window_matches_float64_forward(tiny_path, kernels):
    engine = _load(tiny_path, kernels=kernels)
    manager = BlockManager.for_pool(engine.kv)
    slots = manager.window
    seq = Sequence("s", PROMPT, GREEDY, 0.0)
    got, held = [], []
    for pos, token in enumerate(PROMPT):
        manager.allocate(seq, 1)
        chunk = StepChunk.of([token], pos, seq.block_table, True, manager.window_table(seq.block_table))
        got.append(engine.execute([chunk])[0])
        seq.num_computed_tokens += 1
        manager.slide(seq)
        held.append(slots.num_referenced)
    expected = forward_f64(SPEC, PROMPT)
    np.testing.assert_allclose(np.stack(got), expected, atol=2e-3 * np.abs(expected).max())
    # A window of 8 tokens in blocks of 4: at most 3 blocks (the one being filled and two behind).
    assert max(held) == 3 and len(seq.block_table) == 11
    manager.free(seq)
    assert slots.num_referenced == 0 and manager.num_used_blocks == 0


def test_chunked_prefill_past_the_window_matches_float64_forward(tiny_path):
    engine = _load(tiny_path)
    manager = BlockManager.for_pool(engine.kv)
    seq = Sequence("s", PROMPT, GREEDY, 0.0)
    for lo in range(0, len(PROMPT), CHUNK):
        part = PROMPT[lo:lo + CHUNK]
        manager.allocate(seq, len(part))
        assert manager.window.num_referenced <= PER_SEQUENCE
        chunk = StepChunk.of(part, lo, seq.block_table, lo + CHUNK >= len(PROMPT), manager.window_table(seq.block_table))
        logits = engine.execute([chunk])[0]
        seq.num_computed_tokens += len(part)
        manager.slide(seq)
    expected = forward_f64(SPEC, PROMPT)[-1]
    np.testing.assert_allclose(logits, expected, atol=2e-3 * np.abs(expected).max())
    manager.free(seq)


def test_a_chunk_without_window_slots_is_refused(tiny_path):
    engine = _load(tiny_path)
    with pytest.raises(ValueError, match="window_table"):
        engine.execute([StepChunk.of(PROMPT[:4], 0, [0], True)])


def _generator(engine, prefix=None, max_batch_size=4):
    knobs = SchedulerKnobs(batching_window_ms=0.0, max_batch_size=max_batch_size, prefill_chunk=CHUNK)
    return BatchGenerator(engine, TuningState(knobs), prefix=prefix)


REQUESTS = {"long": (PROMPT, GREEDY), "short": (PROMPT[5:14], GREEDY),
            "mid": (PROMPT[::2] + PROMPT[:7], SamplingParams(max_tokens=14, temperature=0.0))}


def test_batched_requests_give_the_tokens_of_the_full_layout(tiny_path):
    """Three requests at once in a window pool that holds two sequences' windows: some wait for
    slots; every one gets the tokens it gets with every layer kept whole, and all slots return."""
    expected = run_requests(_generator(_load(tiny_path, "full")), REQUESTS).tokens
    generator = _generator(_load(tiny_path))
    slots = generator.blocks.window
    peak = []
    got = run_requests(generator, REQUESTS, each_step=lambda g: peak.append(slots.num_referenced))
    assert got.tokens == expected
    assert max(peak) <= slots.num_slots
    assert slots.num_referenced == 0 and slots.num_available == slots.num_slots
    assert generator.blocks.num_used_blocks == 0


def _prefix(engine, store=None, restore="auto"):
    writer = StoreWriter(store) if store is not None else None
    return PrefixCache(BlockManager.for_pool(engine.kv), engine_fingerprint(engine), kv=engine.kv, store=store, writer=writer,
                       restore=restore)


def test_a_cached_prefix_past_the_window_resumes_with_its_window(tiny_path):
    question_a, question_b = [3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4]
    expected = run_requests(_generator(_load(tiny_path, "full")),
                            {"b": (PROMPT + question_b, GREEDY)}).tokens["b"]
    engine = _load(tiny_path)
    generator = _generator(engine, _prefix(engine))
    run_requests(generator, {"a": (PROMPT + question_a, GREEDY)})
    again = run_requests(generator, {"b": (PROMPT + question_b, GREEDY)})
    # Full blocks, then PROMPT's last token copied from a's partly shared block (window slot too).
    assert again.finished["b"].cached_tokens == len(PROMPT) > len(PROMPT) // BLOCK * BLOCK
    assert again.tokens["b"] == expected


def test_evicted_window_slots_shorten_the_reused_prefix(tiny_path):
    """Once other requests took every retained slot, the prefix's blocks are still in RAM but
    their window layers are gone: the request recomputes instead of reading missing K/V."""
    expected = run_requests(_generator(_load(tiny_path, "full")), {"b": (PROMPT + [1, 2], GREEDY)}).tokens["b"]
    engine = _load(tiny_path, sequences=1)
    generator = _generator(engine, _prefix(engine))
    run_requests(generator, {"a": (PROMPT + [7, 7], GREEDY)})
    run_requests(generator, {f"other{i}": ([i + 1] * 30, GREEDY) for i in range(3)})
    again = run_requests(generator, {"b": (PROMPT + [1, 2], GREEDY)})
    assert again.finished["b"].cached_tokens < len(PROMPT) // BLOCK * BLOCK
    assert again.tokens["b"] == expected


def test_the_prefix_store_round_trips_the_window_layers(tiny_path, tmp_path):
    expected = run_requests(_generator(_load(tiny_path, "full")), {"b": (PROMPT + [1, 2, 3], GREEDY)}).tokens["b"]

    def store(engine):
        return KVStore(tmp_path / "store", fingerprint=engine_fingerprint(engine),
                       payload_bytes=engine.kv.block_payload_bytes, budget_bytes=16 << 20, dtype=engine.kv.dtype)

    first = _load(tiny_path)
    prefix = _prefix(first, store(first))
    run_requests(_generator(first, prefix), {"a": (PROMPT + [9, 9], GREEDY)})
    prefix.close()

    restarted = _load(tiny_path)  # nothing in RAM
    prefix = _prefix(restarted, store(restarted), restore="always")
    again = run_requests(_generator(restarted, prefix), {"b": (PROMPT + [1, 2, 3], GREEDY)})
    prefix.close()
    assert again.finished["b"].cached_tokens == len(PROMPT) // BLOCK * BLOCK
    assert prefix.counters.prefix_hit_tokens_store == len(PROMPT) // BLOCK * BLOCK
    assert again.tokens["b"] == expected


def test_gemma3_past_its_512_token_window_gives_the_logits_of_the_full_layout(gemma3_gguf):
    """The real model, an 800-token prompt: bounded and full layouts compute the same numbers
    (the window pool holds the very K/V the full pool would), for a fraction of the memory."""
    prompt = [2] + [(i * 7919) % 200000 + 1000 for i in range(799)]
    runs = {}
    for mode in ("full", "bounded"):
        engine = load_engine(gemma3_gguf, EngineSection(context_length=2048, kv_cache_memory="256MiB", window_kv=mode),
                             window_sequences=1, progress=lambda m: None)
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        outputs = list(generate_one(solo_generator(engine), prompt, greedy, top_logits=5))
        runs[mode] = ([o.token for o in outputs], [o.top_logits for o in outputs], engine.kv)
    assert runs["bounded"][0] == runs["full"][0]
    assert runs["bounded"][1] == runs["full"][1]
    bounded, full = runs["bounded"][2], runs["full"][2]
    per_block = (bounded.k[0].nbytes + bounded.v[0].nbytes) / (full.k[0].nbytes + full.v[0].nbytes)
    assert bounded.window.layers == tuple(i for i in range(18) if (i + 1) % 6) and per_block == 3 / 18
