"""A client that stops reading its stream: once the socket's buffers are full, the gateway waits
`write_timeout` (1 s here), then drops the connection and the worker stops generating for it."""
from __future__ import annotations

import json
import socket
import time

from tests.fakes import EOS, FakeServer


def test_a_stream_nobody_reads_is_cut_off_and_its_generation_aborted(tmp_path):
    srv = FakeServer(tmp_path, extra="write_timeout = 1", step_s=0.005)  # 1,000 tokens take 5 s
    try:
        generator = srv.workers[0].generator
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        # Four choices of up to 250 tokens with log-probabilities: several times what the socket
        # and asyncio buffer for one stream (~90 KB), so the writes must block.
        body = json.dumps({"prompt": "x", "n": 4, "max_tokens": 250, "stream": True, "logprobs": 5,
                           "logit_bias": {str(EOS): -100}})
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        started = time.monotonic()
        srv.wait_until(lambda: generator.closed >= 1, timeout=15)  # aborted, not finished
        assert time.monotonic() - started >= 1.0  # not before write_timeout
        srv.wait_until(lambda: sum(len(w.jobs) for w in srv.state.pool.workers.values()) == 0
                       and not srv.state.pool.queue)
        assert generator.steps < 4 * 250  # it never generated everything it was asked for
        sock.settimeout(5)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass  # the gateway aborted the connection: what was buffered is gone
        assert b"data: [DONE]" not in received
        sock.close()
    finally:
        srv.close()
