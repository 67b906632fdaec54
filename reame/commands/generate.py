"""`reame generate`: run the engine once on a prompt (ids or text) and print the result."""
from __future__ import annotations

import argparse
import sys

import orjson

from shared.errors import InvalidRequestError, ReameError


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens from a prompt with the engine")
    p.add_argument("--model", default=None, help="GGUF path or known model name (default: reame.conf)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", default=None, help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt", default=None, help="prompt text (tokenized with the model's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-logits", type=int, default=0, help="also report the K best raw logits per step")
    p.add_argument("--kernels", choices=("auto", "reference"), default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise InvalidRequestError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    return ids  # none at all: the engine refuses an empty prompt, with the server's message


def run(args: argparse.Namespace) -> int:
    from shared.config import load_config, model_flag
    from shared.sampling import SamplingParams
    from worker.engine.engine import load_engine_from_config
    from worker.sched.one_request import Timing, generate_ids, generate_one, solo_generator
    from worker.sched.tuning_state import SchedulerKnobs

    config = load_config(args.config)
    ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.max_tokens <= 0:
        raise InvalidRequestError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    say = (lambda m: print(m, file=sys.stderr)) if not args.json else (lambda m: None)
    engine = load_engine_from_config(config, model=model_flag(args.model), kernels=args.kernels, progress=say)
    generator = solo_generator(engine, SchedulerKnobs.from_config(config))
    say("warming up kernels")
    generate_ids(generator, [0], 2)
    tokenizer = _tokenizer(engine, needed=ids is None)
    if ids is None:
        ids = tokenizer.encode(args.prompt)
    stop = (tokenizer.eos_id,) if tokenizer is not None and tokenizer.eos_id is not None else ()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop_token_ids=stop)
    t = Timing()
    outs = list(generate_one(generator, ids, params, top_logits=args.top_logits, timing=t))
    tokens = [o.token for o in outs]
    prefill_rate = t.prefill_tokens / t.prefill_s if t.prefill_s else 0.0
    decode_rate = t.decode_tokens / t.decode_s if t.decode_tokens and t.decode_s else 0.0
    if args.json:
        result = {"tokens": tokens, "prefill_tok_s": round(prefill_rate, 1), "decode_tok_s": round(decode_rate, 1)}
        if args.top_logits:
            result["top"] = [[[i, round(v, 4)] for i, v in o.top_logits] for o in outs]
        if tokenizer is not None:
            result["text"] = tokenizer.decode(tokens)
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(tokenizer.decode(tokens) if tokenizer is not None else " ".join(map(str, tokens)))
        print(f"[{len(ids)} prompt tokens at {prefill_rate:.0f} tok/s, {len(tokens)} generated at "
              f"{decode_rate:.1f} tok/s, finish: {outs[-1].finish_reason}]", file=sys.stderr)
    return 0


def _tokenizer(engine, needed: bool):
    """The model's tokenizer; optional for --prompt-ids (output is then ids only)."""
    from gateway.tokenizer import Tokenizer
    try:
        return Tokenizer.from_gguf(engine.gguf.path)
    except ReameError:
        if needed:
            raise
        return None
