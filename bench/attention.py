"""Decode attention over the paged KV cache (paged_attention_decode) at SmolLM2's shapes, and
prompt-chunk attention: the per-row kernel against the tiled one (prompt_attention).

    python bench/attention.py [--threads 2] [--batches 1 8] [--contexts 140 400 1000] [--repeats 7]
                              [--dtype float16]
    python bench/attention.py --chunk-rows 512 28 --contexts 512 2048 [--tiles 8 16 32]

For each B and context length: a float16 (or float32) pool with random K/V, blocks of 16 tokens
in shuffled order, B sequences whose last positions lie within 20 tokens of the context length;
then the decode attention of all 30 layers, as one decode step runs it. Before each layer a
3 MiB buffer is read, as the layer's weights are between two attentions, so K/V come from
memory, not from a warm cache. Prints the median time per step (30 layers) and per key × kv head
(wall time / (B × context × kv heads × layers)).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from benchlib import say  # noqa: E402  (bench/, the script's directory, is on sys.path)
from worker.engine.kernels.attention import paged_attention_decode  # noqa: E402
from worker.engine.kernels.prompt_attention import paged_attention_runs  # noqa: E402

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16  # SmolLM2-135M
WEIGHTS_PER_LAYER = 3 << 20


@njit(parallel=True, cache=True)
def _read(buffer):
    """Touch a cache line every 64 bytes (what streaming a layer's weights does to the caches)."""
    total = 0
    for i in prange(buffer.shape[0] // 64):
        total += buffer[i * 64]
    return total


def _pools(batch: int, context: int, dtype, rng):
    per_sequence = context // BLOCK + 2
    n_blocks = 2 * batch * per_sequence + 1
    raw = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    k = raw(n_blocks, LAYERS, KV_HEADS, HEAD_DIM, BLOCK)
    v = raw(n_blocks, LAYERS, KV_HEADS, BLOCK, HEAD_DIM)
    if dtype == "float16":
        k, v = k.view(np.uint16), v.view(np.uint16)
    else:
        k, v = k.astype(np.float32), v.astype(np.float32)
    tables = rng.permutation(n_blocks - 1)[:batch * per_sequence].astype(np.int32).reshape(batch, per_sequence)
    return k, v, tables


def measure(batch: int, context: int, dtype: str, repeats: int) -> float:
    rng = np.random.default_rng(batch * 10_000 + context)
    k, v, tables = _pools(batch, context, dtype, rng)
    positions = rng.integers(max(0, context - 20), context + 1, batch).astype(np.int64)
    q = rng.standard_normal((batch, HEADS * HEAD_DIM)).astype(np.float32)
    out = np.empty_like(q)
    weights = np.ones((LAYERS, WEIGHTS_PER_LAYER), np.uint8)
    scale = np.float32(1.0 / np.sqrt(HEAD_DIM))
    paged_attention_decode(q, k, v, 0, tables, positions, 0, scale, 512, out, numba.get_num_threads())  # compile
    _read(weights[0])
    steps = []
    for _ in range(repeats):
        spent = 0.0
        for layer in range(LAYERS):
            _read(weights[layer])
            started = time.perf_counter()
            paged_attention_decode(q, k, v, layer, tables, positions, 0, scale, 512, out, numba.get_num_threads())
            spent += time.perf_counter() - started
        steps.append(spent)
    return statistics.median(steps)


def measure_chunk(rows: int, context: int, dtype: str, repeats: int, tiles: list[int]) -> list[float]:
    """Median seconds for the 30 layers' attention of one prompt chunk: `rows` queries at
    positions context-rows..context-1 of one sequence; the per-row kernel first, then the tiled
    one per tile size, alternating within each repeat so load changes hit all alike."""
    rng = np.random.default_rng(rows * 10_000 + context)
    k, v, tables = _pools(1, context, dtype, rng)
    table_rows = np.repeat(tables, rows, axis=0)
    positions = np.arange(context - rows, context, dtype=np.int64)
    runs = np.array([0, rows], np.int64)
    q = rng.standard_normal((rows, HEADS * HEAD_DIM)).astype(np.float32)
    out = np.empty_like(q)
    weights = np.ones((LAYERS, WEIGHTS_PER_LAYER), np.uint8)
    scale = np.float32(1.0 / np.sqrt(HEAD_DIM))

    def per_row(layer):
        paged_attention_decode(q, k, v, layer, table_rows, positions, 0, scale, 512, out, numba.get_num_threads())

    def tiled(tile):
        return lambda layer: paged_attention_runs(q, k, v, layer, table_rows, positions, runs, 0, scale, 512, tile,
                                                  out, numba.get_num_threads())

    kernels = [per_row] + [tiled(t) for t in tiles]
    for kernel in kernels:  # compile / load
        kernel(0)
    steps = [[] for _ in kernels]
    for _ in range(repeats):
        for kernel, times in zip(kernels, steps):
            spent = 0.0
            for layer in range(LAYERS):
                _read(weights[layer])
                started = time.perf_counter()
                kernel(layer)
                spent += time.perf_counter() - started
            times.append(spent)
    return [statistics.median(t) for t in steps]


def main_chunks(args) -> None:
    say(f"prompt-chunk attention, SmolLM2 shapes, {args.dtype} K/V, blocks of {BLOCK}, {args.threads} threads: "
        f"per-row kernel vs tiled (tiles {args.tiles})")
    print(f"{'rows':>5} {'context':>8} {'per-row ms':>11} " + " ".join(f"{'tile ' + str(t):>9} {'ratio':>6}"
                                                                    for t in args.tiles))
    for rows in args.chunk_rows:
        for context in args.contexts:
            if context < rows:
                continue
            say(f"  {rows} rows, context {context}...")
            base, *others = measure_chunk(rows, context, args.dtype, args.repeats, args.tiles)
            print(f"{rows:>5} {context:>8} {base * 1e3:>11.1f} "
                  + " ".join(f"{o * 1e3:>9.1f} {base / o:>6.2f}" for o in others), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[140, 400, 1000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--chunk-rows", type=int, nargs="+", help="prompt-chunk mode: rows per chunk")
    parser.add_argument("--tiles", type=int, nargs="+", default=[16], help="prompt-chunk mode: tile sizes")
    args = parser.parse_args()
    numba.set_num_threads(args.threads)
    if args.chunk_rows:
        main_chunks(args)
        return
    say(f"decode attention, SmolLM2 shapes ({HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"{LAYERS} layers), {args.dtype} K/V, blocks of {BLOCK}, {args.threads} threads")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            say(f"  B={batch}, context {context}...")
            seconds = measure(batch, context, args.dtype, args.repeats)
            rows.append((batch, context, seconds))
    print(f"{'B':>3} {'context':>8} {'ms/step':>8} {'ns/key·kvh':>11}")
    for batch, context, seconds in rows:
        per_key = seconds / (batch * context * KV_HEADS * LAYERS) * 1e9
        print(f"{batch:>3} {context:>8} {seconds * 1e3:>8.2f} {per_key:>11.1f}")


if __name__ == "__main__":
    main()
