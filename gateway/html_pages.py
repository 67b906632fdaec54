"""The gateway's HTML pages (the tuning dashboard, the models dashboard), served self-contained:
no build step, no CDN, no second request. What both pages need (fetching JSON with the API key)
is written once, in dashboard_fetch.js, and inlined where a page has the SHARED_SCRIPT mark."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

HERE = Path(__file__).parent
SHARED_SCRIPT = "/* dashboard_fetch.js */"


def page_bytes(name: str) -> bytes:
    """The page `name` (a file beside this module) with the shared script inlined. Read on each
    request: pages are small, and an edited page shows on the next reload."""
    html = (HERE / name).read_text(encoding="utf-8")
    return html.replace(SHARED_SCRIPT, (HERE / "dashboard_fetch.js").read_text(encoding="utf-8")).encode()


def page_response(name: str) -> web.Response:
    return web.Response(body=page_bytes(name), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})
