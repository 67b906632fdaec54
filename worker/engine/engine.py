"""Engine: a loaded model, its KV cache and the generation loop.

Kernel sets:
  auto       every token of a step through the fused numba step over packed quantized
             weights (the fast path);
  reference  every step through the ragged float32 forward on weights dequantized with the
             numpy reference decoder (slow; the yardstick for the golden checks).

K/V live in a paged pool (paged_kv.py) whose blocks worker.block_manager hands out; every call
names the blocks of each sequence it computes, so many sequences share one engine.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from shared.config import memory_bytes
from shared.errors import ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError
from worker.block_manager import BlockManager
from worker.engine.batch import RaggedBatch, StepChunk, row_arrays, window_row_tables
from worker.engine.dense import ReferenceDense
from worker.engine.gguf_file import GGUFFile
from worker.engine.models import build_model
from worker.engine.paged_kv import (WINDOW_KV_MODES, KVShape, PagedKVCache, WindowLayout, pool_blocks,
                                    window_blocks_per_sequence)
from worker.sampler import Sampler, validate_params
from worker.sampling_params import SamplingParams
from worker.sequence import Sequence
from worker.window_slots import WindowSlots

log = logging.getLogger("reame.engine")

KERNEL_SETS = ("auto", "reference")
Progress = Callable[[str], None]


@dataclass
class TokenOutput:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    top_logits: list[tuple[int, float]] = field(default_factory=list)  # raw model logits, best first
    finish_reason: str | None = None  # None while generating, then "stop" or "length"


@dataclass
class StepTimes:
    """Wall time of the last generate call's phases (for benchmarks and logs)."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0


class Engine:
    def __init__(self, gguf: GGUFFile, model, kernels: str, n_ctx: int, dense, logits_of_rows,
                 kv: PagedKVCache):
        self.gguf = gguf
        self.model = model
        self.kernels = kernels
        self.n_ctx = n_ctx
        self.arch = gguf.arch
        self.model_name = str(gguf.get("general.name") or gguf.path.stem)
        self.vocab_size = model.hp.vocab_size
        self._dense = dense
        self._logits_of_rows = logits_of_rows
        self.kv = kv
        # Who owns which block: the single-sequence generate() below and the worker's scheduler
        # both allocate here, so the two never hand out the same block.
        window = None
        if kv.window is not None:
            window = WindowSlots(kv.window.slots, kv.num_blocks, kv.window.tokens, kv.block_size)
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size, window)
        self.prefill_chunk = 512
        self.attention_chunk = 512
        self.times = StepTimes()

    # ---------------------------------------------------------------- checks
    def validate(self, prompt_ids, max_tokens: int) -> None:
        if len(prompt_ids) == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        bad = [int(t) for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                                      param="prompt")
        if max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if len(prompt_ids) + max_tokens > self.n_ctx:
            raise ContextLengthError(
                f"this model's context is {self.n_ctx} tokens; the prompt has {len(prompt_ids)} and "
                f"max_tokens asks for {max_tokens} more ({len(prompt_ids) + max_tokens} in all)",
                param="max_tokens")

    # ---------------------------------------------------------------- one step of many sequences
    def execute(self, chunks: list[StepChunk], attention_chunk: int | None = None) -> list[np.ndarray | None]:
        """Compute every chunk (K/V into its blocks); return each chunk's last-token logits, or
        None for chunks that do not want them.

        auto: every token of every chunk is one row of the fused numba step (prompt chunks and
        decode tokens together, one read of the weights); a row's result depends only on its
        own token, position and cached K/V, never on the rest of the batch or on where a prompt
        was split into chunks. reference: the ragged float32 BLAS forward.
        """
        chunk_keys = attention_chunk or self.attention_chunk
        wanting = [i for i, c in enumerate(chunks) if c.wants_logits]
        if self.kernels == "reference":
            logits = self.model.forward(RaggedBatch(chunks), self.kv, self._dense, self._logits_of_rows, chunk_keys)
        else:
            tokens, positions, tables, logit_rows = row_arrays(chunks)
            if self.kv.window is None:
                logits = self.model.forward_rows(tokens, positions, tables, logit_rows, self.kv, chunk_keys)
            else:
                logits = self.model.forward_rows(tokens, positions, tables, logit_rows, self.kv, chunk_keys,
                                                 window_tables=window_row_tables(chunks))
        results: list[np.ndarray | None] = [None] * len(chunks)
        for row, i in enumerate(wanting):
            results[i] = np.array(logits[row], np.float32)
        return results

    # ---------------------------------------------------------------- one sequence
    def generate(self, prompt_ids, params: SamplingParams, top_logits: int = 0) -> Iterator[TokenOutput]:
        """Yield one TokenOutput per generated token; the last one carries finish_reason.

        One sequence on its own (the CLI and benchmarks); the worker batches through execute().
        top_logits > 0 also reports the raw logits of the best candidates at each step.
        """
        validate_params(params, self.vocab_size)
        self.validate(prompt_ids, params.max_tokens)
        ids = np.asarray(prompt_ids, dtype=np.int64)
        sampler = Sampler(params, self.vocab_size)
        sampler.observe_prompt(ids)
        stop_ids = set(params.stop_token_ids)
        times = self.times = StepTimes()
        seq = Sequence("generate", ids.tolist(), params, 0.0)
        manager = self.block_manager
        if manager.blocks_needed(seq.max_num_tokens) > manager.num_free_blocks:
            raise ContextLengthError(f"the KV cache has {manager.num_free_blocks * manager.block_size} free token "
                                     f"slots; this request needs {seq.max_num_tokens}", param="max_tokens")
        try:
            t0 = time.perf_counter()
            for lo in range(0, len(ids), self.prefill_chunk):
                part = ids[lo:lo + self.prefill_chunk]
                logits = self._step_alone(seq, part, lo + len(part) == len(ids))
            times.prefill_tokens, times.prefill_s = len(ids), time.perf_counter() - t0
            t0 = time.perf_counter()
            for n in range(params.max_tokens):
                out = self._emit(sampler, logits, params)
                if top_logits > 0:
                    out.top_logits = _top_logits(logits, top_logits)
                if out.token in stop_ids:
                    out.finish_reason = "stop"
                elif n + 1 == params.max_tokens:
                    out.finish_reason = "length"
                times.decode_tokens, times.decode_s = n + 1, time.perf_counter() - t0
                yield out
                if out.finish_reason:
                    return
                logits = self._step_alone(seq, [out.token], True)
        finally:
            manager.free(seq)

    def _step_alone(self, seq: Sequence, token_ids, wants_logits: bool) -> np.ndarray | None:
        """Compute seq's next tokens on their own, with blocks (and window slots) as they are needed."""
        manager = self.block_manager
        manager.allocate(seq, len(token_ids))
        chunk = StepChunk.of(token_ids, seq.num_computed_tokens, seq.block_table, wants_logits,
                             manager.window_table(seq.block_table))
        logits = self.execute([chunk])[0]
        seq.num_computed_tokens += len(token_ids)
        manager.slide(seq)
        return logits

    def _emit(self, sampler: Sampler, logits: np.ndarray, params: SamplingParams) -> TokenOutput:
        token = sampler.sample(logits)
        if params.logprobs <= 0:
            return TokenOutput(token)
        lp, top = sampler.logprobs(logits, token, params.logprobs)
        return TokenOutput(token, lp, top)

    def warm_up(self) -> None:
        """Compile (or load from the numba cache) every kernel the hot path uses."""
        self.generate_ids([0], 2)

    def generate_ids(self, prompt_ids, max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [o.token for o in self.generate(prompt_ids, params)]


def _top_logits(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    k = min(k, logits.size)
    best = np.argpartition(logits, logits.size - k)[logits.size - k:]
    best = best[np.lexsort((best, -logits[best]))]
    return [(int(i), float(logits[i])) for i in best]


def _configure_numba(threads: int) -> None:
    import numba
    if threads > 0:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def load_engine(path, kernels: str = "auto", threads: int = 0, context_length: int = 0,
                max_context: int = 8192, prefill_chunk: int = 512,
                kv_block_size: int = 16, kv_dtype: str = "float16", kv_cache_memory: str = "1GiB",
                attention_chunk: int = 512, matmul_activations: str = "auto",
                window_kv: str = "bounded", window_sequences: int = 16,
                progress: Progress | None = None) -> Engine:
    """Open a GGUF model and make it ready to generate.

    window_kv: "bounded" keeps a sliding-window layer's K/V only while a query can see it, in a
    window pool sized for window_sequences sequences at once; "full" keeps every layer's K/V for
    the whole context (paged_kv)."""
    if kernels not in KERNEL_SETS:
        raise ModelLoadError(f"unknown kernel set {kernels!r}; choose one of {', '.join(KERNEL_SETS)}")
    say = progress or (lambda msg: log.info("%s", msg))
    _configure_numba(threads)
    t0 = time.perf_counter()
    if kv_block_size < 1:
        raise ConfigError(f"[engine] kv_block_size must be at least 1, got {kv_block_size}")
    if window_kv not in WINDOW_KV_MODES:
        raise ConfigError(f"[engine] window_kv = {window_kv!r}; expected one of {', '.join(WINDOW_KV_MODES)}")
    if prefill_chunk < 1 or attention_chunk < 1:
        raise ConfigError(f"prefill_chunk ({prefill_chunk}) and attention_chunk ({attention_chunk}) must be >= 1")
    g = GGUFFile(path)
    trained = int(g.get(f"{g.arch}.context_length") or 2048)
    n_ctx = context_length or min(trained, max_context)
    say(f"loading {g.path.name} ({g.arch}, {g.path.stat().st_size / 1e6:.0f} MB), context {n_ctx}")
    model = build_model(g, n_ctx,
                        progress=lambda i, n: say(f"packing weights: layer {i}/{n}") if i in (n // 2, n) else None)
    w = model.w
    if kernels == "reference":
        dense = ReferenceDense(w.tensors)
        out_w = dense(w.output)
        logits_of_rows = lambda h: h @ out_w.T
    else:
        dense = logits_of_rows = None  # the fused row step reads the packed weights itself
        say(f"packed weights {w.table.nbytes / 1e6:.0f} MB")
    import psutil
    hp = model.hp
    shape = KVShape(hp.n_layers, hp.n_kv_heads, hp.head_dim, kv_block_size)
    budget = memory_bytes(kv_cache_memory, psutil.virtual_memory().total)
    window = _window_layout(model, window_kv, window_sequences, n_ctx, prefill_chunk, kv_block_size)
    if window is None:
        kv = PagedKVCache(shape, pool_blocks(shape, kv_dtype, budget, n_ctx), kv_dtype)
    else:
        window_bytes = window.slots * shape.block_bytes(kv_dtype, len(window.layers))
        main_layers = hp.n_layers - len(window.layers)
        kv = PagedKVCache(shape, pool_blocks(shape, kv_dtype, budget - window_bytes, n_ctx, main_layers), kv_dtype,
                          window)
        say(f"KV window pool: {len(window.layers)} sliding-window layers ({window.tokens} tokens) keep their K/V "
            f"for {window_sequences} sequences' windows: {window.slots} slots, {window_bytes / 2**20:.0f} MiB")
    say(f"KV cache: {kv.num_blocks} blocks of {kv_block_size} tokens, {kv_dtype}, "
        f"{kv.nbytes / 2**20:.0f} MiB ({kv.num_blocks * kv_block_size} tokens)")
    model.buffers.int8 = _want_int8(matmul_activations)
    if kernels == "auto":
        say(f"matmuls: {_matmul_description(model.buffers.int8)}")
    engine = Engine(g, model, kernels, n_ctx, dense, logits_of_rows, kv)
    engine.prefill_chunk = prefill_chunk
    engine.attention_chunk = attention_chunk
    say(f"model ready in {time.perf_counter() - t0:.1f} s")
    return engine


def _window_layout(model, mode: str, sequences: int, n_ctx: int, prefill_chunk: int,
                   block_size: int) -> WindowLayout | None:
    """The window pool for a model with sliding-window layers, when bounding them saves memory."""
    layers, tokens = model.window_layers() if hasattr(model, "window_layers") else ((), 0)
    if mode != "bounded" or not layers:
        return None
    per_sequence = window_blocks_per_sequence(tokens, prefill_chunk, block_size)
    if per_sequence >= -(-n_ctx // block_size):
        return None  # a window as long as the context: bounding it saves nothing
    if sequences < 1:
        raise ConfigError(f"the window pool must hold at least one sequence's window, got {sequences}")
    return WindowLayout(tuple(layers), tokens, per_sequence * sequences)


def _want_int8(mode: str) -> bool:
    from worker.engine.kernels import matmul_i8
    if mode not in ("auto", "float32", "int8"):
        raise ConfigError(f"[engine] matmul_activations = {mode!r}; expected auto, float32 or int8")
    if mode == "int8" and not matmul_i8.available():
        log.warning("matmul_activations = int8, but this CPU has neither AVX-512 VNNI nor AVX2: the "
                    "int8 kernel runs its portable (slow) form")
    return mode == "int8" or (mode == "auto" and matmul_i8.available())


def _matmul_description(int8: bool) -> str:
    from worker.engine.kernels import matmul_i8
    if not int8:
        return "float32 activations"
    how = {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}.get(matmul_i8.ISA, "portable IR, slow")
    return f"int8 activations ({how} dot products)"


def load_engine_from_config(config, model: str | None = None, kernels: str | None = None,
                            progress: Progress | None = None) -> Engine:
    """load_engine with the [model] and [engine] settings of reame.conf (flags override)."""
    from shared.model_store import model_file
    say = progress or (lambda m: log.info("%s", m))
    path = model_file(config, model, progress=say)
    e = config.engine
    return load_engine(path, kernels=kernels or e.kernels, threads=e.threads,
                       context_length=e.context_length, max_context=e.max_context,
                       prefill_chunk=e.prefill_chunk,
                       kv_block_size=e.kv_block_size, kv_dtype=e.kv_dtype, kv_cache_memory=e.kv_cache_memory,
                       attention_chunk=config.scheduler.attention_chunk,
                       matmul_activations=e.matmul_activations, window_kv=e.window_kv,
                       window_sequences=2 * config.scheduler.max_batch_size, progress=progress)
