"""Every schema of tests/e2e/json_schemas.py, asked of SmolLM2 with response_format json_schema:
each answer is complete (finish_reason "stop") and validates with `jsonschema`.

The requests run eight at a time against one server whose worker batches eight, so the suite's
~60 answers take a few minutes; each answer is its own test case, so a failure names its schema.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from tests.e2e.json_schemas import SCHEMAS
from tests.e2e.servers import auth, gateway_and_worker

BATCH = 8
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def answers(smollm2_gguf, tmp_path_factory) -> dict[str, dict]:
    directory = tmp_path_factory.mktemp("schema-suite")
    with gateway_and_worker(directory, smollm2_gguf, gateway={"max_queue": 64},
                            scheduler={"max_batch_size": BATCH}) as server:
        def ask(name: str) -> dict:
            description, schema = SCHEMAS[name]
            body = {"messages": [{"role": "user", "content": f"Answer with JSON only: {description}."}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                               "strict": True}},
                    "max_tokens": MAX_TOKENS, "temperature": 0}
            return requests.post(server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=600).json()

        with ThreadPoolExecutor(BATCH) as pool:
            return dict(zip(SCHEMAS, pool.map(ask, SCHEMAS)))


def test_the_suite_is_large_enough():
    assert len(SCHEMAS) >= 50


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answer_validates(answers, name):
    answer = answers[name]
    assert "choices" in answer, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the grammar completed within max_tokens
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name][1])
