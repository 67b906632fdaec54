"""Engine benchmark: prefill of a 512-token prompt and decode of 128 tokens, per thread count,
beside llama.cpp (through llama-cpp-python) on the same file when it is installed.

    python bench/engine.py [--models smollm2-135m gemma3-270m] [--threads 1 2] [--runs 3]
                           [--peer-bench PATH/TO/llama-bench]
                           [--prompt-tokens 512 2048] [--kv-dtype float16|q8_0] [--matmul-tiles auto|off]

Prompts longer than 512 tokens go in 512-token chunks (the server's default prefill_chunk, and
llama.cpp's n_batch here); the table then also gives each length's prefill rate as a share of the
first length's (long-context attention is what makes it drop).

Prints medians of --runs runs and the ratio to the peer, then each row beside the host's bounds,
both measured in the same run: decode against the read rate (packed weight bytes a token / GB/s),
prefill against the int8 multiply-add peak of the instructions the kernels use
(bench/int8_peak.py; "-" on hosts without AVX2, where there is none). Each (engine, model,
threads) runs in its own process, so neither thread pool outlives its measurement and disturbs the
next one.
Not a test: machines are shared and noisy, so read ratios from one run, not absolute numbers
across runs.

--peer-bench runs the native llama-bench instead, in the same run as Reame's measurement: prefill
`-p N -n 0` and decode `-p 0 -n 128 -d N` (its decode after N tokens of context, as Reame's follows
the prompt: from an empty context its decode skips the attention a server's requests pay), each
`-r RUNS -o json`, its mean tokens/s. --kv-dtype q8_0 gives both sides a q8_0 K/V cache (`[engine]
kv_dtype`; llama-bench's `-ctk q8_0 -ctv q8_0`, flash attention left at its default, auto, which
its quantized V cache needs and the CPU back end has).

The peer without a pip build of llama-cpp-python: its Python package from the sdist plus a
llama.cpp built natively (cmake -DGGML_NATIVE=ON) are enough:
    LLAMA_CPP_LIB_PATH=SDIST/vendor/llama.cpp/build/bin PYTHONPATH=SDIST:DIR_WITH_diskcache \
        python bench/engine.py ...
"""
from __future__ import annotations

import argparse
import json
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

PROMPT_CHUNK, DECODE_TOKENS = 512, 128
# Past this many tokens llama-bench runs without its warm-up: the warm-up repeats the whole prompt
# (at 32k tokens on 2 cores, 10-20 minutes), and one more run changes nothing a run that long measures.
LONG_PROMPT = 8192
MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompt_ids(vocab: int, tokens: int) -> list[int]:
    return np.random.default_rng(0).integers(100, min(vocab, 30000), tokens).tolist()


def context_for(tokens: int) -> int:
    """KV positions a run needs (prompt, decode and a margin), rounded up to 1,024."""
    return -(-(tokens + DECODE_TOKENS + 16) // 1024) * 1024


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """The host's read bandwidth in GB/s on numba's threads: the best of `repeats` parallel sums
    over an array far larger than the caches. Decode reads every weight once a token, so
    weight bytes / this is its bound."""
    import numba

    # fastmath: without it the float reduction is strictly ordered, one dependent add an element,
    # and the sum measured the adder's latency (10.3 GB/s on 12-06 while decode streamed 23.8).
    @numba.njit(parallel=True, cache=False, fastmath=True)
    def total(a):
        s = np.float32(0.0)  # float32 like the array: no conversion in the loop
        for i in numba.prange(a.size):
            s += a[i]
        return s

    a = np.ones(megabytes * 2**20 // 4, np.float32)
    total(a[:1024])  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def matmul_work(engine) -> tuple[int, int]:
    """(bytes of packed weights a decoded token's matmuls read: every layer matrix and the output
    projection (the embedding is a row lookup unless tied); multiply-adds a prompt token does in
    matmuls: the layers' only, as a prompt's logits are computed for its last token alone (the 1.5B
    file's output projection is 233 M multiply-adds, 15% of a token's, once per prompt))."""
    from worker.engine.kernels.packing import M_K, M_N
    w = engine.model.w
    layers = [int(i) for i in w.mats.ravel()]
    table = w.table
    size = lambda i: int(table.meta[i, M_N]) * int(table.meta[i, M_K])  # noqa: E731
    # The table's bytes in proportion to the matrices' weights (scales ride with their codes).
    weights = sum(size(i) for i in range(len(table.meta)))
    decode_weights = sum(size(i) for i in layers + [w.output])
    return int(table.nbytes * decode_weights / weights), sum(size(i) for i in layers)


PEER_CACHE_TYPES = {"float16": "f16", "q8_0": "q8_0"}  # [engine] kv_dtype -> llama-bench's -ctk/-ctv


def bench_reame(path: Path, threads: int, runs: int, tokens: int,
                kv_dtype: str = "float16", tiles: str = "auto") -> tuple[float, float, int, int, float]:
    import numba
    from threadpoolctl import threadpool_limits

    from shared.config import EngineSection
    from shared.sampling import SamplingParams
    from worker.engine.engine import load_engine
    from worker.sched.one_request import Timing, generate_ids, generate_one, solo_generator
    from worker.sched.tuning_state import SchedulerKnobs

    engine = load_engine(path, EngineSection(threads=threads, context_length=context_for(tokens), kv_dtype=kv_dtype,
                                             matmul_tiles=tiles), progress=say)
    numba.set_num_threads(threads)
    ids = prompt_ids(engine.vocab_size, tokens)
    params = SamplingParams(max_tokens=DECODE_TOKENS + 1, temperature=0.0)
    prefill, decode = [], []
    with threadpool_limits(limits=threads, user_api="blas"):
        # The serving loop with one request; prompt chunks as large as the whole prompt, as
        # llama-bench's 512-token batch is.
        generator = solo_generator(engine, SchedulerKnobs(prefill_chunk=PROMPT_CHUNK, token_budget=PROMPT_CHUNK))
        generate_ids(generator, [0], 2)  # compile or load every kernel first
        for run in range(runs):
            t = Timing()
            for _ in generate_one(generator, ids, params, timing=t):
                pass
            prefill.append(t.prefill_tokens / t.prefill_s)
            decode.append(t.decode_tokens / t.decode_s)  # the first token comes from prefill
            say(f"  reame {threads}t run {run + 1}/{runs}: prefill {prefill[-1]:.0f} tok/s, decode {decode[-1]:.1f} tok/s")
    read_bytes, macs = matmul_work(engine)
    return statistics.median(prefill), statistics.median(decode), read_bytes, macs, read_bandwidth()


def bench_llama_cpp(path: Path, threads: int, runs: int, tokens: int,
                    kv_dtype: str = "float16") -> tuple[float, float] | None:
    if kv_dtype != "float16":
        raise SystemExit("--kv-dtype other than float16 needs the native peer (--peer-bench)")
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=context_for(tokens), n_batch=PROMPT_CHUNK, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    ids = prompt_ids(llm.n_vocab(), tokens)
    # llama-cpp-python keeps no logits unless logits_all; read the last token's from the context.
    last_logits = lambda: np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # noqa: E731
    prefill, decode = [], []
    for run in range(runs):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill.append(len(ids) / (time.perf_counter() - t0))
        token = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
        decode.append(DECODE_TOKENS / (time.perf_counter() - t0))
        say(f"  llama.cpp {threads}t run {run + 1}/{runs}: prefill {prefill[-1]:.0f} tok/s, decode {decode[-1]:.1f} tok/s")
    return statistics.median(prefill), statistics.median(decode)


def bench_llama_bench(binary: Path, path: Path, threads: int, runs: int, tokens: int,
                      kv_dtype: str = "float16") -> tuple[float, float]:
    """(prefill, decode) tokens/s of the native llama-bench on the same file and thread count; the
    prompt goes in batches of PROMPT_CHUNK tokens, as Reame's does."""
    rate = {}
    for kind, test in (("prefill", ["-p", str(tokens), "-n", "0"]),
                       ("decode", ["-p", "0", "-n", str(DECODE_TOKENS), "-d", str(tokens)])):
        cmd = [str(binary), "-m", str(path), "-t", str(threads), *test, "-b", str(PROMPT_CHUNK),
               "-ub", str(PROMPT_CHUNK), "-ctk", PEER_CACHE_TYPES[kv_dtype], "-ctv", PEER_CACHE_TYPES[kv_dtype],
               "-r", str(runs), "-o", "json"]
        if tokens > LONG_PROMPT:
            cmd.append("--no-warmup")
        say("  " + " ".join(cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"llama-bench failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        rate[kind] = float(json.loads(proc.stdout)[0]["avg_ts"])
    say(f"  llama-bench {threads}t: prefill {rate['prefill']:.0f} tok/s, decode {rate['decode']:.1f} tok/s")
    return rate["prefill"], rate["decode"]


def environment() -> str:
    import numba
    from threadpoolctl import threadpool_info
    blas = next((i for i in threadpool_info() if i.get("user_api") == "blas"), {})
    numba.njit(parallel=True)(lambda a: a.sum())(np.ones(4))  # start the layer so it can be named
    return (f"BLAS: {blas.get('internal_api', '?')} {blas.get('version', '')} ({blas.get('architecture', '?')} kernels); "
            f"numba {numba.__version__}, threading layer {numba.threading_layer()}")


def measure_in_subprocess(engine: str, path: Path, threads: int, runs: int, tokens: int, kv_dtype: str,
                          tiles: str = "auto"):
    """One measurement in a fresh process; (prefill, decode) medians, or None (peer missing)."""
    proc = subprocess.run([sys.executable, __file__, "--one", engine, str(path), str(threads), str(runs), str(tokens),
                           kv_dtype, tiles], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} benchmark failed (exit {proc.returncode})")
    result = json.loads(proc.stdout)
    return tuple(result) if result else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--peer-bench", type=Path, help="the native llama-bench binary to run as the peer")
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[512], help="prompt lengths to prefill")
    parser.add_argument("--no-peer", action="store_true", help="measure Reame only")
    parser.add_argument("--kv-dtype", choices=tuple(PEER_CACHE_TYPES), default="float16",
                        help="the K/V cache's element type, on both sides (default float16)")
    parser.add_argument("--matmul-tiles", choices=("auto", "off"), default="auto",
                        help="[engine] matmul_tiles: prompt chunks on AMX tiles where the host has them, or not")
    parser.add_argument("--one", nargs=7, metavar=("ENGINE", "PATH", "THREADS", "RUNS", "TOKENS", "KV_DTYPE", "TILES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        engine, path, threads, runs, tokens, kv_dtype, tiles = args.one
        if engine == "reame":
            print(json.dumps(bench_reame(Path(path), int(threads), int(runs), int(tokens), kv_dtype, tiles)))
        else:
            print(json.dumps(bench_llama_cpp(Path(path), int(threads), int(runs), int(tokens), kv_dtype)))
        return 0
    if any(n < 1 for n in args.prompt_tokens):
        parser.error("--prompt-tokens: every length must be >= 1")

    from shared.model_store import ensure_model
    rows = []
    for name in args.models:
        path = ensure_model(name, MODELS_DIR, progress=say)
        for threads in args.threads:
            for tokens in args.prompt_tokens:
                say(f"{name}, {threads} thread(s), {tokens}-token prompt")
                ours = measure_in_subprocess("reame", path, threads, args.runs, tokens, args.kv_dtype,
                                             args.matmul_tiles)
                if args.no_peer:
                    peer = None
                elif args.peer_bench:
                    peer = bench_llama_bench(args.peer_bench, path, threads, args.runs, tokens, args.kv_dtype)
                else:
                    peer = measure_in_subprocess("llama.cpp", path, threads, args.runs, tokens, args.kv_dtype)
                rows.append((name, threads, tokens, ours, peer))

    print(f"\nprompts {', '.join(map(str, args.prompt_tokens))} tokens (chunks of {PROMPT_CHUNK}), "
          f"decode {DECODE_TOKENS} tokens, median of {args.runs} runs, K/V cache {args.kv_dtype}")
    print(environment())
    print(blas_env.describe())
    peer_note = "" if any(r[4] for r in rows) else " (not run or llama-cpp-python not installed: no peer numbers)"
    peer_name = f"native {args.peer_bench}" if args.peer_bench else "llama.cpp through llama-cpp-python"
    print(f"peer: {peer_name}{peer_note}\n")
    header = (f"{'model':<14} {'thr':>3} {'prompt':>6} {'prefill tok/s':>14} {'vs first':>8} {'peer':>8} {'ratio':>6} "
              f"{'decode tok/s':>13} {'peer':>8} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    first_rate = {}
    for name, threads, tokens, (p, d, *_), peer in rows:
        pp, pd = peer if peer else (None, None)
        base = first_rate.setdefault((name, threads), p)
        fmt = lambda v, spec: format(v, spec) if v else "-"
        print(f"{name:<14} {threads:>3} {tokens:>6} {p:>14.0f} {p / base:>8.2f} {fmt(pp, '8.0f'):>8} "
              f"{fmt(pp and p / pp, '6.2f'):>6} {d:>13.1f} {fmt(pd, '8.1f'):>8} {fmt(pd and d / pd, '6.2f'):>6}")
    print_bounds(rows, args.matmul_tiles)
    return 0


def print_bounds(rows, tiles_setting: str = "auto") -> None:
    """Decode beside the bandwidth bound (every matmul weight read once a token, at the host's read
    bandwidth measured in the same process) and prefill's achieved matmul GFLOP/s beside the host's
    int8 peak (bench/int8_peak.py, measured here after every measurement, on as many threads)."""
    from int8_peak import ISA, amx_peak, int8_peak  # bench/, the script's directory, is on sys.path
    thread_counts = sorted({row[1] for row in rows})
    # On an AMX host prompt chunks run on tiles (matmul_amx) unless --matmul-tiles off: their
    # peak is then the bound.
    tiles = {threads: amx_peak(threads) if tiles_setting == "auto" else None for threads in thread_counts}
    isa = "AMX tdpbssd (16x16x32 tiles)" if tiles[thread_counts[0]] else ISA
    peaks = tiles if tiles[thread_counts[0]] else {threads: int8_peak(threads) for threads in thread_counts}
    print("\nbounds: decode reads the packed matmul weights once a token; prefill's FLOPs are its layers' "
          f"matmuls', against the host's {isa} int8 multiply-add peak")
    header = (f"{'model':<14} {'thr':>3} {'prompt':>6} {'weights MB':>10} {'read GB/s':>9} {'decode GB/s':>11} "
              f"{'bound tok/s':>11} {'of bound':>8} {'prefill GFLOP/s':>15} {'peak GFLOP/s':>12} {'of peak':>7}")
    print(header)
    print("-" * len(header))
    for name, threads, tokens, (p, d, read_bytes, macs, gbps), _peer in rows:
        bound = gbps * 1e9 / read_bytes
        flops, peak = 2 * macs * p / 1e9, peaks[threads] and 2 * peaks[threads]
        print(f"{name:<14} {threads:>3} {tokens:>6} {read_bytes / 1e6:>10.0f} {gbps:>9.1f} "
              f"{d * read_bytes / 1e9:>11.1f} {bound:>11.1f} {d / bound:>8.0%} {flops:>15.1f} "
              f"{format(peak, '.0f') if peak else '-':>12} {format(flops / peak, '.0%') if peak else '-':>7}")


if __name__ == "__main__":
    sys.exit(main())
