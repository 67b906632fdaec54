"""Kernel variants and the kernel tuner: per variant x threads x rows bucket timings, end-to-end
decode and prefill for the fixed default table vs the tuned one, and a busy-neighbour curve.

    python bench/kernels.py [--model smollm2-135m] [--threads 2] [--runs 3]
    python bench/kernels.py --neighbour [--seconds 90] [--png kernels-neighbour.png]

Variants: one layer's matmuls (Q/K/V, gate/up, down) per call (engine.time_matmul), microseconds
per row, median of --runs. End to end: the serving loop with one request (512-token prompt in
one chunk, then 128 decode tokens), fixed and tuned runs alternating in one process, medians.
--neighbour: decode without pause for --seconds, first with the fixed table, then with the tuner;
a CPU-bound process pinned to core 0 runs for the middle third. Prints tok/s per window and
writes a PNG. Not a test: the host is shared and noisy, compare only within one run.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import blas_env  # noqa: E402

blas_env.prefer_native_blas()  # before numpy loads OpenBLAS

import numpy as np  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
PROMPT_TOKENS, DECODE_TOKENS = 512, 128
BIN_S = 3.0  # seconds per point of the neighbour curve


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def isa() -> str:
    from worker.engine.kernels import matmul_i8
    return {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}.get(matmul_i8.ISA, "generic (no AVX2)")


def load(model: str, threads: int):
    from shared.config import EngineSection
    from shared.model_store import ensure_model
    from worker.engine.engine import load_engine
    path = ensure_model(model, MODELS_DIR, progress=say)
    engine = load_engine(path, EngineSection(threads=threads, context_length=2048), progress=say)
    return engine


def fixed_state(engine, table, threads: int):
    """Put the engine back on the shipped default (what `kernels = fixed` runs)."""
    engine.ops = table
    engine.set_threads(threads)


# ---- per variant x bucket -----------------------------------------------------------------------

def variant_table(engine, threads: int, runs: int) -> dict:
    from worker.engine.kernels.registry import BUCKET_NAMES, OpTable, serves_bucket, variants_of
    from worker.engine.tuning.kernel_tuner import CALIBRATION_ROWS
    numerics = engine.ops.numerics("matmul")
    # The weights are packed in the layout of the engine's numerics: only its variants can run.
    arms = [(v, t) for v in variants_of("matmul", numerics) for t in range(threads, 0, -1)]
    # A variant below its min_rows runs as another one does: its cell would time the same code twice.
    served = {arm: [b for b in range(len(BUCKET_NAMES)) if serves_bucket(variants_of("matmul")[arm[0]], b)]
              for arm in arms}
    timings = {arm: {b: [] for b in served[arm]} for arm in arms}
    for run in range(runs):
        # Each run starts at another arm. In one fixed order, on a Zen 1 host, int8_blocked (timed
        # last) read 13-22% faster than int8 (first) below 33 rows, where it runs int8's code.
        for arm in arms[run % len(arms):] + arms[:run % len(arms)]:
            engine.set_threads(arm[1])
            table = OpTable.of(matmul=arm[0])
            for b in served[arm]:
                rows = CALIBRATION_ROWS[b]
                engine.time_matmul(table, rows, repeats=1)
                timings[arm][b].append(engine.time_matmul(table, rows, repeats=5) / rows)
        say(f"  variants: run {run + 1}/{runs}")
    engine.set_threads(threads)
    med = {arm: {b: statistics.median(v) for b, v in per.items()} for arm, per in timings.items()}
    default = (engine.ops.names("matmul")[0], threads)
    print(f"\none layer's matmuls (Q/K/V, gate/up, down), us per row, median of {runs}; {isa()}, "
          f"default {default[0]} x {threads} threads ('-': runs as another variant there)")
    header = f"{'variant':<16} {'thr':>3} {'numerics':<8} " + " ".join(f"{b + ' rows':>11}" for b in BUCKET_NAMES)
    print(header)
    print("-" * len(header))
    for arm in arms:
        kind = variants_of("matmul")[arm[0]].numerics
        cells = (f"{1e6 * med[arm][b]:>11.1f}" if b in med[arm] else f"{'-':>11}" for b in range(len(BUCKET_NAMES)))
        print(f"{arm[0]:<16} {arm[1]:>3} {kind:<8} " + " ".join(cells))
    print("best of the engine's numerics (" + numerics + ") per bucket, vs the default:")
    for b, name in enumerate(BUCKET_NAMES):
        best = min((a for a in arms if b in med[a]), key=lambda a: med[a][b])
        print(f"  {name:>5} rows: {best[0]} x {best[1]}t {1e6 * med[best][b]:.1f} us/row, default "
              f"{1e6 * med[default][b]:.1f} ({med[default][b] / med[best][b]:.2f}x)")
    return med


# ---- end to end ---------------------------------------------------------------------------------

def end_to_end(engine, threads: int, runs: int) -> None:
    from shared.sampling import SamplingParams
    from worker.engine.tuning.kernel_tuner import FixedKernels, KernelTuner, TunerSettings, arm_name
    from worker.sched.one_request import Timing, generate_one, solo_generator
    from worker.sched.tuning_state import SchedulerKnobs

    default = engine.ops
    generator = solo_generator(engine, SchedulerKnobs(prefill_chunk=PROMPT_TOKENS, token_budget=PROMPT_TOKENS))
    ids = np.random.default_rng(0).integers(100, min(engine.vocab_size, 30000), PROMPT_TOKENS).tolist()
    params = SamplingParams(max_tokens=DECODE_TOKENS + 1, temperature=0.0)
    tuner = KernelTuner(engine, TunerSettings(explore_share=0.05))
    t0 = time.perf_counter()
    tuner.calibrate(15.0)
    say(f"  calibration: {time.perf_counter() - t0:.1f} s")

    def one(mode: str) -> tuple[float, float]:
        if mode == "fixed":
            generator.kernel_tuner = FixedKernels()
            fixed_state(engine, default, threads)
        else:
            generator.kernel_tuner = tuner
        t = Timing()
        for _ in generate_one(generator, ids, params, timing=t):
            pass
        return t.prefill_tokens / t.prefill_s, t.decode_tokens / t.decode_s

    for i in range(2):  # the tuner learns on real steps first (and the fused steps are compiled: both tables)
        p, d = one("tuned")
        say(f"  tuned warm-up {i + 1}/2: prefill {p:.0f} tok/s, decode {d:.1f} tok/s")
    results = {"fixed": [], "tuned": []}
    for run in range(runs):
        for mode in ("fixed", "tuned"):
            results[mode].append(one(mode))
            say(f"  {mode} run {run + 1}/{runs}: prefill {results[mode][-1][0]:.0f} tok/s, "
                f"decode {results[mode][-1][1]:.1f} tok/s")
    fixed_state(engine, default, threads)
    med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for m, v in results.items()}
    print(f"\nend to end, prompt {PROMPT_TOKENS} tokens, decode {DECODE_TOKENS}, {threads} threads, median of "
          f"{runs} (alternating); {isa()}")
    print(f"{'table':<8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for mode, (p, d) in med.items():
        print(f"{mode:<8} {p:>14.0f} {d:>13.1f}")
    (tp, td), (fp, fd) = med["tuned"], med["fixed"]
    print(f"tuned/fixed: prefill {tp / fp:.2f}x, decode {td / fd:.2f}x")
    print("tuned choices: " + ", ".join(f"{b}: {arm_name(arm)}" for b, arm in tuner.choices().items()))


# ---- busy neighbour -----------------------------------------------------------------------------

_BUSY = "import os, time\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


def decode_curve(engine, generator, seconds: float) -> list[float]:
    """Decode without pause for `seconds` (requests of 256 tokens back to back); a busy process on
    core 0 for the middle third. Token timestamps, relative to the start."""
    from shared.sampling import SamplingParams
    from worker.sched.generation import TokenEvent
    stamps, started, neighbour, n = [], time.perf_counter(), None, 0
    params = SamplingParams(max_tokens=256, temperature=0.0)
    try:
        while (now := time.perf_counter() - started) < seconds:
            if neighbour is None and seconds / 3 <= now < 2 * seconds / 3:
                neighbour = subprocess.Popen([sys.executable, "-c", _BUSY])
            elif neighbour is not None and now >= 2 * seconds / 3 and neighbour.poll() is None:
                neighbour.kill()
                neighbour.wait()
            if not generator.has_work:
                n += 1
                generator.add(f"curve-{n}", [1, 2, 3, 4, 5, 6, 7, 8], params)
            for event in generator.step():
                if isinstance(event, TokenEvent):
                    stamps.append(time.perf_counter() - started)
    finally:
        if neighbour is not None and neighbour.poll() is None:
            neighbour.kill()
            neighbour.wait()
    return stamps


def neighbour(engine, threads: int, seconds: float, png: str) -> None:
    from worker.engine.tuning.kernel_tuner import FixedKernels, KernelTuner, TunerSettings
    from worker.sched.one_request import solo_generator
    default = engine.ops
    generator = solo_generator(engine)
    curves = {}
    for mode in ("fixed", "adaptive"):
        if mode == "fixed":
            generator.kernel_tuner = FixedKernels()
            fixed_state(engine, default, threads)
        else:
            fixed_state(engine, default, threads)
            generator.kernel_tuner = KernelTuner(engine, TunerSettings())  # reame.conf's defaults, no calibration
        say(f"  {mode}: decoding for {seconds:.0f} s, neighbour on core 0 from {seconds / 3:.0f} to "
            f"{2 * seconds / 3:.0f} s")
        curves[mode] = decode_curve(engine, generator, seconds)
        if mode == "adaptive":
            for e in generator.kernel_tuner.events:
                say(f"    {e}")
    fixed_state(engine, default, threads)
    bins = np.arange(0.0, seconds + 1e-9, BIN_S)
    rates = {m: np.histogram(s, bins)[0] / BIN_S for m, s in curves.items()}
    mid = (bins[:-1] + bins[1:]) / 2
    lo, hi = seconds / 3, 2 * seconds / 3
    print(f"\ndecode tok/s over time, {threads} threads, busy neighbour on core 0 from {lo:.0f} to {hi:.0f} s; {isa()}")
    print(f"{'t (s)':>6} {'fixed':>8} {'adaptive':>9}")
    for i, t in enumerate(mid):
        mark = " *" if lo <= t < hi else ""
        print(f"{t:>6.1f} {rates['fixed'][i]:>8.1f} {rates['adaptive'][i]:>9.1f}{mark}")

    def tok_s(stamps, a, b):
        return sum(1 for s in stamps if a <= s < b) / (b - a)

    q, n, a = ((0.0, lo), (lo, hi), (hi, seconds))
    for name, (x, y) in (("before", q), ("neighbour", n), ("after", a)):
        f, d = tok_s(curves["fixed"], x, y), tok_s(curves["adaptive"], x, y)
        print(f"{name:<10} fixed {f:7.1f} tok/s, adaptive {d:7.1f} tok/s, adaptive/fixed {d / f:.2f}x")
    before = tok_s(curves["adaptive"], *q)
    back = next((t for t, r in zip(mid, rates["adaptive"]) if t > hi and r >= 0.9 * before), None)
    print("adaptive back to 90% of its pre-neighbour rate: "
          + (f"{back - hi:.0f} s after the neighbour stopped" if back is not None else "not within the run"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, r in rates.items():
        ax.plot(mid, r, marker="o", label=mode)
    ax.axvspan(lo, hi, color="grey", alpha=0.2, label="neighbour on core 0")
    ax.set_xlabel("seconds")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"Reame decode, {threads} threads, {isa()}: fixed table vs kernel tuner")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"curve: {png}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--neighbour", action="store_true", help="the busy-neighbour curve instead of the tables")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--png", default="kernels-neighbour.png")
    parser.add_argument("--skip-variants", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("reame.kernel_tuner").setLevel(logging.INFO)  # promotions, rollbacks, calibration
    engine = load(args.model, args.threads)
    if args.neighbour:
        neighbour(engine, args.threads, args.seconds, args.png)
        return 0
    if not args.skip_variants:
        variant_table(engine, args.threads, args.runs)
    end_to_end(engine, args.threads, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
