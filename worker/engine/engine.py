"""Engine: a loaded model, its KV cache and the generation loop.

Kernel sets:
  auto       prefill with float32 BLAS matmuls, decode with the fused numba step over packed
             quantized weights (the fast path);
  reference  every step through the batched float32 forward on weights dequantized with the
             numpy reference decoder (slow; the yardstick for the golden checks).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from shared.errors import ContextLengthError, InvalidRequestError, ModelLoadError
from worker.engine.dense import PackedDense, ReferenceDense
from worker.engine.gguf_file import GGUFFile
from worker.engine.kernels.packing import M_K
from worker.engine.kv_cache import KVCache
from worker.engine.models import build_model
from worker.sampler import Sampler, validate_params
from worker.sampling_params import SamplingParams

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
    def __init__(self, gguf: GGUFFile, model, kernels: str, n_ctx: int, dense, logits_of_last):
        self.gguf = gguf
        self.model = model
        self.kernels = kernels
        self.n_ctx = n_ctx
        self.arch = gguf.arch
        self.model_name = str(gguf.get("general.name") or gguf.path.stem)
        self.vocab_size = model.hp.vocab_size
        self._dense = dense
        self._logits_of_last = logits_of_last
        self.kv = KVCache(model.hp.n_layers, model.hp.n_kv_heads, n_ctx, model.hp.head_dim)
        self.prefill_chunk = 512
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

    # ---------------------------------------------------------------- steps
    def prefill(self, ids: np.ndarray, start: int = 0) -> np.ndarray:
        """Fill the KV cache for ids at positions start..; returns the last token's logits."""
        logits = None
        for lo in range(0, len(ids), self.prefill_chunk):
            chunk = ids[lo:lo + self.prefill_chunk]
            logits = self.model.forward(chunk, start + lo, self.kv, self._dense, self._logits_of_last)
        self.kv.length = start + len(ids)
        return logits

    def decode(self, token: int, pos: int) -> np.ndarray:
        if self.kernels == "reference":
            logits = self.model.forward(np.array([token]), pos, self.kv, self._dense, self._logits_of_last)
        else:
            logits = self.model.decode_step(token, pos, self.kv)
        self.kv.length = pos + 1
        return logits

    def generate(self, prompt_ids, params: SamplingParams, top_logits: int = 0) -> Iterator[TokenOutput]:
        """Yield one TokenOutput per generated token; the last one carries finish_reason.

        top_logits > 0 also reports the raw logits of the best candidates at each step.
        """
        validate_params(params, self.vocab_size)
        self.validate(prompt_ids, params.max_tokens)
        ids = np.asarray(prompt_ids, dtype=np.int64)
        sampler = Sampler(params, self.vocab_size)
        sampler.observe_prompt(ids)
        stop_ids = set(params.stop_token_ids)
        times = self.times = StepTimes()

        t0 = time.perf_counter()
        logits = self.prefill(ids)
        times.prefill_tokens, times.prefill_s = len(ids), time.perf_counter() - t0
        pos = len(ids)
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
            logits = self.decode(out.token, pos)
            pos += 1

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
                max_context: int = 8192, prefill_weights: str = "auto", prefill_chunk: int = 512,
                progress: Progress | None = None) -> Engine:
    """Open a GGUF model and make it ready to generate."""
    if kernels not in KERNEL_SETS:
        raise ModelLoadError(f"unknown kernel set {kernels!r}; choose one of {', '.join(KERNEL_SETS)}")
    say = progress or (lambda msg: log.info("%s", msg))
    _configure_numba(threads)
    t0 = time.perf_counter()
    g = GGUFFile(path)
    trained = int(g.get(f"{g.arch}.context_length") or 2048)
    n_ctx = context_length or min(trained, max_context)
    say(f"loading {g.path.name} ({g.arch}, {g.path.stat().st_size / 1e6:.0f} MB), context {n_ctx}")
    model = build_model(g, n_ctx, progress=lambda i, n: say(f"packing weights: layer {i}/{n}") if i in (n // 2, n) else None)
    w = model.w
    if kernels == "reference":
        dense = ReferenceDense(w.tensors)
        out_w = dense(w.output)
        logits_of_last = lambda h: out_w @ h
    else:
        cache_all = _want_f32_cache(prefill_weights, w.table.nbytes, w.tensors)
        # Embeddings are looked up row by row and the output matrix is used through the
        # decode kernels, so neither needs a dense float32 copy.
        skip = {w.token_embd, w.output}
        dense = PackedDense(w.table, cache_all, skip=skip)
        dense_embd = _RowLookup(w.table, w.token_embd)
        dense = _WithEmbedding(dense, w.token_embd, dense_embd)
        logits_of_last = model.project
        say(f"prefill weights: {'float32 copy' if cache_all else 'dequantized per use'} "
            f"({dense.nbytes / 1e6:.0f} MB), packed decode weights {w.table.nbytes / 1e6:.0f} MB")
    engine = Engine(g, model, kernels, n_ctx, dense, logits_of_last)
    engine.prefill_chunk = prefill_chunk
    say(f"model ready in {time.perf_counter() - t0:.1f} s")
    return engine


def _want_f32_cache(mode: str, packed_bytes: int, tensors) -> bool:
    if mode != "auto":
        return mode == "f32"
    import psutil
    f32_bytes = sum(int(np.prod(t.shape)) * 4 for t in tensors)
    return f32_bytes < psutil.virtual_memory().total // 4


class _RowLookup:
    """Embedding rows dequantized on demand: `lookup[tokens]` → (T, d) float32."""

    def __init__(self, table, index: int):
        self._table, self._index = table, index

    def __getitem__(self, tokens) -> np.ndarray:
        from worker.engine.kernels.ops import dequant_row
        t = self._table
        k = int(t.meta[self._index, M_K])
        out = np.empty((len(tokens), k), np.float32)
        for i, tok in enumerate(np.asarray(tokens).reshape(-1)):
            dequant_row(t.data, t.scales, t.scales16, t.meta[self._index], int(tok), out[i])
        return out


class _WithEmbedding:
    def __init__(self, dense: PackedDense, embd_index: int, lookup: _RowLookup):
        self._dense, self._embd, self._lookup = dense, embd_index, lookup
        self.nbytes = dense.nbytes

    def __call__(self, index: int):
        return self._lookup if index == self._embd else self._dense(index)


def load_engine_from_config(config, model: str | None = None, kernels: str | None = None,
                            progress: Progress | None = None) -> Engine:
    """load_engine with the [model] and [engine] settings of reame.conf (flags override)."""
    from shared.model_store import model_file
    say = progress or (lambda m: log.info("%s", m))
    path = model_file(config, model, progress=say)
    e = config.engine
    return load_engine(path, kernels=kernels or e.kernels, threads=e.threads,
                       context_length=e.context_length, max_context=e.max_context,
                       prefill_weights=e.prefill_weights, prefill_chunk=e.prefill_chunk,
                       progress=progress)
