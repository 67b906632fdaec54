"""The numba inference engine.

Public surface (what the worker, the CLI and the benchmarks use):

    engine = load_engine(path, kernels="auto", threads=0, context_length=0, progress=None)
    engine.model_name, engine.arch, engine.n_ctx, engine.vocab_size
    engine.validate(prompt_ids, max_tokens)            # raises InvalidRequestError / ContextLengthError
    for out in engine.generate(prompt_ids, params):    # yields TokenOutput, one per generated token
        out.token, out.logprob, out.top_logprobs, out.finish_reason  # finish_reason: None | "stop" | "length"

Stopping iteration early (generator close) abandons the sequence and frees its KV.
"""
from __future__ import annotations

import os

# Compiled kernels are cached on disk so a restart does not recompile (seconds, not a minute).
# numba reads this when a kernel module is imported, so it is set here, before any of them.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.expanduser("~/.cache/reame/numba"))
