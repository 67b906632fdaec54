"""Loaded by the schemathesis run in test_openapi_fuzz.py (SCHEMATHESIS_HOOKS): keeps generation short.

Any max_tokens the schema allows is valid, but thousands of tokens per case would take minutes;
capping it after generation leaves valid cases valid and invalid ones invalid.
"""
from __future__ import annotations

import schemathesis

MAX_TOKENS = 4


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
