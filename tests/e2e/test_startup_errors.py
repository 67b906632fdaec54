"""`reame serve` refuses to start, with one clear line and a non-zero exit, when the model cannot be
read or the address would expose the API by accident; nothing is left running."""
from __future__ import annotations

import subprocess
import sys

from tests.e2e.servers import write_config
from tests.harness import REPO, free_port


def serve(tmp_path, model, *flags: str) -> subprocess.CompletedProcess:
    config = write_config(tmp_path, model, free_port())
    return subprocess.run([sys.executable, "-m", "reame.cli", "serve", "--config", str(config), "--workers", "1",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_file_that_is_not_gguf(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"this is no model")
    r = serve(tmp_path, model)
    assert r.returncode != 0 and "not a GGUF file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_truncated_model(tmp_path, smollm2_gguf):
    model = tmp_path / "model.gguf"
    with open(smollm2_gguf, "rb") as whole:
        model.write_bytes(whole.read(1 << 20))  # the header and part of the metadata
    r = serve(tmp_path, model)
    assert r.returncode != 0 and "not a valid GGUF file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_directory_where_the_model_should_be(tmp_path):
    model = tmp_path / "model.gguf"
    model.mkdir()
    r = serve(tmp_path, model)
    assert r.returncode != 0 and "model not found" in r.stderr, r.stderr


def test_a_public_address_needs_allow_remote(tmp_path, smollm2_gguf):
    r = serve(tmp_path, smollm2_gguf, "--host", "0.0.0.0")
    assert r.returncode == 1 and "allow_remote" in r.stderr, r.stderr
    assert "started" not in r.stderr  # refused before any child was started


def test_a_loopback_tcp_endpoint_needs_curve_or_insecure_tcp(tmp_path, smollm2_gguf):
    """Any local user could connect to 127.0.0.1: register as a worker, or rewrite the strategy."""
    config = write_config(tmp_path, smollm2_gguf, free_port())
    config.write_text(config.read_text().replace("[server]\n", "[server]\nendpoint = tcp://127.0.0.1:5557\n", 1))
    r = subprocess.run([sys.executable, "-m", "reame.cli", "serve", "--config", str(config), "--workers", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "endpoint = tcp://127.0.0.1:5557 is open to every local user without authentication" in r.stderr
    assert "insecure_tcp = true" in r.stderr and "Traceback" not in r.stderr and "started" not in r.stderr
    coordinator = tmp_path / "coordinator.conf"
    coordinator.write_text(f"[tuning]\ncoordinator = tcp://127.0.0.1:{free_port()}\nstate_path = {tmp_path / 't'}\n")
    r = subprocess.run([sys.executable, "-m", "gateway.coordinator.main", "--config", str(coordinator)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "open to every local user" in r.stderr and "Traceback" not in r.stderr, r.stderr
