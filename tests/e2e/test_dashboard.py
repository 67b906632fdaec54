"""GET /dashboard in headless Chromium (Debian's `chromium`, listed in .ci/debian-packages): the
page loads against a live gateway, its charts receive the profiles' data, a screenshot is taken."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.fakes import FakeServer
from tests.system_tools import require_tool
from tests.unit.test_tuning_gateway import WORKER, add_tuned_worker, feed

pytestmark = pytest.mark.system_tool("chromium", "chromium-browser", package="chromium")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--virtual-time-budget=4000", "--window-size=1280,900"]


def chromium() -> str:
    return require_tool("chromium", "chromium-browser", package="chromium")


@pytest.fixture
def server(tmp_path):
    srv = FakeServer(tmp_path, f"[tuning]\nstate_path = {tmp_path / 'tuning'}\n", workers=0)
    yield srv
    srv.close()


def test_the_dashboard_draws_live_data(server, tmp_path):
    add_tuned_worker(server, WORKER)
    feed(server, 3, output_tokens=600)  # 3 profiles: 1,800 tokens in the first buckets
    dom = subprocess.run([chromium(), *CHROMIUM_FLAGS, "--dump-dom", server.url + "/dashboard"],
                         capture_output=True, text=True, timeout=60).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body, dom[:500]
    attributes = dict(re.findall(r'data-(\w+)="([^"]*)"', body.group(1)))
    assert int(attributes["updates"]) >= 1 and int(attributes["points"]) >= 1
    assert float(attributes["throughput"]) > 0  # the curve has the tokens the profiles reported
    assert "[reame] adaptive report @" in dom and "adaptive on" in dom
    shot = tmp_path / "dashboard.png"
    subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--screenshot={shot}", server.url + "/dashboard"],
                   capture_output=True, timeout=60, check=True)
    assert shot.stat().st_size > 10_000
