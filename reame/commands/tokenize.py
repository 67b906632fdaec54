"""`reame tokenize`: the token ids llama.cpp would give for a text, from the model's own vocabulary."""
from __future__ import annotations

import argparse
import sys

import orjson


def add_parser(sub) -> None:
    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("--model", default=None, help="GGUF path or known model name (default: reame.conf)")
    p.add_argument("--json", action="store_true", help='print {"ids": [...]}')
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("text")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gateway.tokenizer import Tokenizer
    from shared.config import load_config, model_flag
    from shared.model_store import model_file

    config = load_config(args.config)
    tok = Tokenizer.from_gguf(model_file(config, model_flag(args.model), progress=lambda m: print(m, file=sys.stderr)))
    ids = tok.encode(args.text, add_special=not args.no_special)
    if args.json:
        sys.stdout.write(orjson.dumps({"ids": ids}).decode() + "\n")
    else:
        print(" ".join(map(str, ids)))
    return 0
