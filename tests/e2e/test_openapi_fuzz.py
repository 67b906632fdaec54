"""schemathesis against the live gateway (real worker, SmolLM2) and its own /openapi.json.

Cases from the document's examples, its boundaries (coverage) and random fuzzing, valid and
invalid, with a fixed seed and a bounded number per operation. Checks: no 5xx; every status,
content type, header and body as documented; invalid input refused with a 4xx (so the document
is never looser than gateway/requests.py); undocumented methods get 405 with Allow; a route that
needs the key refuses requests without it. Generation is kept short: `max_n` 2, default
max_tokens 4, and schemathesis_hooks.py caps max_tokens.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.servers import API_KEY, gateway_and_worker
from tests.harness import REPO

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,unsupported_method,ignored_auth")
MAX_EXAMPLES = 50
SEED = 8


@pytest.fixture(scope="module")
def fuzz_server(smollm2_gguf, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    with gateway_and_worker(directory, smollm2_gguf, gateway={"max_n": 2, "default_max_tokens": 4}) as server:
        yield server


def test_live_gateway_matches_its_openapi_document(fuzz_server, tmp_path):
    argv = [sys.executable, "-m", "schemathesis.cli", "run", fuzz_server.url + "/openapi.json",
            "--checks", CHECKS, "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
            "--seed", str(SEED), "--workers", "1", "--generation-database", "none", "--request-timeout", "60",
            "--header", f"Authorization: Bearer {API_KEY}", "--no-color", "--max-failures", "5"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks", "PYTHONPATH": str(REPO)}
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    report = run.stdout[-12000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
