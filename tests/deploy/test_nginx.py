"""deploy/examples/nginx/reame.conf, run by Debian's nginx on loopback in front of two gateways
(each with its own worker), driven by the `openai` client: both gateways serve, a stream reaches
the client while its generation still runs (proxy_buffering off), and with one gateway stopped
every request is answered by the other."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import openai
import pytest
import requests

from tests import harness
from tests.e2e.servers import API_KEY, NO_END, auth, gateway_and_worker, metric
from tests.system_tools import find_tool

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy/examples/nginx/reame.conf"
NGINX = find_tool("nginx") or "nginx"

pytestmark = pytest.mark.system_tool("nginx", package="nginx")


def nginx_config(directory: Path, port: int, upstreams: list[int]) -> Path:
    """The example with this test's ports, inside a main config whose files all live in `directory`."""
    site = EXAMPLE.read_text()
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=3 fail_timeout=10s;\n" for p in upstreams)
    site, count = re.subn(r"(    server 127\.0\.0\.1:\d+ [^\n]*\n)+", servers, site)
    assert count == 1, "the example's upstream block changed shape"
    site = site.replace("listen 80;", f"listen 127.0.0.1:{port};")
    temp = "".join(f"    {kind}_temp_path {directory}/{kind}_temp;\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = directory / "nginx.conf"
    main.write_text(f"""user root;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log {directory}/access.log;
{temp}
{site}
}}
""")
    return main


@pytest.fixture
def nginx_and_two_gateways(tmp_path, smollm2_gguf):
    with gateway_and_worker(tmp_path / "a", smollm2_gguf) as a, gateway_and_worker(tmp_path / "b", smollm2_gguf) as b:
        port = harness.free_port()
        conf = nginx_config(tmp_path, port, [a.port, b.port])
        check = subprocess.run([NGINX, "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp_path), "-g", "daemon off;"],
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while harness.health(f"http://127.0.0.1:{port}")[0] != 200:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "nginx did not answer"
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port}", a, b
        finally:
            proc.terminate()
            proc.wait(10)


def served(server) -> float:
    return sum(v for labels, v in metric(server.url, "reame_requests_total").items()
               if ("endpoint", "/v1/chat/completions") in labels)


def test_two_gateways_behind_nginx(nginx_and_two_gateways):
    url, a, b = nginx_and_two_gateways
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    answers = [client.chat.completions.create(model="reame", messages=messages, max_tokens=8, temperature=0)
               for _ in range(4)]
    assert len({r.choices[0].message.content for r in answers}) == 1
    assert served(a) >= 1 and served(b) >= 1  # nginx spread them over both gateways

    # Streaming: the first chunk reaches the client while the gateway still generates.
    stream = client.chat.completions.create(model="reame", messages=messages, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"logit_bias": NO_END})
    chunks = iter(stream)
    first = next(chunks)
    running = sum(metric(a.url, "reame_running_requests").values()) + sum(metric(b.url, "reame_running_requests").values())
    rest = list(chunks)
    assert running == 1, "the stream reached the client only once its generation had ended"
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    # A chunk may carry several tokens (drafted tokens accepted in one step), so count tokens, not chunks.
    last = [c for c in rest if c.choices][-1]
    assert len(rest) >= 3 and last.choices[0].finish_reason == "length" and text
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 48

    # One gateway stopped: nginx sends every request to the other.
    a.stop()
    for _ in range(3):
        r = client.chat.completions.create(model="reame", messages=messages, max_tokens=4, temperature=0)
        assert r.choices[0].message.content
    assert requests.get(url + "/health", headers=auth(), timeout=5).status_code == 200
