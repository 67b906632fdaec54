"""Batched decode matmul with int8 activations (VNNI / AVX2): linear_batch_i8 vs linear_batch on SmolLM2.

    python bench/matmul_i8.py [--threads 2 1] [--batches 1 2 4 8 16] [--repeats 9] [--model PATH]

For each thread count and B, times every matrix call of one decode step of the real model — per
layer Q/K/V (one fused call), O, gate/up (fused), down, for all layers, plus the output matrix —
with both kernels, samples interleaved between the kernels (shared machine: read the ratios of one
run). Prints per-kind medians (µs, summed over the layers) and the step total (sum of the kind
medians), `i8/f32` = linear_batch_i8 time / linear_batch time at the same B and `i8/f32@1` =
relative to linear_batch at B=1. Targets: B=8 i8/f32 ≤ 0.5, B=1 i8/f32 ≤ 1.

Then the accuracy of the logits: real final hidden states of the model (a token at position 0 run
through every layer in float64 — at position 0 attention returns the token's own V — then the final
RMS norm) times the output matrix, linear_batch_i8 and linear_batch vs float64.
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

from shared.config import EngineSection  # noqa: E402
from worker.engine.engine import load_engine  # noqa: E402
from worker.engine.kernels.matmul_batch import batch_scratch, linear_batch  # noqa: E402
from worker.engine.kernels.matmul_i8 import (ISA, batch_scratch_i8, linear_batch_i8,  # noqa: E402
                                               quantize_reference)  # noqa: E402
from worker.engine.kernels.packing import M_K, M_TILES, TILE  # noqa: E402
from worker.engine.quants import dequantize  # noqa: E402

MODEL = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser() / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
Q, K, V, O, GATE, UP, DOWN = range(7)
KINDS = {"qkv": (Q, K, V), "o": (O,), "gateup": (GATE, UP), "down": (DOWN,)}


def step_calls(w):
    """{kind: [mats array per call]} for one decode step."""
    calls = {kind: [np.array([w.mats[layer, c] for c in cols]) for layer in range(w.mats.shape[0])]
             for kind, cols in KINDS.items()}
    calls["output"] = [np.array([w.output])]
    return calls


def hidden_states(e, tokens):
    """Final normed hidden states (len(tokens), d) of tokens at position 0, in float64."""
    w, hp = e.model.w, e.model.hp
    dense = {}

    def mat(i):
        if i not in dense:
            t = w.tensors[i]
            dense[i] = dequantize(t.raw, t.qtype).astype(np.float64)
        return dense[i]

    def rms(x, gain):
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + hp.rms_eps) * gain

    x = w.embed(tokens, mat).astype(np.float64)
    group = hp.n_heads // hp.n_kv_heads
    for layer in range(hp.n_layers):
        m = w.mats[layer]
        h = rms(x, w.vectors["attn_norm"][layer])
        v = (h @ mat(m[V]).T).reshape(len(tokens), hp.n_kv_heads, hp.head_dim)
        a = np.repeat(v, group, axis=1).reshape(len(tokens), -1)  # one key: softmax = 1
        x = x + a @ mat(m[O]).T
        h = rms(x, w.vectors["ffn_norm"][layer])
        g, u = h @ mat(m[GATE]).T, h @ mat(m[UP]).T
        x = x + (g / (1 + np.exp(-g)) * u) @ mat(m[DOWN]).T
    return rms(x, w.output_norm), mat(w.output)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--model", default=str(MODEL))
    args = ap.parse_args()
    e = load_engine(args.model, progress=lambda m: None)
    w = e.model.w
    t = w.table
    # Each kernel reads the code layout of its numerics (packing.LAYOUT_*): one table per kernel.
    t32 = load_engine(args.model, EngineSection(matmul_activations="float32"), progress=lambda m: None).model.w.table
    tabs = {linear_batch: (t32.data, t32.scales, t32.scales16, t32.meta),
            linear_batch_i8: (t.data, t.scales, t.scales16, t.meta)}
    calls = step_calls(w)
    b_max = max(args.batches)
    width = max(sum(int(t.meta[i, M_TILES]) for i in c[0]) for c in calls.values()) * TILE
    k_max = max(int(t.meta[c[0][0], M_K]) for c in calls.values())
    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((b_max, k)).astype(np.float32)
          for k in {int(t.meta[c[0][0], M_K]) for c in calls.values()}}
    out = np.zeros((b_max, width), np.float32)
    s_f32 = batch_scratch(width // TILE, b_max, k_max)
    s_i8 = batch_scratch_i8(width // TILE, b_max, k_max)
    print(f"int8 dot products: {ISA}; kernels per step: "
          + ", ".join(f"{k}×{len(v)}" for k, v in calls.items()))
    print(f"{'thr':>3} {'B':>3} {'kernel':6} " + " ".join(f"{k:>8}" for k in calls) + f" {'step µs':>9} "
          f"{'i8/f32':>7} {'vs@1':>6}")
    for threads in args.threads:
        numba.set_num_threads(threads)
        base1 = None
        for b in args.batches:
            x = {k: np.ascontiguousarray(v[:b]) for k, v in xs.items()}

            def run(fn, scratch, kind):
                for mats in calls[kind]:
                    fn(*tabs[fn], mats, x[int(t.meta[mats[0], M_K])], out, scratch)

            samples = {(f, k): [] for f in ("f32", "i8") for k in calls}
            for f, fn, s in (("f32", linear_batch, s_f32), ("i8", linear_batch_i8, s_i8)):
                for kind in calls:
                    run(fn, s, kind)  # compile / warm
            for _ in range(args.repeats):
                for kind in calls:
                    for f, fn, s in (("f32", linear_batch, s_f32), ("i8", linear_batch_i8, s_i8)):
                        t0 = time.perf_counter()
                        run(fn, s, kind)
                        samples[f, kind].append((time.perf_counter() - t0) * 1e6)
            med = {key: statistics.median(v) for key, v in samples.items()}
            total = {f: sum(med[f, k] for k in calls) for f in ("f32", "i8")}
            if b == 1 or base1 is None:
                base1 = total["f32"] if b == 1 else None
            for f in ("f32", "i8"):
                ratio = f"{total[f] / total['f32']:7.2f}" if f == "i8" else " " * 7
                vs1 = f"{total[f] / base1:6.2f}" if base1 else ""
                print(f"{threads:>3} {b:>3} {f:6} " + " ".join(f"{med[f, k]:8.0f}" for k in calls)
                      + f" {total[f]:9.0f} {ratio} {vs1}", flush=True)

    tokens = np.array([1, 28, 504, 2399, 5063, 17, 330, 1900, 12000, 40000])
    tokens = tokens[tokens < e.model.hp.vocab_size]
    h, wout = hidden_states(e, tokens)
    exact = h @ wout.T
    n = wout.shape[0]
    x = np.ascontiguousarray(h.astype(np.float32))
    q, d = quantize_reference(x)
    x_hat = (q.reshape(len(x), -1, 32) * d[:, :, None].astype(np.float64)).reshape(x.shape)
    with_x_hat = x_hat @ wout.T
    err = np.abs(x_hat - h).max(axis=1) / np.abs(h).max(axis=1)
    print(f"activation quantization: max |x̂ - x| / max |x| per row: max {err.max():.2e}; "
          f"float64 logits of x̂ vs x: max |err| / max |logit| {(np.abs(with_x_hat - exact).max(axis=1) / np.abs(exact).max(axis=1)).max():.2e}")
    mats = np.array([w.output])
    rows = int(t.meta[w.output, M_TILES]) * TILE
    for name, fn, scratch in (("linear_batch", linear_batch, batch_scratch(rows // TILE, len(x), x.shape[1])),
                              ("linear_batch_i8", linear_batch_i8, batch_scratch_i8(rows // TILE, len(x), x.shape[1]))):
        got = np.zeros((len(x), rows), np.float32)
        fn(*tabs[fn], mats, x, got, scratch)
        err = np.abs(got[:, :n] - exact).max(axis=1) / np.abs(exact).max(axis=1)
        same_top = np.mean(got[:, :n].argmax(axis=1) == exact.argmax(axis=1))
        print(f"logits {name:16}: max |err| / max |logit| per row: max {err.max():.2e}, median "
              f"{np.median(err):.2e}; argmax agrees on {same_top:.0%} of {len(x)} hidden states")
        if fn is linear_batch_i8:
            err = np.abs(got[:, :n] - with_x_hat).max(axis=1) / np.abs(with_x_hat).max(axis=1)
            print(f"logits {name:16} vs float64 with x̂ (the kernel's own quantized x): max {err.max():.2e}")


if __name__ == "__main__":
    main()
