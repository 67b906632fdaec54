"""Engine: a loaded model and its KV cache; `execute` computes one step of many sequences.

Kernel sets:
  auto       every token of a step through the fused numba step over packed quantized
             weights (the fast path);
  reference  every step through the ragged float32 forward on weights dequantized with the
             numpy reference decoder (slow; the yardstick for the golden checks).

K/V live in a paged pool (paged_kv.py) whose blocks worker.kv.block_manager hands out; every call
names the blocks of each sequence it computes, so many sequences share one engine.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from shared.config import EngineSection, SchedulerSection, memory_bytes
from shared.errors import ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError
from shared.knobs import batch_ceiling
from worker.engine.batch import RaggedBatch, StepChunk, row_arrays, window_row_tables
from worker.engine.dense import ReferenceDense
from worker.engine import heap
from worker.engine.gguf_file import GGUFFile
from worker.engine.models import build_model
from worker.engine.paged_kv import (WINDOW_KV_MODES, KVShape, PagedKVCache, WindowLayout, pool_blocks,
                                    pool_tokens, window_blocks_per_sequence)

if TYPE_CHECKING:  # the registry loads the numba kernels: imported when an engine is loaded
    from worker.engine.kernels.registry import OpTable

log = logging.getLogger("reame.engine")
_ENGINE, _SCHEDULER = EngineSection(), SchedulerSection()  # reame.conf's defaults, the one source

KERNEL_SETS = ("auto", "reference")
# The int8 matmul variant of each rows bucket (1, 2-8, 9-32, 33+) before any tuning: prompt chunks
# take int8_blocked (same bits; 32-row blocks keep their outputs in L1 and split few-tile matrices
# evenly over the threads: 0.85-0.94x the CPU time of int8 per 512-row matmul on AVX2), or on a host
# with AMX int8_amx (same bits; 512 rows of the 1.5B file's matmuls, 2 threads, Sapphire Rapids:
# 1.2-1.8x int8_blocked, bench/matmul_profile.py).
INT8_MATMULS = ("int8", "int8", "int8", "int8_blocked")
INT8_MATMULS_AMX = ("int8", "int8", "int8", "int8_amx")
Progress = Callable[[str], None]


class Engine:
    """ops: the kernel variant of each op the fused steps run (execute passes its codes); a kernel
    tuner swaps it for another table of the same numerics between steps.
    attention_chunk: keys per online-softmax chunk when a step names none."""

    def __init__(self, gguf: GGUFFile, model, kernels: str, n_ctx: int, dense, logits_of_rows,
                 kv: PagedKVCache, ops: OpTable, attention_chunk: int):
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
        self.ops = ops
        self.attention_chunk = attention_chunk

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
                logits = self.model.forward_rows(tokens, positions, tables, logit_rows, self.kv, chunk_keys,
                                                 self.ops.codes)
            else:
                logits = self.model.forward_rows(tokens, positions, tables, logit_rows, self.kv, chunk_keys,
                                                 self.ops.codes, window_tables=window_row_tables(chunks))
        results: list[np.ndarray | None] = [None] * len(chunks)
        for row, i in enumerate(wanting):
            results[i] = np.array(logits[row], np.float32)
        return results

    # ---------------------------------------------------------------- threads
    @property
    def max_threads(self) -> int:
        """The most threads a step can use (numba's pool)."""
        import numba
        return numba.config.NUMBA_NUM_THREADS

    @property
    def threads(self) -> int:
        """Threads the next step of the calling thread runs on."""
        import numba
        return numba.get_num_threads()

    def set_threads(self, n: int) -> None:
        """Run the calling thread's next steps on n threads (numba's setting is per calling
        thread: call it from the thread that calls execute, between steps)."""
        _configure_numba(n)

    def time_matmul(self, ops, rows: int, repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> float:
        """Median seconds of one layer's matmuls (Q/K/V, gate/up, down) for `rows` rows with the
        op table `ops`, on the calling thread's thread count: what start-up calibration compares.
        Random activations; the model's own packed weights. No K/V is touched."""
        from worker.engine.models.common import FFN_DOWN, GATE_UP, QKV
        from worker.engine.models.decode_parts import matmul
        buf = self.model.buffers.ensure(rows, 1)
        mm = (self.model.w.tab, ops.codes, buf.scratch)
        m = self.model.w.mats[0]
        rng = np.random.default_rng(rows)
        buf.h[:rows] = rng.standard_normal(buf.h[:rows].shape).astype(np.float32)
        buf.act[:rows] = rng.standard_normal(buf.act[:rows].shape).astype(np.float32)
        times = []
        for _ in range(repeats):
            t0 = clock()
            matmul(mm, m[QKV], buf.h[:rows], buf.qkv[:rows])
            matmul(mm, m[GATE_UP], buf.h[:rows], buf.gu[:rows])
            matmul(mm, m[FFN_DOWN], buf.act[:rows], buf.proj[:rows])
            times.append(clock() - t0)
        return float(np.median(times))

def _configure_numba(threads: int) -> None:
    import numba
    if threads > 0:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def load_engine(path, settings: EngineSection = _ENGINE, attention_chunk: int = _SCHEDULER.attention_chunk,
                window_sequences: int = batch_ceiling(_SCHEDULER.max_batch_size),
                progress: Progress | None = None) -> Engine:
    """Open a GGUF model and make it ready to generate, as `settings` (reame.conf's [engine]) ask.

    attention_chunk ([scheduler]): keys per online-softmax chunk when a step names none.
    settings.window_kv: "bounded" keeps a sliding-window layer's K/V only while a query can see
    it, in a window pool sized for window_sequences sequences at once; "full" keeps every layer's
    K/V for the whole context (paged_kv)."""
    kernels, kv_block_size, window_kv = settings.kernels, settings.kv_block_size, settings.window_kv
    if kernels not in KERNEL_SETS:
        raise ModelLoadError(f"unknown kernel set {kernels!r}; choose one of {', '.join(KERNEL_SETS)}")
    say = progress or (lambda msg: log.info("%s", msg))
    _configure_numba(settings.threads)
    t0 = time.perf_counter()
    if kv_block_size < 1:
        raise ConfigError(f"[engine] kv_block_size must be at least 1, got {kv_block_size}")
    if window_kv not in WINDOW_KV_MODES:
        raise ConfigError(f"[engine] window_kv = {window_kv!r}; expected one of {', '.join(WINDOW_KV_MODES)}")
    if settings.prefill_chunk < 1 or attention_chunk < 1:
        raise ConfigError(f"prefill_chunk ({settings.prefill_chunk}) and attention_chunk ({attention_chunk}) "
                          "must be >= 1")
    g = GGUFFile(path)
    trained = int(g.get(f"{g.arch}.context_length") or 2048)
    n_ctx = settings.context_length or min(trained, settings.max_context)
    say(f"loading {g.path.name} ({g.arch}, {g.path.stat().st_size / 1e6:.0f} MB), context {n_ctx}")
    from worker.engine.kernels.registry import OpTable, layout_for
    # The op table fixes the numerics for the engine's life (a tuner swaps variants within them),
    # so the weights are packed once, in the layout those kernels read.
    ops = OpTable.of(matmul=_int8_matmuls(settings.matmul_tiles) if _want_int8(settings.matmul_activations)
                     else "float32")
    model = build_model(g, n_ctx,
                        progress=lambda i, n: say(f"packing weights: layer {i}/{n}") if i in (n // 2, n) else None,
                        layout=layout_for(ops.numerics("matmul")))
    w = model.w
    if kernels == "reference":
        dense = ReferenceDense(w.tensors)
        out_w = dense(w.output)
        logits_of_rows = lambda h: h @ out_w.T
    else:
        dense = logits_of_rows = None  # the fused row step reads the packed weights itself
        t = w.table
        say(f"packed weights {t.nbytes / 1e6:.0f} MB (file {g.path.stat().st_size / 1e6:.0f} MB): codes and "
            f"int8 scale steps {t.data.nbytes / 1e6:.0f} MB, float32 scales {t.scales.nbytes / 1e6:.0f} MB, "
            f"float16 scales {t.scales16.nbytes / 1e6:.0f} MB")
    # Every weight now lives in the packed table (or the reference set's arrays): the file's pages
    # would only double the resident memory (1.5B Qwen: 2.7 -> 1.6 GB after load).
    g.release_pages()
    heap.trim()  # packing's freed temporaries (heap.py: 346 MB on the 1.5B file)
    import psutil
    hp = model.hp
    shape = KVShape(hp.n_layers, hp.n_kv_heads, hp.head_dim, kv_block_size)
    budget = memory_bytes(settings.kv_cache_memory, psutil.virtual_memory().total)
    window = _window_layout(model, window_kv, window_sequences, n_ctx, settings.prefill_chunk, kv_block_size)
    k_dtype, v_dtype = settings.k_dtype or settings.kv_dtype, settings.v_dtype or settings.kv_dtype
    window_bytes = window.slots * shape.block_bytes(k_dtype, len(window.layers), v_dtype) if window else 0
    main_layers = hp.n_layers - len(window.layers) if window else None
    if not settings.context_length:
        n_ctx = _automatic_context(n_ctx, pool_tokens(shape, k_dtype, budget - window_bytes, main_layers, v_dtype),
                                   settings.kv_cache_memory, say)
    kv = PagedKVCache(shape, pool_blocks(shape, k_dtype, budget - window_bytes, n_ctx, main_layers, v_dtype),
                      k_dtype, window, v_dtype)
    if window is not None:
        say(f"KV window pool: {len(window.layers)} sliding-window layers ({window.tokens} tokens) keep their K/V "
            f"for {window_sequences} sequences' windows: {window.slots} slots, {window_bytes / 2**20:.0f} MiB")
    say(f"KV cache: {kv.num_blocks} blocks of {kv_block_size} tokens, {kv.dtype}, "
        f"{kv.nbytes / 2**20:.0f} MiB ({kv.num_blocks * kv_block_size} tokens)")
    if kernels == "auto":
        say(f"matmuls: {_matmul_description(ops)}")
    engine = Engine(g, model, kernels, n_ctx, dense, logits_of_rows, kv, ops, attention_chunk)
    say(f"model ready in {time.perf_counter() - t0:.1f} s")
    return engine


def _automatic_context(n_ctx: int, pool_holds: int, memory: str, say: Progress) -> int:
    """context_length = 0: the trained context capped by max_context (n_ctx), and by the tokens the
    pool holds, so the shipped config starts with any model (a 3B Qwen's 32k tokens of float16 K/V
    are 1.1 GiB, over the 1 GiB default pool); a context_length the pool cannot hold is refused."""
    if pool_holds >= n_ctx or pool_holds < 1:
        return n_ctx  # it fits, or not even one block does: pool_blocks says so with the numbers
    say(f"context {pool_holds} tokens, not {n_ctx}: kv_cache_memory = {memory} holds no more "
        f"(raise it, or set kv_dtype = q8_0, for the longer context)")
    return pool_holds


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


def _int8_matmuls(tiles: str = "auto") -> tuple[str, ...]:
    """The shipped int8 variants per bucket: prompt chunks on AMX tiles where [engine] matmul_tiles
    allows and the host has them."""
    from worker.engine.kernels import matmul_amx
    if tiles not in ("auto", "off"):
        raise ConfigError(f"[engine] matmul_tiles = {tiles!r}; expected auto or off")
    return INT8_MATMULS_AMX if tiles == "auto" and matmul_amx.AVAILABLE else INT8_MATMULS


def _matmul_description(ops: "OpTable") -> str:
    from worker.engine.kernels import matmul_i8
    if ops.numerics("matmul") != "int8":
        return "float32 activations"
    how = {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}.get(matmul_i8.ISA, "portable IR, slow")
    tiles = ", AMX tiles for prompt chunks" if "int8_amx" in ops.names("matmul") else ""
    return f"int8 activations ({how} dot products{tiles})"


def load_engine_from_config(config, model: str | None = None, kernels: str | None = None,
                            progress: Progress | None = None) -> Engine:
    """load_engine with the [model] and [engine] settings of reame.conf (flags override)."""
    from shared.model_store import model_file
    say = progress or (lambda m: log.info("%s", m))
    path = model_file(config, model, progress=say)
    settings = dataclasses.replace(config.engine, kernels=kernels or config.engine.kernels)
    return load_engine(path, settings, attention_chunk=config.scheduler.attention_chunk,
                       window_sequences=batch_ceiling(config.scheduler.max_batch_size), progress=progress)
