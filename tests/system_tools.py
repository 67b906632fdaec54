"""Tests that drive a system tool (Chromium, nginx, systemd): one policy for when it is missing.

On a developer's machine such a test skips and says how to install the tool, so `make test`
passes on a bare machine. CI (`.ci/run`) sets REAME_REQUIRE_SYSTEM_TOOLS=1 after installing the
Debian packages of `.ci/debian-packages`: there a missing tool that one of them provides fails
the test instead, so a broken install cannot pass as skipped tests. A tool no listed package
provides (kubectl) stays optional everywhere.

    pytestmark = pytest.mark.system_tool("nginx", package="nginx")   # a module, or one test
    path = require_tool("chromium", "chromium-browser", package="chromium")   # in a fixture
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REQUIRE_VARIABLE = "REAME_REQUIRE_SYSTEM_TOOLS"
CI_PACKAGES = Path(__file__).resolve().parent.parent / ".ci" / "debian-packages"
# Where Debian puts daemons, outside a normal user's PATH.
_SBIN = ("/usr/sbin", "/sbin")


def ci_packages() -> set[str]:
    """The Debian packages CI installs (one a line; # comments)."""
    lines = CI_PACKAGES.read_text(encoding="utf-8").splitlines() if CI_PACKAGES.is_file() else []
    return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}


def required() -> bool:
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def find_tool(*names: str) -> str | None:
    """The path of the first of `names` installed (on PATH or in an sbin directory), or None."""
    for name in names:
        path = shutil.which(name) or next((str(Path(d) / name) for d in _SBIN
                                           if os.access(Path(d) / name, os.X_OK)), None)
        if path:
            return path
    return None


def missing_message(names: tuple[str, ...], package: str | None) -> str:
    tool = " or ".join(f"`{n}`" for n in names)
    if package is None:
        return f"{tool} is not installed (optional: no Debian package in {CI_PACKAGES.name} provides it)"
    return f"{tool} is not installed: apt-get install -y {package} (listed in .ci/debian-packages)"


def require_tool(*names: str, package: str | None) -> str:
    """The tool's path; without it, skip the calling test, or fail it where CI requires the
    tools and `package` is one CI installs."""
    path = find_tool(*names)
    if path is not None:
        return path
    message = missing_message(names, package)
    if required() and package in ci_packages():
        pytest.fail(f"{message}; {REQUIRE_VARIABLE} is set, so a missing tool is a failure", pytrace=False)
    pytest.skip(message)


def check_marked(item: pytest.Item) -> None:
    """Applies every `system_tool` mark of a test item (called by tests/conftest.py at set-up)."""
    for mark in item.iter_markers("system_tool"):
        require_tool(*mark.args, package=mark.kwargs.get("package"))
