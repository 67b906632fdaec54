"""One policy for tests that need a system tool (issue 41.9): without the tool they skip and say
how to install it; where CI requires the tools (REAME_REQUIRE_SYSTEM_TOOLS=1) they fail instead."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import system_tools
from tests.system_tools import REQUIRE_VARIABLE, require_tool

REPO = Path(__file__).resolve().parents[2]
ABSENT = "reame-no-such-tool"


def test_a_missing_tool_skips_with_its_install_command(monkeypatch):
    monkeypatch.delenv(REQUIRE_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"`{ABSENT}` is not installed: apt-get install -y chromium"):
        require_tool(ABSENT, package="chromium")


def test_ci_turns_a_missing_tool_of_its_packages_into_a_failure(monkeypatch):
    monkeypatch.setenv(REQUIRE_VARIABLE, "1")
    assert "chromium" in system_tools.ci_packages()
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE_VARIABLE} is set"):
        require_tool(ABSENT, package="chromium")


def test_a_tool_ci_does_not_install_stays_optional_in_ci(monkeypatch):
    monkeypatch.setenv(REQUIRE_VARIABLE, "1")
    with pytest.raises(pytest.skip.Exception, match="optional"):
        require_tool(ABSENT, package=None)
    with pytest.raises(pytest.skip.Exception):
        require_tool(ABSENT, package="not-in-the-ci-list")


def test_a_present_tool_is_found():
    assert require_tool(ABSENT, Path(sys.executable).name, package="python3")


def test_ci_sets_the_variable_before_running_the_tests():
    run = (REPO / ".ci" / "run").read_text()
    assert f"export {REQUIRE_VARIABLE}=1" in run
    assert run.index(f"export {REQUIRE_VARIABLE}=1") < run.rindex("make test")


def pytest_of_the_dashboard(require: str | None) -> subprocess.CompletedProcess:
    """tests/e2e/test_dashboard.py on a machine without Chromium (PATH holds only the venv)."""
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_VARIABLE}
    env["PATH"] = str(Path(sys.executable).parent)
    if require is not None:
        env[REQUIRE_VARIABLE] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/e2e/test_dashboard.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(Path("/usr/sbin/chromium").exists(), reason="Chromium is installed in /usr/sbin")
def test_the_dashboard_test_skips_without_chromium_and_fails_where_ci_requires_it():
    bare = pytest_of_the_dashboard(None)
    assert bare.returncode == 0, bare.stdout[-3000:]
    assert "apt-get install -y chromium" in bare.stdout and " failed" not in bare.stdout
    ci = pytest_of_the_dashboard("1")
    assert ci.returncode == 1 and "1 error" in ci.stdout, ci.stdout[-3000:]  # failed in set-up
