"""Per-matrix profile of the int8 matmul variants: every distinct (quant type × shape) call of one
model step, at one row (decode) and at a prompt chunk's rows (prefill), beside the bytes it reads.

    python bench/matmul_profile.py [--models smollm2-135m gemma3-270m] [--threads 2] [--rows 1 512]
                                   [--variants int8 int8_rows] [--repeats 7]

For each call kind (the fused Q/K/V launch, O, fused gate/up, down of layer 0, and the output
projection) and each variant, prints the median µs (samples interleaved between variants: the
machine is shared, read ratios within one run), the weight bytes the call streams and what that is
in GB/s — the memory-bandwidth line is ~17 GB/s per core on the AVX2 host — and, for many rows,
the int8 multiply-adds per second (GMAC/s). `step ms` sums a decode step: every layer's calls
plus the output projection (one row).

--clock cpu times each call by the process's CPU time instead of the wall clock: on a host where
other jobs hold the cores, a call's wall time mostly measures how long its threads waited for a
core (a 2-thread launch's barrier waits out a whole scheduler slice, ~16 ms), while its CPU time
is what the kernel costs. At 1 thread it is the kernel's own time; at 2 threads it includes the
threads' waits at the barrier (numba's workqueue threads sleep there, so it stays close).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from shared.config import EngineSection  # noqa: E402
from worker.engine.engine import load_engine  # noqa: E402
from worker.engine.kernels.matmul_i8 import ISA, batch_scratch_i8  # noqa: E402
from worker.engine.kernels.packing import M_K, M_N, M_TILES, TILE  # noqa: E402
from worker.engine.kernels.registry import variants_of  # noqa: E402
from worker.engine.models.common import FFN_DOWN, GATE_UP, O, QKV  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def call_kinds(w) -> dict[str, np.ndarray]:
    """{kind: mats} of layer 0's launches and the output projection."""
    m = w.mats[0]
    return {"qkv": np.array(m[QKV]), "o": np.array([m[O]]), "gateup": np.array(m[GATE_UP]),
            "down": np.array(m[FFN_DOWN]), "output": np.array([w.output])}


def describe(w, mats) -> tuple[str, int, int, int]:
    """(quant types, rows, inputs, bytes streamed) of one launch."""
    t = w.table
    types = "+".join(sorted({QT(w.tensors[i].qtype).name for i in mats}))
    rows = sum(int(t.meta[i, M_N]) for i in mats)
    k = int(t.meta[mats[0], M_K])
    nbytes = sum(w.tensors[i].raw.nbytes for i in mats)
    return types, rows, k, nbytes


def profile(path: Path, threads: int, rows_list: list[int], variants: list[str], repeats: int, clock) -> None:
    engine = load_engine(path, EngineSection(threads=threads, context_length=1024), progress=say)
    numba.set_num_threads(threads)
    w = engine.model.w
    t = w.table
    tab = (t.data, t.scales, t.scales16, t.meta)
    kinds = call_kinds(w)
    fns = {name: variants_of("matmul")[name].fn for name in variants}
    width = max(sum(int(t.meta[i, M_TILES]) for i in mats) for mats in kinds.values()) * TILE
    k_max = max(int(t.meta[mats[0], M_K]) for mats in kinds.values())
    b_max = max(rows_list)
    rng = np.random.default_rng(0)
    x_all = rng.standard_normal((b_max, k_max)).astype(np.float32)
    out = np.zeros((b_max, width), np.float32)
    scratch = batch_scratch_i8(width // TILE, b_max, k_max)
    n_layers = w.mats.shape[0]
    print(f"\n{path.name}: {threads} thread(s), int8 dot products: {ISA}, clock: {clock.__name__}")
    head = f"{'kind':7} {'types':12} {'shape':>13} {'MB':>6} {'rows':>5} " + " ".join(
        f"{v + ' µs':>14} {'GB/s':>5} {'GMAC/s':>6}" for v in variants)
    print(head)
    print("-" * len(head))
    step = {v: 0.0 for v in variants}
    for kind, mats in kinds.items():
        types, n, k, nbytes = describe(w, mats)
        for rows in rows_list:
            if kind == "output" and rows > 1:
                continue  # a step computes logits of its last row only
            x = np.ascontiguousarray(x_all[:rows, :k])
            samples = {v: [] for v in variants}
            for v in variants:
                fns[v](*tab, mats, x, out, scratch)  # compile / warm
            for _ in range(repeats):
                for v in variants:
                    t0 = clock()
                    fns[v](*tab, mats, x, out, scratch)
                    samples[v].append(clock() - t0)
            cells = []
            for v in variants:
                s = statistics.median(samples[v])
                if rows == 1:
                    step[v] += s * (1 if kind == "output" else n_layers)
                cells.append(f"{s * 1e6:14.0f} {nbytes / s / 1e9 if rows == 1 else 0:5.1f} {rows * n * k / s / 1e9:6.1f}")
            print(f"{kind:7} {types:12} {f'{n}x{k}':>13} {nbytes / 1e6:6.2f} {rows:>5} " + " ".join(cells),
                  flush=True)
    print("decode step (all layers + output, 1 row): " + ", ".join(f"{v} {step[v] * 1e3:.2f} ms" for v in variants))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    ap.add_argument("--variants", nargs="+", default=list(variants_of("matmul", "int8")))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    from shared.model_store import ensure_model
    for name in args.models:
        path = ensure_model(name, MODELS_DIR, progress=say)
        for threads in args.threads:
            profile(path, threads, args.rows, args.variants, args.repeats, clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
