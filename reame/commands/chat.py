"""`reame chat`: talk to a model in the terminal, answers streamed token by token."""
from __future__ import annotations

import argparse
import sys
from contextlib import closing


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with a model in the terminal")
    p.add_argument("--model", default=None, help="GGUF path or known model name (default: reame.conf)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gateway.chat_template import template_for
    from gateway.tokenizer import StreamDecoder, Tokenizer
    from shared.config import load_config, model_flag
    from shared.errors import InvalidRequestError
    from shared.model_store import model_file
    from shared.sampling import SamplingParams
    from worker.engine.engine import load_engine_from_config
    from worker.sched.one_request import solo_generator
    from worker.sched.tuning_state import SchedulerKnobs

    config = load_config(args.config)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    path = model_file(config, model_flag(args.model), progress=say)
    tok = Tokenizer.from_gguf(path)
    template = template_for(tok, config)
    engine = load_engine_from_config(config, model=str(path), progress=say)
    generator = solo_generator(engine, SchedulerKnobs.from_config(config))
    stops = tuple(sorted(set(template.stop_ids) | ({tok.eos_id} if tok.eos_id is not None else set())))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Chatting with {engine.model_name}. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        ids = tok.encode(template.render(messages, add_generation_prompt=True))
        room = engine.n_ctx - len(ids)
        if room <= 0:
            raise InvalidRequestError(f"the conversation is {len(ids)} tokens, over the {engine.n_ctx}-token context")
        params = SamplingParams(max_tokens=min(args.max_tokens, room), temperature=args.temperature,
                                seed=args.seed, stop_token_ids=stops)
        reply = _stream_reply(generator, ids, params, StreamDecoder(tok), template.stop_strings)
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(generator, ids, params, decoder, stop_strings) -> str:
    """Print the answer as it is generated; returns its text (without the end-of-turn marker)."""
    from worker.sched.one_request import generate_one

    with closing(generate_one(generator, ids, params)) as outputs:
        text, shown, finished = _print_tokens(outputs, decoder, stop_strings)
    if not finished:
        text += decoder.flush()
    sys.stdout.write(text[shown:] + "\n")
    sys.stdout.flush()
    return text


def _print_tokens(outputs, decoder, stop_strings) -> tuple[str, int, bool]:
    """(text, how much of it is printed, whether a stop ended it) as the tokens arrive."""
    text = ""
    shown = 0
    for out in outputs:
        if out.finish_reason == "stop":
            return text, shown, True
        text += decoder.push(out.token)
        cut = min((text.find(s) for s in stop_strings if s in text), default=-1)
        if cut >= 0:
            return text[:cut], shown, True
        # Hold back a tail that could be the start of a stop string.
        safe = len(text) - max((len(s) - 1 for s in stop_strings), default=0)
        if safe > shown:
            sys.stdout.write(text[shown:safe])
            sys.stdout.flush()
            shown = safe
    return text, shown, False
