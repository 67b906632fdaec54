"""The learned kernel table on disk, and the worker's KernelTuner built from reame.conf.

One file per (host CPU model and flags, model file, Reame version and engine code, numerics,
threads), in learned state's format (shared.saved_state), under the deployment's tuning
directory (`[tuning] state_path`, else <[server] state_dir>/tuning): a restarted worker on the
same host and model starts on what it learned, skipping calibration; any other combination
starts fresh (a table measured for another CPU or another build of the kernels says nothing
about this one).
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from shared import saved_state
from shared.config import Config
from shared.private_state import make_private
from worker.engine.tuning.kernel_tuner import FixedKernels, KernelTuner, TunerSettings, arm_name

log = logging.getLogger("reame.kernel_tuner")

FILE_PREFIX = "kernels-"
KIND = "reame.kernel_table"
VERSION = 1


def host_signature(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU model and a digest of its feature flags (what decides which kernels win)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in fields:
            fields[key] = value.strip()
    flags = " ".join(sorted((fields.get("flags") or fields.get("Features") or "").split()))
    return {"cpu": fields.get("model name") or fields.get("CPU part") or platform.processor() or platform.machine(),
            "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def reame_version() -> str:
    try:
        return version("reame")
    except PackageNotFoundError:
        return "unknown"


class KernelTableStore:
    """Load and save one key's table; `parts` names what the key is made of (shown by `reame tune show`)."""

    def __init__(self, directory: Path, parts: dict[str, str]):
        self.directory = Path(directory)
        self.parts = dict(parts)
        digest = hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()[:20]
        self.path = self.directory / f"{FILE_PREFIX}{digest}.json"

    def load(self) -> dict | None:
        """The saved choices {bucket: [matmul variant, threads, attention variant]}, or None (none
        saved, another key, unreadable). ConfigError when the directory belongs to another user (start-up is refused)."""
        try:
            make_private(self.directory, "[tuning] state_path", log)
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kernel table %s unreadable (%s): starting fresh", self.path, exc)
            return None
        saved = saved_state.decode(data, KIND, VERSION)
        if saved is None:
            log.warning("kernel table %s damaged or of another version: starting fresh", self.path)
            return None
        if saved.get("key") != self.parts or not isinstance(saved.get("choices"), dict):
            return None
        return saved["choices"]

    def save(self, choices: dict) -> None:
        """Write atomically (a reader never sees half a file); a failure is a warning, never fatal."""
        record = {"key": self.parts, "choices": {k: list(v) for k, v in choices.items()}, "saved_at": time.time()}
        try:
            saved_state.write_file(self.path, saved_state.encode(KIND, VERSION, record, indent=1))
        except OSError as exc:
            log.warning("kernel table not saved to %s: %s", self.path, exc)


def saved_tables(directory: Path) -> list[tuple[Path, dict]]:
    """Every table under directory, (path, record); unreadable files are listed with an "error"."""
    out = []
    for path in sorted(Path(directory).glob(f"{FILE_PREFIX}*.json")):
        try:
            record = saved_state.decode(path.read_bytes(), KIND, VERSION)
        except OSError as exc:
            out.append((path, {"error": str(exc)}))
            continue
        damaged = {"error": "damaged, or not a kernel table of this version"}
        out.append((path, record if record is not None else damaged))
    return out


def reset_tables(directory: Path) -> int:
    """Delete every saved table under directory; how many were removed."""
    removed = 0
    for path in Path(directory).glob(f"{FILE_PREFIX}*.json"):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def table_directory(config: Config) -> Path:
    """The deployment's tuning directory ([tuning] state_path, else <[server] state_dir>/tuning)."""
    return config.tuning_path


def build_kernel_tuner(config: Config, engine) -> KernelTuner | FixedKernels:
    """The worker's tuner: the saved table for this host and model when there is one, else a
    bounded calibration; with `[tuning] kernels = fixed` or `adaptive = false`, the engine's
    choice and no exploration at all."""
    settings = TunerSettings.from_config(config)
    if not settings.enabled:
        log.info("kernel tuner: off (kernels and threads as [engine] says)")
        return FixedKernels(engine)
    from worker.engine import SOURCE_DIGEST
    parts = {**host_signature(), "model_sha256": engine.gguf.fingerprint(), "reame": reame_version(),
             "engine_code": SOURCE_DIGEST, "numerics": engine.ops.numerics("matmul"), "threads": str(engine.threads)}
    store = KernelTableStore(table_directory(config), parts)
    tuner = KernelTuner(engine, settings, saved=store.save)
    choices = store.load()
    if choices is not None and tuner.adopt(choices):
        tuner.verify()
        log.info("kernel tuner: starting on the saved table %s (%s)", store.path,
                 ", ".join(f"{b} rows: {arm_name(arm)}" for b, arm in tuner.choices().items()))
    else:
        log.info("kernel tuner: no saved table for this host and model; calibrating (at most %.0f s)",
                 settings.calibration_s)
        tuner.calibrate()
    return tuner
