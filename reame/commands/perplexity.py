"""`reame perplexity`: the perplexity of a text file, measured as llama.cpp's llama-perplexity
(worker/engine/perplexity.py): compare KV dtypes, kernels or models on the same text."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shared.errors import InvalidRequestError


def add_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file (as llama.cpp's llama-perplexity)")
    p.add_argument("--model", default=None, help="GGUF path or known model name (default: reame.conf)")
    p.add_argument("--file", required=True, help="UTF-8 text to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (llama-perplexity -c; default 512)")
    p.add_argument("--chunks", type=int, default=-1, help="score only the first K windows (default: all)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype for K and V (default: reame.conf)")
    p.add_argument("--kernels", choices=("auto", "reference"), default=None)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from gateway.tokenizer import Tokenizer
    from shared.config import load_config, model_flag
    from worker.engine.engine import load_engine_from_config
    from worker.engine.perplexity import PerplexityTally, window_nlls, windows

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read --file {args.file}: {exc}") from None
    config = load_config(args.config)
    engine_conf = replace(config.engine, context_length=args.ctx, window_kv="full")
    if args.kv_dtype is not None:
        engine_conf = replace(engine_conf, kv_dtype=args.kv_dtype)
    config = replace(config, engine=engine_conf)
    say = lambda m: print(m, file=sys.stderr)
    engine = load_engine_from_config(config, model=model_flag(args.model), kernels=args.kernels, progress=say)
    tokenizer = Tokenizer.from_gguf(engine.gguf.path)
    tokens = tokenizer.encode(text, add_special=True, parse_special=False)  # llama.cpp's common_tokenize
    todo = windows(tokens, args.ctx, args.chunks)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    say(f"perplexity: {len(tokens)} tokens, {len(todo)} windows of {args.ctx} (scored on their second half), "
        f"KV {engine.kv.dtype}")
    tally = PerplexityTally()
    started = time.perf_counter()
    for i, window in enumerate(todo):
        tally.add(window_nlls(engine, window, bos, config.engine.prefill_chunk))
        _progress(i + 1, len(todo), tally.ppl, time.perf_counter() - started)
    print(file=sys.stderr)
    print(f"Final estimate: PPL = {tally.ppl:.4f} +/- {tally.error:.5f}")
    return 0


def _progress(done: int, total: int, ppl: float, elapsed: float, width: int = 30) -> None:
    filled = width * done // total
    eta = elapsed / done * (total - done)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} windows, "
                     f"PPL so far {ppl:.4f}, {elapsed:.0f} s, ETA {eta:.0f} s ")
    sys.stderr.flush()
