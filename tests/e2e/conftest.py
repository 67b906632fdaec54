"""One gateway + one worker (real processes, real model) shared by the e2e tests of this folder;
tests that kill or drain workers start their own (test_serve.py)."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.servers import API_KEY, gateway_and_worker


@pytest.fixture(scope="session")
def server(smollm2_gguf, tmp_path_factory):
    directory = tmp_path_factory.mktemp("e2e")
    with gateway_and_worker(directory, smollm2_gguf) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
