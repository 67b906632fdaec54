"""One-row (decode) int8 matmul calls on synthetic matrices of the 1.5B file's shapes and types.

    python bench/matmul_one_row.py [--threads 1] [--repeats 300]

Times linear_batch_i8 at B = 1 on random Q4_K, Q6_K and Q4_0 matrices of 512 × 1536 (L2-resident)
and 8960 × 1536 (an ffn matrix of Qwen2.5-Coder-1.5B), with the packed parameters as shipped and
multiplied out into float32 ones. Prints the best of --repeats calls (a noisy shared host slows
calls, never speeds them up), its GB/s of packed bytes and GMAC/s. Alternate trees run by run to
compare them: the kernel is compute-bound at one row on one core, so instruction changes show here
that a whole decode step's noise hides (docs/benchmarks.md, 2026-12-07 Zen 4).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from tests.kernels.quant_cases import batch_inputs, packed_table, random_tensor  # noqa: E402
from worker.engine.kernels.matmul_i8 import ISA, batch_scratch_i8, linear_batch_i8  # noqa: E402
from worker.engine.kernels.packing import LAYOUT_QUADS, TILE  # noqa: E402

SHAPES = ((512, 1536), (8960, 1536))
TYPES = (QT.Q4_K, QT.Q6_K, QT.Q4_0)


def best_call(qtype: QT, n: int, k: int, float32_params: bool, repeats: int) -> tuple[float, int]:
    """(best seconds of one call, packed bytes) for a random n × k matrix of qtype."""
    table = packed_table([(random_tensor(qtype, n, k, 1), qtype)], LAYOUT_QUADS, float32_params=float32_params)
    x = batch_inputs(1, k)
    out = np.zeros((1, table.padded_rows(0)), np.float32)
    scratch = batch_scratch_i8(table.padded_rows(0) // TILE, 1, k)
    args = (table.data, table.scales, table.scales16, table.meta, np.array([0]), x, out, scratch)
    linear_batch_i8(*args)  # compile / load
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        linear_batch_i8(*args)
        best = min(best, time.perf_counter() - t0)
    return best, table.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    print(f"linear_batch_i8, one row, {args.threads} thread(s), {ISA} path, best of {args.repeats}")
    print(f"{'type':<6} {'shape':>12} {'parameters':>11} {'µs':>8} {'GB/s':>6} {'GMAC/s':>7}")
    for qtype in TYPES:
        for n, k in SHAPES:
            for f32 in (False, True):
                seconds, nbytes = best_call(qtype, n, k, f32, args.repeats)
                print(f"{qtype.name:<6} {f'{n}x{k}':>12} {'float32' if f32 else 'as shipped':>11} "
                      f"{seconds * 1e6:8.1f} {nbytes / seconds / 1e9:6.1f} {n * k / seconds / 1e9:7.1f}", flush=True)


if __name__ == "__main__":
    main()
