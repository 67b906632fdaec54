"""docs/configuration.md is generated from shared/config.py and reame.conf's comments: it must be
up to date, and name every section and key with its default."""
from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import pytest

from shared.config import Config

REPO = Path(__file__).resolve().parents[2]
generator = runpy.run_path(str(REPO / "docs" / "generate_configuration.py"))


def test_configuration_reference_is_up_to_date():
    assert (REPO / "docs/configuration.md").read_text(encoding="utf-8") == generator["render"](), \
        "docs/configuration.md is out of date: run python docs/generate_configuration.py"


def test_every_key_is_documented_with_its_default():
    text = generator["render"]()
    for section in dataclasses.fields(Config):
        if section.name == "source":
            continue
        assert f"## [{section.name}]" in text
        for key in dataclasses.fields(section.default_factory()):
            row = next((line for line in text.splitlines() if line.startswith(f"| `{key.name}` |")), None)
            assert row is not None, f"[{section.name}] {key.name} missing"
            assert row.rstrip(" |").split("|")[-1].strip(), f"[{section.name}] {key.name} has no description"


def test_a_key_without_a_comment_in_reame_conf_is_an_error(tmp_path, monkeypatch):
    shipped = (REPO / "reame.conf").read_text(encoding="utf-8")
    stripped = shipped.replace("# Seconds between a worker's heartbeats.\n", "")
    assert stripped != shipped
    conf = tmp_path / "reame.conf"
    conf.write_text(stripped)
    render = generator["render"]
    monkeypatch.setitem(render.__globals__, "SHIPPED", conf)
    with pytest.raises(SystemExit, match=r"\[server\] heartbeat_interval"):
        render()
