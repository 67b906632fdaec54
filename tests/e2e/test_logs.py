"""What reaches the real processes' logs (the e2e server logs at debug, log_prompts off): no prompt
or completion text, and request ids a client cannot use to forge log lines."""
from __future__ import annotations

import re
import socket
import uuid

from tests.e2e.servers import API_KEY

LINE = re.compile(r"^\d\d:\d\d:\d\d (gateway|worker\[0\]) (DEBUG|INFO|WARNING|ERROR) ")


def logs(server) -> str:
    return server.log("gateway") + server.log("worker")


def test_prompts_and_completions_stay_out_of_the_logs(server, client):
    marker = f"quartz{uuid.uuid4().hex[:12]}"
    rid = f"req-{uuid.uuid4().hex[:8]}"
    r = client.chat.completions.create(model="reame", messages=[{"role": "user", "content": f"Say {marker}."}],
                                       max_tokens=16, temperature=0, extra_headers={"X-Request-Id": rid})
    text = logs(server)
    assert f"request {rid} (" in text  # the debug line about this request was written...
    assert marker not in text  # ...without its prompt
    answer = r.choices[0].message.content.strip()
    if len(answer) >= 12:
        assert answer not in text


def test_a_request_id_cannot_forge_log_lines(server):
    # A tab and spaces pass the HTTP parser; control bytes do not get that far (a 400 from aiohttp).
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"X-Request-Id: forge\tERROR worker[0] pwned\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200") and b"X-Request-Id: forgeERRORworker0pwned" in answer
    lines = logs(server).splitlines()
    assert any("request forgeERRORworker0pwned" in line for line in lines)
    assert not [line for line in lines if "pwned" in line and not LINE.match(line)]
