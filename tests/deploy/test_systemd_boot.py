"""deploy/README.md followed on a booted systemd: the shipped units start a gateway and two workers.

test_systemd.py checks the unit files with systemd's offline tools; this runs them. The host's own
file system, under a throw-away overlay (writes land in a tmpfs and vanish with the test), is
booted with `systemd-nspawn --boot`: systemd is PID 1 there (on the host's network, which `make
install` needs for PyPI; the gateway listens on a free port), so the units run exactly as on a server: as the `reame` user made by sysusers, with
every hardening option of the units in force (ProtectSystem=strict, ProtectHome, PrivateUsers, the
system-call filter, ...), their StateDirectory/CacheDirectory/RuntimeDirectory, and the shipped
/etc/reame/reame.conf. Inside, the README's steps are run as written, with three stand-ins:

  - the code is this checkout (at its own path, as /opt/reame links to it) rather than a fresh
    clone, so the kernels numba compiled for these exact files are reused from $NUMBA_CACHE_DIR
    (copied to /var/cache/reame/numba) instead of recompiled by two workers for minutes;
  - its virtual environment is made by the README's `make install` with Debian's python3, as a
    server has it, on a tmpfs over the checkout's own .venv (the test's interpreter may live under
    /root, which ProtectHome hides from the services);
  - the model is copied from the test models' cache instead of `reame models pull`.

The host has one NUMA node, so the two workers take one CPU each through drop-ins, as the README
shows for that case. Needs root, `systemd-nspawn` (Debian's systemd-container) and overlayfs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.system_tools import require_tool

REPO = Path(__file__).resolve().parents[2]
API_KEY = "boot-test-key"
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _unavailable() -> str | None:
    """Why the host cannot be booted here (None: it can). A missing tool skips, or fails where CI
    requires the tools (tests/system_tools.py)."""
    if os.geteuid() != 0:
        return "booting a container needs root"
    require_tool("systemd-nspawn", package="systemd-container")
    require_tool("unshare", package="util-linux")
    require_tool("nsenter", package="util-linux")
    if not Path("/usr/bin/python3").is_file():
        return "no /usr/bin/python3 for the README's `make install`"
    return None


class BootedHost:
    """The host's root under an overlay, booted by systemd-nspawn in a private mount namespace
    (the overlay and nspawn's tmpfs exist only there, so nothing is left on the host)."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.port = _free_port()
        self.root = scratch / "root"
        self.log = scratch / "nspawn.log"
        self.process: subprocess.Popen | None = None
        self.leader = 0  # the container's PID 1 (systemd), as the host sees it

    def boot(self, timeout: float = 60) -> None:
        layers = self.scratch / "layers"
        machine_id = uuid.uuid4().hex  # nspawn refuses a machine id equal to the host's
        script = f"""set -e
mount -t tmpfs tmpfs {layers}
mkdir -p {layers}/upper {layers}/work {self.root}
mount -t overlay overlay -o lowerdir=/,upperdir={layers}/upper,workdir={layers}/work {self.root}
echo {machine_id} > {self.root}/etc/machine-id
mkdir -p /run/systemd/nspawn && mount -t tmpfs tmpfs /run/systemd/nspawn
exec systemd-nspawn --directory={self.root} --boot --register=no --keep-unit --link-journal=no \
  --machine=reame-boot-{os.getpid()} --console=pipe
"""
        layers.mkdir()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.process.returncode}:\n{self.log.read_text()}")
            if not self.leader:
                self.leader = self._find_leader()
            if self.leader:
                state = self.run("systemctl is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.5)
        raise AssertionError(f"the container did not boot in {timeout:.0f} s:\n{self.log.read_text()}")

    def _find_leader(self) -> int:
        try:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                if Path(child.exe()).name == "systemd":
                    return child.pid
        except (psutil.Error, OSError):
            pass
        return 0

    def run(self, command: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        """A shell command inside the container, as root, with a server's plain environment."""
        result = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "env", "-i", f"PATH={DEBIAN_PATH}",
                                 "HOME=/root", "LANG=C.UTF-8", "bash", "-c", command],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"`{command}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def http(self, method: str, path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
        """A request to the gateway, from inside the container."""
        args = ["curl", "-s", "-o", "/dev/stdout", "-w", r"\n%{http_code}", "-X", method,
                f"http://127.0.0.1:{self.port}{path}", "-H", "Content-Type: application/json"]
        if key:
            args += ["-H", f"Authorization: Bearer {key}"]
        if body is not None:
            args += ["-d", json.dumps(body)]
        out = self.run(" ".join(_quote(a) for a in args), check=False, timeout=120).stdout
        text, _, status = out.rpartition("\n")
        try:
            return int(status), json.loads(text) if text.strip() else {}
        except ValueError:
            return 0, {"raw": out}

    def shutdown(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if self.leader:
            self.run("systemctl poweroff", check=False, timeout=30)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


@pytest.fixture(scope="module")
def host(tmp_path_factory, smollm2_gguf):
    why = _unavailable()
    if why is not None:
        pytest.skip(why)
    booted = BootedHost(tmp_path_factory.mktemp("boot"))
    try:
        booted.boot()
        _install(booted, smollm2_gguf)
        yield booted
    finally:
        booted.shutdown()


def _compile_kernels(model: Path) -> Path:
    """Compile this checkout's kernels into the host's numba cache (a no-op when the suite already
    did), so that the two workers in the container load them instead of compiling for minutes
    on the same two cores; returns the cache's base directory."""
    subprocess.run([str(Path(sys.executable).parent / "reame"), "generate", "--model", str(model),
                    "--prompt-ids", "1,2,3", "--max-tokens", "2"], check=True, capture_output=True, timeout=900)
    return Path(os.environ.get("REAME_NUMBA_CACHE_BASE") or os.environ.get("NUMBA_CACHE_DIR")
                or "~/.cache/reame/numba").expanduser()


def _install(host: BootedHost, model: Path) -> None:
    """deploy/README.md's Install and Start, as root inside the container."""
    numba_cache = _compile_kernels(model)
    repo = REPO
    host.run(f"""set -e
# 1. The code: this checkout stands for the release directory. Its .venv is hidden under a tmpfs
#    (in the container only) and made afresh from Debian's python3.
mkdir -p {repo}/.venv && mount -t tmpfs tmpfs {repo}/.venv
make -C {repo} install > /var/tmp/make-install.log 2>&1 || {{ tail -30 /var/tmp/make-install.log; exit 1; }}
ln -sfn {repo} /opt/reame
# 2. The user, the configuration, the secrets.
install -D -m 644 /opt/reame/deploy/systemd/reame.sysusers /etc/sysusers.d/reame.conf
systemd-sysusers
install -d -m 755 /etc/reame
install -m 640 -g reame /opt/reame/deploy/reame.conf /etc/reame/reame.conf
# The host's network is shared: the gateway's port goes into the file's own [gateway] section.
sed -i '/^\\[gateway\\]$/a port = {host.port}' /etc/reame/reame.conf
grep -q '^port = {host.port}$' /etc/reame/reame.conf
# The shipped default is Qwen2.5-Coder-0.5B; this test boots the 135M model, which starts faster.
sed -i 's#^model_path = .*#model_path = /var/lib/reame/models/SmolLM2-135M-Instruct.Q4_1.gguf#' /etc/reame/reame.conf
install -m 600 /dev/null /etc/reame/env
echo "REAME_API_KEY={API_KEY}" > /etc/reame/env
# 3. The model (copied, not pulled) and the compiled kernels of this checkout.
install -d -o reame -g reame -m 750 /var/lib/reame /var/lib/reame/models /var/cache/reame
install -o reame -g reame -m 640 {model} /var/lib/reame/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -d {numba_cache} ]; then cp -r {numba_cache} /var/cache/reame/numba; chown -R reame:reame /var/cache/reame; fi
# 4. The units, and one CPU per worker on this one-node host (the README's drop-in).
cp /opt/reame/deploy/systemd/reame-gateway.service /opt/reame/deploy/systemd/reame-worker@.service \\
   /opt/reame/deploy/systemd/reame.target /etc/systemd/system/
for i in 0 1; do
  mkdir -p /etc/systemd/system/reame-worker@$i.service.d
  printf '[Service]\\nExecStart=\\nExecStart=/opt/reame/.venv/bin/reame-worker --config /etc/reame/reame.conf --numa-node 0 --cpus %s\\n' $i \\
    > /etc/systemd/system/reame-worker@$i.service.d/override.conf
done
systemctl daemon-reload
systemctl enable --now reame.target reame-gateway.service reame-worker@0.service reame-worker@1.service
""", timeout=900)
    deadline = time.monotonic() + 600
    health: dict = {}
    while time.monotonic() < deadline:
        status, health = host.http("GET", "/health", key=None)
        if status == 200 and health.get("workers") == 2:
            return
        failed = host.run("systemctl --failed --no-legend", check=False).stdout.strip()
        assert not failed, f"{failed}\n{_journal(host)}"
        # Restart= keeps a unit that exits at once out of --failed: a few restarts already say
        # it will never come up (a bad reame.conf restarted 260 times in the 600 s below).
        restarts = host.run("systemctl show -p NRestarts --value reame-gateway.service "
                            "reame-worker@0.service reame-worker@1.service", check=False).stdout.split()
        assert max((int(n) for n in restarts if n.isdigit()), default=0) < 5, \
            f"a unit keeps restarting: NRestarts {restarts}\n{_journal(host)}"
        time.sleep(2)
    raise AssertionError(f"two workers never registered: /health {health}\n{_journal(host)}")


def _journal(host: BootedHost, unit: str = "reame-*") -> str:
    return host.run(f"journalctl --no-pager -o cat -u '{unit}' | tail -60", check=False).stdout


def test_the_units_serve_chat_completions_as_the_reame_user(host):
    status, reply = host.http("POST", "/v1/chat/completions", {
        "model": "reame", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Name a colour."}]})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"].strip()
    for unit in ("reame-gateway.service", "reame-worker@0.service", "reame-worker@1.service"):
        pid = host.run(f"systemctl show -p MainPID --value {unit}").stdout.strip()
        owner = host.run(f"ps -o user= -p {pid}").stdout.strip()
        assert owner == "reame", f"{unit} runs as {owner}"


def test_the_api_key_from_the_env_file_is_required(host):
    status, reply = host.http("GET", "/v1/models", key=None)
    assert status == 401, reply
    assert host.http("GET", "/v1/models")[0] == 200


def test_each_worker_pins_itself_to_its_drop_in_cpu(host):
    for cpu in (0, 1):
        assert f"pinned to CPUs {cpu}" in _journal(host, f"reame-worker@{cpu}")


def test_the_services_write_only_their_own_directories(host):
    listing = host.run("ls /var/lib/reame /var/cache/reame/numba /run/reame").stdout
    assert "models" in listing and "workers.ipc" in listing, listing
    # ProtectSystem=strict: the gateway cannot write outside its directories.
    pid = host.run("systemctl show -p MainPID --value reame-gateway.service").stdout.strip()
    probe = host.run(f"nsenter -t {pid} -m touch /etc/reame/probe 2>&1", check=False)
    assert "Read-only file system" in probe.stdout, probe.stdout + probe.stderr


def test_a_worker_restart_rejoins_and_stop_drains_cleanly(host):
    host.run("systemctl restart reame-worker@1.service")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status, health = host.http("GET", "/health", key=None)
        if status == 200 and health.get("workers") == 2:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the restarted worker did not rejoin: {health}\n{_journal(host, 'reame-worker@1')}")
    host.run("systemctl stop reame.target")  # returns once the target stopped; its services follow
    units = "reame-gateway.service reame-worker@0.service reame-worker@1.service"
    deadline = time.monotonic() + 180
    while (states := host.run(f"systemctl is-active {units}", check=False).stdout.split()) != ["inactive"] * 3:
        assert time.monotonic() < deadline, f"{states}\n{_journal(host, 'reame-worker@1')}"
        time.sleep(0.5)
    assert "draining" in _journal(host, "reame-worker@1")
    assert host.run("systemctl --failed --no-legend", check=False).stdout.strip() == ""
