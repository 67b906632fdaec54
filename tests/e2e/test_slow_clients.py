"""Slow-loris clients: a request trickled in byte by byte is cut off after `read_timeout` (3 s in
tests/e2e/servers.py), while everyone else is served as usual."""
from __future__ import annotations

import socket
import time

import requests

from tests.e2e.servers import API_KEY

READ_TIMEOUT = 3.0
LINGER = 2.0  # gateway.main.LINGER_S: how long the gateway still reads after answering


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.settimeout(0.5)
    return sock


def trickle(sock: socket.socket, byte: bytes, limit: float) -> tuple[bytes, float]:
    """Send one byte every half second until the server answers and hangs up; (answer, seconds)."""
    started = time.monotonic()
    answer = b""
    while time.monotonic() - started < limit:
        try:
            sock.sendall(byte)
        except OSError:  # the server closed: a send may fail before the close is read
            pass
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not data:
            break
        answer += data
    return answer, time.monotonic() - started


def served(server) -> bool:
    r = requests.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    return r.status_code == 200


def test_trickled_body_gets_408_and_the_connection_closed(server):
    sock = connect(server)
    body_start = b'{"prompt": "'
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode() + body_start)
    assert served(server)  # others are not held up meanwhile
    answer, seconds = trickle(sock, b"a", limit=READ_TIMEOUT + 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer and b"Connection: close" in answer
    assert seconds < READ_TIMEOUT + LINGER + 3
    assert served(server)


def test_trickled_headers_are_cut_off(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    answer, seconds = trickle(sock, b"z", limit=READ_TIMEOUT + 10)
    sock.close()
    assert seconds < READ_TIMEOUT + 5, "the server kept a connection whose headers never ended"
    assert served(server)
