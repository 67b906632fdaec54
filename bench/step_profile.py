"""Where a decode step's time goes, by phase, at 1 and 8 (or --streams) concurrent sequences.

    python bench/step_profile.py [--model smollm2-135m] [--threads 2] [--streams 1,8]
                                 [--steps 48] [--prompt-tokens 70]

Drives the worker's own generation loop (`BatchGenerator.step`, as the service does) with N greedy
requests that never end early, and times each decode step's phases:

  engine: numba   the fused forward (`model.forward_rows`), split once more after the loop by
                  re-running its parts alone on the last step's rows: matmuls of every layer,
                  attention (read-only, layer after layer over the same blocks), output
                  projection over the vocabulary, and the rest (embed, norms, RoPE, K/V stores)
  engine: python  `Engine.execute` around it (row arrays, logits handed back)
  sampling        `Sampler.sample` of every row
  scheduler       `Scheduler.schedule` + `update` and the step's chunk list
  step: other     the rest of `BatchGenerator.step` (events, bookkeeping)
  message encode  the worker's messages of the step (`WorkerService._messages_of` + encode)
  gateway         what the gateway does per token on the same cores: decode the frame,
                  detokenize (StreamDecoder), scan for stop strings (StopMatcher)

Prints ms per step (median over --steps decode steps), the share of the step, and the tokens/s
that the step time allows. Machines are shared and noisy: compare phases within one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from shared import blas_env  # noqa: E402

blas_env.prefer_native_blas()  # before numpy loads OpenBLAS

import numpy as np  # noqa: E402

from benchlib import say  # noqa: E402  (bench/, the script's directory, is on sys.path)

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()


class PhaseClock:
    """Seconds per phase within the current step; `close_step` files them away."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t0
        return wrapper

    def close_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def median(self, phase: str) -> float:
        return statistics.median(s.get(phase, 0.0) for s in self.steps)


def profile_level(engine, tokenizer, streams: int, steps: int, prompt_tokens: int) -> tuple[dict, int]:
    """Phase medians (seconds per decode step) of `streams` sequences decoding together, and the
    rows of the last step."""
    from gateway.stops import StopMatcher
    from gateway.tokenizer.stream import StreamDecoder
    from shared import protocol
    from shared.sampling import SamplingParams
    from worker.sched import sampler as sampler_module
    from worker.sched.generation import BatchGenerator, TokenEvent
    from worker.sched.tuning_state import SchedulerKnobs, TuningState
    from worker.service import WorkerService

    clock = PhaseClock()
    knobs = SchedulerKnobs(batching_window_ms=0.0, max_batch_size=max(streams, SchedulerKnobs().max_batch_size))
    generator = BatchGenerator(engine, TuningState(knobs))
    model = engine.model
    last_rows: list[tuple] = []

    def forward_rows(*args, **kwargs):
        last_rows[:] = [args]
        return original_forward(*args, **kwargs)

    original_forward = model.forward_rows
    model.forward_rows = clock.timed("engine: numba", forward_rows)
    engine.execute = clock.timed("engine: execute", engine.execute)
    generator.scheduler.schedule = clock.timed("scheduler", generator.scheduler.schedule)
    generator.scheduler.update = clock.timed("scheduler", generator.scheduler.update)
    generator._step_chunks = clock.timed("scheduler", generator._step_chunks)
    original_sample = sampler_module.Sampler.sample
    sampler_module.Sampler.sample = clock.timed("sampling", original_sample)
    service = WorkerService(generator, socket=None, info=None)
    try:
        end_ids = {tokenizer.eos_id, *tokenizer.eot_ids} - {None}
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, logit_bias={t: -100.0 for t in end_ids})
        rng = np.random.default_rng(streams)
        decoders, stops = {}, {}
        for i in range(streams):
            prompt = rng.integers(100, min(engine.vocab_size, 30000), prompt_tokens).tolist()
            generator.add(f"r{i}", prompt, params)
            decoders[f"r{i}"] = StreamDecoder(tokenizer)
            stops[f"r{i}"] = StopMatcher(["\n\n\n", "</s>"])
        while generator.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in generator.scheduler.running):
            generator.step()
            clock.close_step(False)
        for n in range(steps):
            t0 = time.perf_counter()
            events = generator.step()
            clock.current["step"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            frames = [protocol.encode(m) for m in service._messages_of(events)]
            clock.current["message encode"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            for frame in frames:
                message = protocol.decode(frame)
                if not isinstance(message, protocol.TokenChunk):  # a warm-up request that finished
                    continue
                for token in message.tokens:
                    stops[message.request_id].push(decoders[message.request_id].push(token))
            clock.current["gateway: decode+detok+stops"] += time.perf_counter() - t0
            tokens = sum(1 for e in events if isinstance(e, TokenEvent))
            clock.current["tokens"] = tokens
            clock.close_step(tokens == streams)  # keep only plain decode steps of every stream
            if n and n % 16 == 0:
                say(f"  {streams} streams: {n}/{steps} steps")
    finally:
        sampler_module.Sampler.sample = original_sample
        model.forward_rows = original_forward
        del engine.execute
        generator.abort_all()
    phases = {p: clock.median(p) for p in ("step", "engine: execute", "engine: numba", "sampling", "scheduler",
                                           "message encode", "gateway: decode+detok+stops")}
    phases.update(numba_split(engine, last_rows[0], phases["engine: numba"]))
    return phases, len(clock.steps)


def numba_split(engine, args, numba_total: float, repeats: int = 15) -> dict[str, float]:
    """The fused step's parts, each re-run alone on the given forward_rows arguments (medians)."""
    from worker.engine.kernels.attention import paged_attention_decode
    from worker.engine.models.common import ATTN_OUT, FFN_DOWN, GATE_UP, QKV
    from worker.engine.models.decode_parts import matmul, output_logits_rows

    tokens, positions, tables, logit_rows, kv, chunk, ops = args[:7]
    model = engine.model
    rows = tokens.shape[0]
    buf = model.buffers.ensure(rows, logit_rows.shape[0])
    mm = (model.w.tab, ops, buf.scratch)
    mats = model.w.mats
    threads = engine.threads

    def layers_matmul():
        for m in mats:
            matmul(mm, m[QKV], buf.h[:rows], buf.qkv[:rows])
            matmul(mm, m[ATTN_OUT], buf.att[:rows], buf.proj[:rows])
            matmul(mm, m[GATE_UP], buf.h[:rows], buf.gu[:rows])
            matmul(mm, m[FFN_DOWN], buf.act[:rows], buf.proj[:rows])

    def attention():
        if kv.window is not None:  # window pools need their own tables: not split here
            return
        for layer in range(mats.shape[0]):
            paged_attention_decode(buf.q[:rows], kv.k, kv.v, layer, tables, positions, 0,
                                   np.float32(model.scale), chunk, buf.att[:rows], threads)

    def output():
        output_logits_rows(mm, model.w.output, model.w.output_norm, np.float32(model.hp.rms_eps), buf, logit_rows)

    out = {}
    for name, fn in (("numba: layer matmuls", layers_matmul), ("numba: attention", attention),
                     ("numba: output projection", output)):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    out["numba: rest"] = max(0.0, numba_total - sum(out.values()))
    return out


ROWS = [
    ("step", "step (BatchGenerator.step)", 0),
    ("engine: execute", "engine.execute", 1),
    ("engine: numba", "fused forward (numba)", 2),
    ("numba: layer matmuls", "layer matmuls", 3),
    ("numba: attention", "attention", 3),
    ("numba: output projection", "output projection", 3),
    ("numba: rest", "embed/norms/rope/kv store", 3),
    ("engine: python", "execute outside numba", 2),
    ("sampling", "sampling", 1),
    ("scheduler", "scheduler", 1),
    ("step: other", "step: other", 1),
    ("message encode", "message encode (worker)", 0),
    ("gateway: decode+detok+stops", "gateway decode+detok+stops", 0),
]


def print_table(levels: dict[int, dict[str, float]], title: str) -> None:
    print(f"\n{title}")
    header = f"{'phase':<34}" + "".join(f"{f'{n} stream' + ('s' if n > 1 else ''):>25}" for n in levels)
    print(header)
    print(f"{'':<34}" + "".join(f"{'ms/step  %step  us/tok':>25}" for _ in levels))
    for key, label, depth in ROWS:
        cells = []
        for n, p in levels.items():
            value = p.get(key, 0.0)
            cells.append(f"{value * 1e3:7.3f} {100 * value / p['step']:5.1f}% {1e6 * value / n:7.0f}")
        print(f"{'  ' * depth + label:<34}" + "".join(f"{c:>25}" for c in cells))
    print(f"{'tokens/s the step allows':<34}" + "".join(f"{n / p['step']:>25.0f}" for n, p in levels.items()))
    print(f"{'... with worker encode + gateway':<34}" + "".join(
        f"{n / (p['step'] + p['message encode'] + p['gateway: decode+detok+stops']):>25.0f}"
        for n, p in levels.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2,
                    help="numba threads (fixed: no kernel tuner here; on a swamped host 1 thread shows "
                         "each phase without barrier waits)")
    ap.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per level")
    ap.add_argument("--prompt-tokens", type=int, default=70)
    args = ap.parse_args()
    levels = [int(n) for n in args.streams.split(",")]

    import numba
    from threadpoolctl import threadpool_limits

    from gateway.tokenizer import Tokenizer
    from shared.config import EngineSection
    from shared.model_store import ensure_model
    from worker.engine.engine import load_engine
    from worker.engine.kernels import matmul_i8

    path = ensure_model(args.model, MODELS_DIR, progress=say)
    engine = load_engine(path, EngineSection(threads=args.threads, context_length=1024), progress=say)
    numba.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_gguf(path)
    results = {}
    with threadpool_limits(limits=args.threads, user_api="blas"):
        profile_level(engine, tokenizer, max(levels), 8, args.prompt_tokens)  # warm-up: compile every shape
        for n in levels:
            say(f"profiling {n} stream(s)")
            phases, kept = profile_level(engine, tokenizer, n, args.steps, args.prompt_tokens)
            phases["engine: python"] = phases["engine: execute"] - phases["engine: numba"]
            phases["step: other"] = (phases["step"] - phases["engine: execute"] - phases["sampling"]
                                     - phases["scheduler"])
            results[n] = phases
            say(f"  {kept} decode steps kept")
    isa = {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}.get(matmul_i8.ISA, matmul_i8.ISA)
    print(f"\nmodel {path.name}, {args.threads} threads, int8 matmuls on {isa}; load average "
          f"{os.getloadavg()[0]:.2f}; medians of {args.steps} decode steps (sub-phases: medians of their own)")
    print_table(results, "per decode step, by phase")
    if len(levels) > 1:
        a, b = levels[0], levels[-1]
        ratio = (b / results[b]["step"]) / (a / results[a]["step"])
        print(f"\n{b} streams give {ratio:.2f}x the tokens/s of {a} (step time alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
