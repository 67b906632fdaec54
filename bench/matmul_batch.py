"""Batched decode matmul: linear_batch on B vectors vs B separate matvec.linear calls.

    python bench/matmul_batch.py [--threads 1 2] [--batches 1 2 4 8 16] [--repeats 15] [--cases ...]

Cases "<model>-<qkv|gateup|down|output>", model smol (SmolLM2-135M Q4_1) or gemma (Gemma 3 270M
Q4_K_M); default: SmolLM2's Q/K/V (one fused call), gate/up (fused), down and output matrices and
Gemma's Q8_0 output matrix, packed straight from the GGUF. Per-layer cases cycle through every
layer, so weights come from memory as in a real decode step rather than from a hot cache.

Prints medians (µs per call) of samples interleaved across the three timings: one matvec.linear
call, B of them, one linear_batch call; `batch/1mv` is what a step of B sequences costs relative
to one sequence (the goal for B=8 was ≤ 2.5), `batch/Bmv` relative to B separate calls. A row
marked "rows differ!" would mean linear_batch lost bit identity with matvec. Not a test: the
machines are shared; read ratios from one run, and distrust 2-thread rows taken while anything
else runs (a stalled barrier costs a whole scheduler slice, ~15 ms).
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

from worker.engine.gguf_file import GGUFFile  # noqa: E402
from worker.engine.kernels.matmul_batch import batch_scratch, linear_batch  # noqa: E402
from tests.kernels.yardsticks import linear  # noqa: E402
from worker.engine.kernels.packing import FORMAT_NAMES, M_FMT, M_K, TILE, MatrixTable, pack  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()


LAYER_CASES = {"qkv": ("attn_q", "attn_k", "attn_v"), "gateup": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
FILES = {"smol": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma": "gemma-3-270m-q4_k_m.gguf"}


def cases(selected):
    """(name, MatrixTable, [mats array per layer]) for each selected case, packed straight from the
    GGUF (no model code): "<model>-<qkv|gateup|down|output>", model one of FILES."""
    out = []
    for model, file in FILES.items():
        wanted = [c.split("-", 1)[1] for c in selected if c.startswith(model + "-")]
        if not wanted:
            continue
        g = GGUFFile(MODELS_DIR / file)
        n_layers = 1 + max(int(n.split(".")[1]) for n in g.tensors if n.startswith("blk."))
        table, names = MatrixTable(), {}
        for kind in wanted:
            if kind == "output":
                name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
                names[kind] = [[name]]
            else:
                names[kind] = [[f"blk.{i}.{n}.weight" for n in LAYER_CASES[kind]] for i in range(n_layers)]
        index = {}
        for kind in wanted:
            for layer in names[kind]:
                for n in layer:
                    if n not in index:
                        t = g.tensor(n)
                        index[n] = table.add(pack(t.raw, t.qtype))
        table.finalize()
        for kind in wanted:
            out.append((f"{model}-{kind}", table, [np.array([index[n] for n in layer]) for layer in names[kind]]))
    return out


def medians(fns, calls, repeats):
    """Median µs per call of each fn over `calls` (argument tuples); samples interleaved across fns so
    a burst of load on the shared machine hits every fn alike."""
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, got in zip(fns, samples):
            t0 = time.perf_counter()
            for args in calls:
                fn(*args)
            got.append((time.perf_counter() - t0) / len(calls) * 1e6)
    return [statistics.median(got) for got in samples]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cases", nargs="+", default=["smol-qkv", "smol-gateup", "smol-down", "smol-output",
                                                     "gemma-output"])
    args = ap.parse_args()
    b_max = max(args.batches)
    print(f"{'case':12} {'fmt':3} {'rows×K':>11} {'thr':>3} {'B':>3} {'1 matvec':>9} {'B matvecs':>10} "
          f"{'batch':>9} {'batch/1mv':>9} {'batch/Bmv':>9}")
    for name, t, mat_lists in cases(args.cases):
        m0 = t.meta[mat_lists[0]]
        k = int(m0[0, M_K])
        rows = sum(t.padded_rows(int(i)) for i in mat_lists[0])
        fmt = "+".join(sorted({FORMAT_NAMES[int(f)] for f in m0[:, M_FMT]}))
        xs = np.random.default_rng(0).standard_normal((b_max, k)).astype(np.float32)
        tiles = np.zeros((rows // TILE, TILE), np.float32)
        scratch = batch_scratch(rows // TILE, b_max, k)
        tab = (t.data, t.scales, t.scales16, t.meta)
        calls = [(m,) for m in mat_lists]
        for threads in args.threads:
            numba.set_num_threads(threads)
            for b in args.batches:
                out_mv = np.zeros((b, rows), np.float32)
                out_b = np.zeros((b, rows), np.float32)
                x = np.ascontiguousarray(xs[:b])

                def one(mats):
                    linear(*tab, mats, x[0], out_mv[0], tiles)

                def each(mats):
                    for i in range(b):
                        linear(*tab, mats, x[i], out_mv[i], tiles)

                def batched(mats):
                    linear_batch(*tab, mats, x, out_b, scratch)

                each(mat_lists[0]), batched(mat_lists[0])  # compile / warm
                same = np.array_equal(out_mv, out_b)
                t_one, t_each, t_b = medians([one, each, batched], calls, args.repeats)
                print(f"{name:12} {fmt:3} {rows:>5}×{k:<5} {threads:>3} {b:>3} {t_one:9.1f} {t_each:10.1f} "
                      f"{t_b:9.1f} {t_b / t_one:9.2f} {t_b / t_each:9.2f}{'' if same else '  (rows differ!)'}",
                      flush=True)


if __name__ == "__main__":
    main()
