"""The systemd units in deploy/systemd, checked by systemd's own tools, and the config they ship.

`systemd-analyze verify` runs against a scratch root holding the units, stand-ins for the
executables they start, and the host's own system units (sysinit.target and friends): any line
it prints is a warning and fails the test. `systemd-analyze security --offline` scores each
service's exposure; a score above the one recorded here fails (lower it here when you harden).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from shared.config import parse_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = DEPLOY / "systemd"
# systemd 252 (Debian 12), scored 2026-12-03. 0 is best, 10 is an unconfined service.
EXPOSURE_LIMITS = {"reame-gateway.service": 1.4, "reame-worker@0.service": 1.4, "reame-coordinator.service": 1.4}
# What the units create for the services; every path of the shipped reame.conf must lie inside one.
SERVICE_DIRECTORIES = (Path("/var/lib/reame"), Path("/var/cache/reame"), Path("/run/reame"))

pytestmark = pytest.mark.system_tool("systemd-analyze", package="systemd")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A file-system root with the units installed as deploy/README.md says."""
    root = tmp_path_factory.mktemp("root")
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in UNITS.glob("reame*"):
        if unit.suffix in (".service", ".target"):
            shutil.copy(unit, units / unit.name)
    bin_dir = root / "opt/reame/.venv/bin"
    bin_dir.mkdir(parents=True)
    for name in executables():
        stand_in = bin_dir / name
        stand_in.write_text("#!/bin/sh\n")
        stand_in.chmod(0o755)
    # A copy, not a link: systemd resolves the units' own links inside --root.
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    return root


def executables() -> set[str]:
    names = set()
    for unit in UNITS.glob("*.service"):
        for command in re.findall(r"^ExecStart=(\S+)", unit.read_text(), re.MULTILINE):
            assert command.startswith("/opt/reame/.venv/bin/"), f"{unit.name}: {command} is not in /opt/reame"
            names.add(Path(command).name)
    return names


def analyze(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", f"--root={root}", *args], capture_output=True, text=True,
                          timeout=60, cwd=root)


def test_units_verify_without_warnings(root):
    result = analyze(root, "verify", "--man=no", "reame.target", "reame-gateway.service", "reame-worker@0.service",
                     "reame-coordinator.service")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "" and result.stdout.strip() == "", result.stderr + result.stdout


def test_verify_reports_a_bad_directive(root, tmp_path):
    """The check above can fail: a misspelt key is reported, not ignored."""
    broken = root / "etc/systemd/system/reame-broken.service"
    broken.write_text((UNITS / "reame-gateway.service").read_text().replace("PrivateTmp=", "PrivateTemp="))
    try:
        result = analyze(root, "verify", "--man=no", "reame-broken.service")
    finally:
        broken.unlink()
    assert "Unknown key 'PrivateTemp'" in result.stderr


@pytest.mark.parametrize("unit", sorted(EXPOSURE_LIMITS))
def test_exposure_is_no_worse_than_recorded(root, unit):
    result = analyze(root, "security", "--offline=yes", "--no-pager", unit)
    found = re.search(rf"Overall exposure level for {re.escape(unit)}: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= EXPOSURE_LIMITS[unit], result.stdout


@pytest.mark.parametrize("directive", ["ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                                       "NoNewPrivileges=yes", "CapabilityBoundingSet=\n",
                                       "SystemCallFilter=@system-service", "RestrictAddressFamilies=",
                                       "Restart=on-failure", "User=reame", "StateDirectory=reame",
                                       "PartOf=reame.target", "WantedBy=reame.target"])
@pytest.mark.parametrize("unit", ["reame-gateway.service", "reame-worker@.service"])
def test_services_keep_the_hardening_the_issue_asks_for(unit, directive):
    assert directive in (UNITS / unit).read_text()


@pytest.mark.parametrize("directive", ["ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                                       "NoNewPrivileges=yes", "CapabilityBoundingSet=\n", "MemoryDenyWriteExecute=yes",
                                       "SystemCallFilter=@system-service", "RestrictAddressFamilies=",
                                       "Restart=on-failure", "User=reame", "StateDirectory=reame",
                                       "ExecStart=/opt/reame/.venv/bin/reame-coordinator --config /etc/reame/reame.conf"])
def test_the_coordinator_is_hardened_like_the_gateway(directive):
    assert directive in (UNITS / "reame-coordinator.service").read_text()


def test_the_worker_may_move_its_threads_and_bind_its_memory():
    """The coordinator's placement knob (worker.placement) needs these calls; @system-service
    allows them through @resources, and no later filter may take them away."""
    listed = subprocess.run(["systemd-analyze", "syscall-filter", "@system-service"], capture_output=True,
                            text=True, timeout=60).stdout
    resources = subprocess.run(["systemd-analyze", "syscall-filter", "@resources"], capture_output=True,
                               text=True, timeout=60).stdout
    privileged = subprocess.run(["systemd-analyze", "syscall-filter", "@privileged"], capture_output=True,
                                text=True, timeout=60).stdout
    assert "@resources" in listed and privileged
    for call in ("sched_setaffinity", "set_mempolicy", "migrate_pages"):
        assert re.search(rf"^\s+{call}$", resources, re.MULTILINE), call
        assert not re.search(rf"^\s+{call}$", privileged, re.MULTILINE), call  # the worker's ~@privileged
    filters = re.findall(r"^SystemCallFilter=(.*)$", (UNITS / "reame-worker@.service").read_text(), re.MULTILINE)
    assert filters == ["@system-service", "~@privileged"]


def test_worker_keeps_the_numba_cache_in_its_cache_directory():
    text = (UNITS / "reame-worker@.service").read_text()
    assert "CacheDirectory=reame" in text
    assert "Environment=NUMBA_CACHE_DIR=/var/cache/reame/numba" in text


def test_shipped_config_puts_every_path_where_the_services_may_write():
    config = parse_config((DEPLOY / "reame.conf").read_text(), "/etc/reame/reame.conf")
    paths = {"[model] models_dir": config.model.models_dir, "[model] model_path": config.model.model_path,
             "[prefix_cache] store_path": config.prefix_cache.store_path,
             "[server] state_dir": config.server.state_dir, "[tuning] state_path": config.tuning.state_path,
             "[speculative] archive_path": config.speculative.archive_path}
    for key, value in paths.items():
        path = Path(value)
        assert path.is_absolute(), f"{key} = {value} must be absolute"
        assert any(path == base or base in path.parents for base in SERVICE_DIRECTORIES), f"{key} = {value} is outside the unit's directories"
    assert config.endpoint == "ipc:///run/reame/workers.ipc"


def test_sysusers_creates_the_user_the_units_run_as():
    line = next(l for l in (UNITS / "reame.sysusers").read_text().splitlines() if l.startswith("u "))
    assert line.split()[1] == "reame"
