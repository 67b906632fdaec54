"""The worker's speculator from reame.conf: off with adaptive off or enabled = off; the archive's
store where archive_path says, RAM only where it is empty or cannot be opened."""
from __future__ import annotations

from dataclasses import replace

import pytest

from shared.config import Config, SpeculativeSection, TuningSection
from shared.errors import ConfigError
from worker.speculative.setup import build_speculator

MODEL = "ab" * 32


def _config(tmp_path, adaptive=True, **spec) -> Config:
    spec.setdefault("archive_path", str(tmp_path / "archive"))
    return replace(Config(), tuning=TuningSection(adaptive=adaptive), speculative=SpeculativeSection(**spec))


@pytest.mark.parametrize("adaptive, enabled", [(False, "auto"), (False, "on"), (True, "off")])
def test_off_builds_nothing(tmp_path, adaptive, enabled):
    assert build_speculator(_config(tmp_path, adaptive, enabled=enabled), MODEL) == (None, None)
    assert not (tmp_path / "archive").exists()


def test_on_builds_a_speculator_with_the_configured_draft_and_an_archive_on_disk(tmp_path):
    speculator, store = build_speculator(_config(tmp_path, max_draft=5), MODEL)
    try:
        assert speculator.max_draft == 5 and speculator.archive.backing is store
        assert (tmp_path / "archive" / "data.mdb").exists()
    finally:
        store.close()


def test_no_archive_path_keeps_the_archive_in_ram_and_an_unusable_one_too(tmp_path):
    speculator, store = build_speculator(_config(tmp_path, archive_path=""), MODEL)
    assert store is None and speculator.archive is not None and speculator.archive.backing is None
    (tmp_path / "file").write_text("not a directory")
    speculator, store = build_speculator(_config(tmp_path, archive_path=str(tmp_path / "file")), MODEL)
    assert store is None and speculator.archive.backing is None


def test_a_draft_length_below_one_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError):
        build_speculator(_config(tmp_path, max_draft=0), MODEL)
