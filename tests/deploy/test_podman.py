"""deploy/kubernetes run for real where podman can: `podman kube play` of the coordinator's
manifest (its ConfigMap, its Deployment, and reame-curve with keys made here) on the image the
Dockerfile builds, until reame-coordinator says it waits for gateways.

It skips with the reason where it cannot run. On the 2-core Firecracker test host (Debian 12,
podman 4.3.1 from apt) podman runs a container only with runc, `--cgroup-manager cgroupfs` and
explicit ulimits (crun refuses the host's hybrid cgroups, and raising RLIMIT_NOFILE/NPROC is not
permitted), and no registry is reachable, so the Dockerfile's base image cannot be pulled: the
image cannot be built there.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from shared.zmq_keys import generate

K8S = Path(__file__).resolve().parents[2] / "deploy/kubernetes"
IMAGE = "registry.example.com/reame:0.1.0"  # what the manifests run (Dockerfile)
BASE = "debian:bookworm-slim"  # the Dockerfile's FROM
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]


def _podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)


def _has_image(name: str) -> bool:
    return _podman("image", "exists", name).returncode == 0


def why_not() -> str | None:
    """Why the manifests cannot run here (None: they can)."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman and runc are not installed (apt-get install podman runc)"
    if _has_image(IMAGE):
        return None
    if not _has_image(BASE):
        pulled = _podman("pull", BASE, timeout=120)
        if pulled.returncode != 0:
            return (f"{IMAGE} is not built and cannot be: the Dockerfile's base {BASE} is not in podman's storage "
                    f"and `podman pull {BASE}` failed ({pulled.stderr.strip().splitlines()[-1]})")
    return None


@pytest.fixture(scope="module")
def image() -> str:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    if not _has_image(IMAGE):
        built = _podman("build", "-t", IMAGE, str(K8S.parents[1]), timeout=1800)
        assert built.returncode == 0, built.stderr[-3000:]
    return IMAGE


def _manifests(tmp_path: Path) -> Path:
    """coordinator.yaml and reame-curve with real keys, as one file for `podman kube play`."""
    keys = tmp_path / "keys"
    for name in ("coordinator", "gateway"):
        generate(keys, name)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "reame-curve", "namespace": "reame"},
              "type": "Opaque", "stringData": {p.name: p.read_text() for p in sorted(keys.iterdir())}}
    docs = [secret] + [d for d in yaml.safe_load_all((K8S / "coordinator.yaml").read_text())
                       if d and d["kind"] != "Service"]
    path = tmp_path / "play.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def test_the_coordinator_manifest_runs_under_podman(image, tmp_path):
    play = _manifests(tmp_path)
    started = _podman("kube", "play", "--network", "none", str(play), timeout=300)
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 120
        logs = ""
        while time.monotonic() < deadline and "waiting for gateways" not in logs:
            time.sleep(1)
            shown = _podman("logs", "reame-coordinator-pod-coordinator")
            logs = shown.stdout + shown.stderr
        assert "waiting for gateways" in logs and "over CURVE" in logs, logs[-3000:]
    finally:
        _podman("kube", "down", str(play), timeout=120)
