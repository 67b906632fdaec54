"""One served model's processes: a gateway and a worker of its own, started when the model is
loaded and stopped when it is unloaded.

Each model's gateway listens on a loopback port and its worker meets it on an endpoint in the
model's own state directory, so a model's prefix store entries, kernel tables, speculation
archive and tuning profiles stay its own (they are keyed by the model's fingerprint), and the
existing router sends its requests only to workers that hold it. The front
(gateway.model_front) forwards each request to the backend of the model it names.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import psutil

from shared.config import Config, memory_bytes
from shared.errors import ModelLoadError
from shared.model_registry import ModelEntry
from shared.parent_death import exit_with_parent

log = logging.getLogger(__name__)

HEALTH_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What a model's processes hold beside the file and the KV pool, measured (bench/model_switch.py,
# Xeon, 2026-12-06): the worker's packed weights are 1.2-1.4x the file (scales, Q6_K codes a byte
# each), and its interpreter, numba kernels and step buffers plus the model's gateway ~0.5 GiB.
# Counting the file and the pool alone, one model at a time under a 1000 MiB budget peaked at
# 2229 MiB: the worker held 1.4-1.9x what was counted.
PACKED_PER_FILE_BYTE = 1.4
PROCESS_BYTES = 512 * 2**20


def estimate_bytes(config: Config, path: Path) -> int:
    """What a model will hold before it has been loaded once: its packed weights, its worker's KV
    pool and its processes. Once loaded, resident_bytes() measures it instead."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (int(PACKED_PER_FILE_BYTE * path.stat().st_size) + memory_bytes(config.engine.kv_cache_memory, total)
            + PROCESS_BYTES)


class Backend:
    def __init__(self, config: Config, entry: ModelEntry, path: Path):
        self.config, self.entry, self.path = config, entry, path
        self.state_dir = config.resolve_path(config.server.state_dir) / "models" / entry.name
        self.port = 0
        self._processes: list[asyncio.subprocess.Process] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _argv(self) -> tuple[list[str], list[str]]:
        common = ["--model", str(self.path), "--state-dir", str(self.state_dir)]
        if self.config.source:
            common += ["--config", self.config.source]
        gateway = [sys.executable, "-m", "gateway.main", *common, "--model-id", self.entry.name,
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--adaptive", "on" if self.config.tuning.adaptive else "off"]
        worker = [sys.executable, "-m", "worker.main", *common, "--numa-node", "0"]
        return gateway, worker

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Start both processes and wait until the gateway has a ready worker; ModelLoadError
        (with the end of its log) when one of them exits first."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = dict(os.environ)
        if self.config.gateway.api_key:
            env["REAME_API_KEY"] = self.config.gateway.api_key  # not in argv, where ps shows it
        for role, argv in zip(("gateway", "worker"), self._argv()):
            with open(self.state_dir / f"{role}.log", "ab") as out:
                self._processes.append(await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                    preexec_fn=exit_with_parent()))
        while True:
            for role, process in zip(("gateway", "worker"), self._processes):
                if process.returncode is not None:
                    tail = _tail(self.state_dir / f"{role}.log")
                    await self.stop()
                    raise ModelLoadError(f"its {role} exited ({process.returncode}): {tail}")
            try:
                async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(HEALTH_POLL_S)

    def resident_bytes(self) -> int:
        """The resident memory (RSS) of the model's gateway and worker and every process they
        started: what the host gives this model, KV pool included (committed at start-up)."""
        total = 0
        for process in self._processes:
            try:
                root = psutil.Process(process.pid)
                for member in [root, *root.children(recursive=True)]:
                    total += member.memory_info().rss
            except psutil.Error:  # it left meanwhile: what is gone holds nothing
                continue
        return total

    async def stop(self) -> None:
        """SIGTERM: the worker drains (running requests finish), then both exit."""
        for process in self._processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes:
            try:
                await asyncio.wait_for(process.wait(), self.config.worker.drain_timeout + 5)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        self._processes.clear()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
