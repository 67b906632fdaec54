"""A 32,768-token context (Qwen2.5-Coder's trained length, issue 39) on a tiny qwen2 trained to
that length: reame.conf's defaults give the whole of it, and a prompt that fills it round-trips
through the prefix store (saved by one engine, restored into a fresh one) with the logits of
computing it.

The model is one layer with one 16-dim KV head, so a 32k-token prefill takes seconds: what is
long here is the context (2,047 stored blocks, positions to 32,767), not the arithmetic.
"""
from __future__ import annotations

import numpy as np
import pytest

from shared.config import EngineSection
from shared.errors import ConfigError
from shared.sampling import SamplingParams
from tests.model.test_prefix_reuse import store_entries
from tests.model.tiny_gguf import TinyModel, write_tiny
from worker.engine.engine import load_engine
from worker.kv.block_manager import BlockManager
from worker.kv.prefix_cache import PrefixCache
from worker.kv.prefix_setup import engine_fingerprint
from worker.kv.store import KVStore
from worker.kv.store_writer import StoreWriter
from worker.sched.generation import BatchGenerator, FinishEvent, TokenEvent
from worker.sched.tuning_state import SchedulerKnobs, TuningState

N_CTX = 32768
VOCAB = 64
# float16 K/V of one layer and one 16-dim head: 64 bytes a token, 1 KiB a 16-token block, so
# 3 MiB holds the whole context with blocks to spare, and 1 MiB holds half of it.
SPEC = dict(arch="qwen2", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=32, vocab=VOCAB,
            n_ctx=N_CTX)
BS = 16


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "tiny-32k.gguf"
    write_tiny(path, TinyModel(**SPEC))
    return path


def _engine(path, **settings):
    settings.setdefault("kv_cache_memory", "3MiB")
    return load_engine(path, EngineSection(**settings), progress=lambda m: None)


def test_the_default_context_is_the_models_trained_32k(gguf_path):
    assert _engine(gguf_path).n_ctx == N_CTX  # context_length = 0, max_context as shipped


def test_an_automatic_context_is_what_the_pool_holds_and_an_explicit_one_is_refused(gguf_path):
    assert _engine(gguf_path, kv_cache_memory="1MiB").n_ctx == N_CTX // 2
    with pytest.raises(ConfigError, match="raise kv_cache_memory or lower context_length"):
        _engine(gguf_path, kv_cache_memory="1MiB", context_length=N_CTX)


def _prefix(engine, path) -> PrefixCache:
    store = KVStore(path, fingerprint=engine_fingerprint(engine), payload_bytes=engine.kv.block_payload_bytes,
                    budget_bytes=64 << 20, dtype=engine.kv.dtype)
    # "always": on a model this small a measured choice may well recompute; restoring is the point here.
    return PrefixCache(BlockManager.for_pool(engine.kv), engine_fingerprint(engine), kv=engine.kv, store=store,
                       writer=StoreWriter(store), restore="always")


def _next_logits(engine, prefix: PrefixCache, prompt: list[int]) -> tuple[np.ndarray, FinishEvent]:
    """The raw logits of the token after `prompt` (all VOCAB of them, by token id)."""
    generator = BatchGenerator(engine, TuningState(SchedulerKnobs(batching_window_ms=0.0)), prefix=prefix)
    generator.add("long", prompt, SamplingParams(max_tokens=1, temperature=0.0), top_logits=VOCAB)
    logits, finished = np.full(VOCAB, np.nan), None
    while generator.has_work:
        for event in generator.step():
            if isinstance(event, TokenEvent):
                for token, logit in event.top_logits:
                    logits[token] = logit
            elif isinstance(event, FinishEvent):
                finished = event
    assert finished is not None and not np.isnan(logits).any()
    return logits, finished


def test_a_32k_token_prompt_round_trips_through_the_prefix_store(gguf_path, tmp_path):
    prompt = np.random.default_rng(32).integers(3, VOCAB, N_CTX - 1).tolist()  # and one token to generate
    blocks = len(prompt) // BS  # 2047 full blocks: 32,752 tokens
    store_path = tmp_path / "store"

    computed_engine = _engine(gguf_path)
    prefix = _prefix(computed_engine, store_path)
    computed, done = _next_logits(computed_engine, prefix, prompt)
    assert done.cached_tokens == 0 and done.prefix_tokens == blocks * BS
    prefix.close()  # every write committed
    assert store_entries(store_path) == blocks
    del computed_engine

    restarted = _engine(gguf_path)  # another worker: its own engine, its pool never written
    prefix = _prefix(restarted, store_path)
    restored, done = _next_logits(restarted, prefix, prompt)
    prefix.close()
    assert done.cached_tokens == blocks * BS
    assert prefix.counters.prefix_hit_tokens_store == blocks * BS and prefix.counters.prefix_restores == 1
    # The same K/V bits at every position; only the step that computes the last row differs (15
    # prompt tokens after the restored blocks, against the last 511-token chunk of the full
    # prefill), which may sum float32 in another order. Measured: equal to the bit (AVX-512 host).
    scale = np.abs(computed).max()
    np.testing.assert_allclose(restored, computed, rtol=0, atol=1e-5 * scale)
    assert int(np.argmax(restored)) == int(np.argmax(computed))
