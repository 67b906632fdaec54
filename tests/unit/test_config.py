"""reame.conf parsing: typed values, documented defaults, unknown keys are start-up errors."""
from __future__ import annotations

import configparser
import dataclasses
from pathlib import Path

import pytest

from shared.config import Config, load_config, override, parse_config
from shared.errors import ConfigError

REPO_CONF = Path(__file__).resolve().parents[2] / "reame.conf"


def test_shipped_file_parses_and_matches_the_defaults():
    config = load_config(REPO_CONF)
    assert dataclasses.replace(config, source="") == Config()


def test_every_known_key_is_documented_in_the_shipped_file():
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(REPO_CONF)
    documented = _keys_with_a_comment(REPO_CONF.read_text().splitlines())
    for section in (f.name for f in dataclasses.fields(Config) if f.name != "source"):
        assert parser.has_section(section), f"[{section}] missing from reame.conf"
        for key in dataclasses.fields(getattr(Config(), section)):
            assert parser.has_option(section, key.name), f"[{section}] {key.name} not in reame.conf"
            assert (section, key.name) in documented, f"[{section}] {key.name} has no comment above it"


def _keys_with_a_comment(lines: list[str]) -> set[tuple[str, str]]:
    """Keys with a comment line right above them, or named in a comment of their section."""
    out, section, commented, comments = set(), "", False, {}
    keys: list[tuple[str, str]] = []
    for line in (raw.strip() for raw in lines):
        if line.startswith("["):
            section, commented = line.strip("[]"), False
        elif line.startswith("#"):
            commented = True
            comments[section] = comments.get(section, "") + " " + line.lower()
        elif "=" in line:
            key = line.split("=")[0].strip()
            keys.append((section, key))
            if commented:
                out.add((section, key))
            commented = False
    out.update((sec, key) for sec, key in keys if key.replace("_", " ") in comments.get(sec, "") or key in comments.get(sec, ""))
    return out


def test_values_are_typed():
    config = parse_config("[engine]\nthreads = 2\nkernels = reference\n[logging]\nlog_prompts = yes\n")
    assert config.engine.threads == 2
    assert config.engine.kernels == "reference"
    assert config.logging.log_prompts is True


@pytest.mark.parametrize("text, message", [
    ("[engine]\nthreadz = 2\n", "unknown key 'threadz' in \\[engine\\]"),
    ("[enigne]\nthreads = 2\n", "unknown section \\[enigne\\]"),
    ("[engine]\nthreads = two\n", "threads = 'two' is not a valid int"),
    ("[engine]\nkernels = fastest\n", "kernels = 'fastest'; expected one of"),
    ("[engine\nthreads = 2\n", "cannot parse"),
])
def test_bad_files_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(text)


def test_config_is_frozen_and_overrides_make_copies():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.engine.threads = 3  # type: ignore[misc]
    changed = override(config, "engine", threads=3, kernels=None)
    assert changed.engine.threads == 3 and config.engine.threads == 0
    assert changed.engine.kernels == config.engine.kernels


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    path = tmp_path / "reame.conf"
    path.write_text("[model]\nmodels_dir = ./m\n")
    config = load_config(path)
    assert config.resolve_path(config.model.models_dir) == tmp_path / "m"


def test_missing_explicit_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.conf")
