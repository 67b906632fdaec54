"""The gateway's pages are served whole: the shared fetch script inlined into each, once."""
from __future__ import annotations

import pytest

from gateway.html_pages import SHARED_SCRIPT, page_bytes


@pytest.mark.parametrize("name", ["dashboard.html", "models_dashboard.html"])
def test_each_page_carries_the_shared_script_once_and_no_mark(name):
    html = page_bytes(name).decode()
    assert SHARED_SCRIPT not in html
    assert html.count("async function getJSON(path)") == 1 and html.count("function headers()") == 1
    assert html.index("async function getJSON(path)") < html.index("</script>")  # inside the page's script
