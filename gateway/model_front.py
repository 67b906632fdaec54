"""Several models behind one URL: the front that `reame serve` runs when it serves more than one.

A request's `model` field picks the model (shared.model_registry; none: the first). The model is
loaded on demand (gateway.model_loader: one load for concurrent first requests, idle models
unloaded to stay under [models] memory_budget, never one with requests running) and the request
is forwarded, streamed, to that model's own gateway and worker (gateway.model_backends).

    GET  /v1/models              every model with its state (loaded, loading, unloaded) and bytes
    GET  /admin/models           the same, with running requests and the budget
    POST /admin/models           {"model": NAME, "action": "load" | "unload" | "pin" | "unpin"}
    GET  /admin/models/NAME/...  a loaded model's own /admin/... (its report, series, strategy)
    GET  /metrics                the front's gauges per model, then each loaded model's series
                                 labelled model="NAME" (gateway.model_metrics)
    GET  /dashboard              a page listing the models, their memory and each loaded one's report
    GET  /health                 200 once the front listens (models load on demand)

/admin/*, /metrics and /dashboard are the operator's, as on a single model's gateway
(gateway.auth): a tenant's key gets 403, and the front passes the operator's key on to the
model's gateway, which reads the same keys.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from gateway.auth import auth_middleware, load_tenants
from gateway.errors import (ConflictError, ModelNotFoundError, PayloadTooLargeError, ServiceUnavailableError,
                            error_middleware)
from gateway.html_pages import page_response
from gateway.json_response import json_response
from gateway.metrics import CONTENT_TYPE
from gateway.model_backends import Backend, estimate_bytes
from gateway.model_loader import ModelLoader
from gateway.model_metrics import front_families, labelled, render
from gateway.model_residency import LOADED, Residency
from shared.command_line import run_process
from shared.config import Config, load_config, model_flag, override
from shared.errors import ConfigError, InvalidRequestError
from shared.logs import setup_logging
from shared.model_registry import ModelEntry, ModelRepository, default_keep_alive, memory_budget, repository_for

log = logging.getLogger("reame.front")

_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
EXPIRY_CHECK_S = 1.0
SCRAPE_TIMEOUT_S = 5.0  # a model's gateway answers /metrics in milliseconds; a stuck one is left out


@dataclass
class Front:
    config: Config
    repository: ModelRepository
    loader: ModelLoader
    backends: dict[str, Backend]
    session: aiohttp.ClientSession | None = None
    created: int = 0


FRONT = web.AppKey("front", Front)


def build_front(config: Config, repository: ModelRepository, available: int) -> Front:
    """The repository's models, none loaded; `available`: the RAM a share of budget is taken of."""
    if len(repository.entries) > 1 and config.server.endpoint:
        raise ConfigError("reame.conf: [server] endpoint is one model's; with several models each "
                          "gets its own under state_dir: leave endpoint empty")
    for entry in repository.entries:
        if entry.context_length and entry.context_length != config.engine.context_length:
            # Each model's processes read [engine] from the shared file: not silently ignored.
            raise ConfigError(f"reame.conf: [models] serve: {entry.name}'s context_length is not applied "
                              f"per model yet; set [engine] context_length instead")
    from shared.model_store import model_file

    backends: dict[str, Backend] = {}
    sizes: dict[str, int] = {}

    async def load(entry: ModelEntry) -> int:
        # Pulling, or finding the file, blocks: off the event loop. A bad path fails here.
        path = await asyncio.get_running_loop().run_in_executor(None, model_file, config, entry.reference)
        backend = backends[entry.name] = Backend(config, entry, path)
        await backend.start(front.session)
        # What it holds once ready, measured (never less than the estimate it was admitted by, so
        # a model's size only grows from what admitted it); its next load is admitted by this.
        measured = await asyncio.to_thread(backend.resident_bytes)
        sizes[entry.name] = max(measured, estimate_bytes(config, path))
        return sizes[entry.name]

    async def unload(name: str) -> None:
        backend = backends.pop(name, None)
        if backend is not None:
            await backend.stop()

    def estimate(entry: ModelEntry) -> int:
        # A loaded model's last measured size; before that, an estimate from its file (a name not
        # pulled yet counts from its first load on).
        path = Path(entry.reference)
        if entry.name not in sizes and path.is_file():
            sizes[entry.name] = estimate_bytes(config, path)
        return sizes.get(entry.name, 0)

    keep = {e.name: default_keep_alive(config, e) for e in repository.entries}
    loader = ModelLoader(Residency(memory_budget(config, available), keep),
                         {e.name: e for e in repository.entries}, load, unload, estimate,
                         timeout=config.models.load_timeout)
    front = Front(config, repository, loader, backends, created=int(time.time()))
    return front  # load() reads front.session, made when the app starts


def build_front_app(front: Front) -> web.Application:
    middlewares = [error_middleware]
    tenants = load_tenants(front.config)
    if tenants:
        middlewares.append(auth_middleware(tenants))
    app = web.Application(middlewares=middlewares, client_max_size=front.config.gateway.max_body_bytes)
    app[FRONT] = front
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/admin/models", admin_models)
    app.router.add_post("/admin/models", admin_action)
    app.router.add_get("/admin/models/{name}/{tail:.+}", admin_of_model)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/{tail:.*}", forward)
    app.router.add_post("/infill", forward)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def list_models(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    states = {m["id"]: m for m in front.loader.listing()}
    data = [{"id": e.name, "object": "model", "created": front.created, "owned_by": "reame",
             "aliases": list(e.aliases), "state": states[e.name]["state"], "size": states[e.name]["size"]}
            for e in front.repository.entries]
    return json_response({"object": "list", "data": data})


async def admin_models(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    residency = front.loader.residency
    models = [{**m, "pinned": math.isinf(residency.models[m["id"]].keep_alive),
               "error": residency.models[m["id"]].error} for m in front.loader.listing()]
    return json_response({"budget": residency.budget, "used": residency.used(), "models": models})


async def admin_action(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    body = await _read_json(request, front.config)
    if not isinstance(body, dict) or body.get("action") not in ("load", "unload", "pin", "unpin"):
        raise InvalidRequestError("expected {\"model\": NAME, \"action\": \"load\" | \"unload\" | \"pin\" | "
                                  "\"unpin\"}", param="action")
    entry = _entry(front, body.get("model"))
    action = body["action"]
    if action == "load":
        await front.loader.ensure(entry.name)
    elif action == "unload" and not await front.loader.unload(entry.name):
        if front.loader.residency.models[entry.name].running:
            raise ConflictError(f"model {entry.name!r} has requests running; it is unloaded once idle "
                                f"if its keep_alive allows", param="model")
    elif action in ("pin", "unpin"):
        front.loader.residency.pin(entry.name, math.inf if action == "pin"
                                   else default_keep_alive(front.config, entry))
    return await admin_models(request)


async def admin_of_model(request: web.Request) -> web.Response:
    """A loaded model's own /admin/TAIL (what its gateway's dashboard reads); a model that is not
    loaded is not loaded for it: 409."""
    front = request.app[FRONT]
    entry = _entry(front, request.match_info["name"])
    backend = front.backends.get(entry.name)
    if backend is None or front.loader.residency.models[entry.name].state != LOADED:
        raise ConflictError(f"model {entry.name!r} is not loaded", param="model")
    try:
        async with front.session.get(f"{backend.url}/admin/{request.match_info['tail']}", params=request.query,
                                     headers=_passed_key(request),
                                     timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # unloaded meanwhile, or stuck
        raise ServiceUnavailableError(f"model {entry.name!r} did not answer: {exc or type(exc).__name__}") from None


async def metrics(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    residency = front.loader.residency
    loaded = {name: backend for name, backend in front.backends.items() if residency.models[name].state == LOADED}
    texts = await asyncio.gather(*(_scrape(front, backend, request) for backend in loaded.values()))
    got = {name: text for name, text in zip(loaded, texts) if text is not None}
    families = front_families(front.loader.listing(), residency.budget, {name: name in got for name in loaded})
    return web.Response(body=render(families + labelled(got)), headers={"Content-Type": CONTENT_TYPE})


async def _scrape(front: Front, backend: Backend, request: web.Request) -> str | None:
    try:
        async with front.session.get(backend.url + "/metrics", headers=_passed_key(request),
                                     timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as r:
            if r.status == 200:
                return await r.text()
            log.warning("model %s: /metrics answered %d", backend.entry.name, r.status)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # unloaded meanwhile, or stuck
        log.warning("model %s: /metrics failed: %s", backend.entry.name, exc or type(exc).__name__)
    return None


def _passed_key(request: web.Request) -> dict[str, str]:
    header = request.headers.get("Authorization")
    return {"Authorization": header} if header else {}


async def dashboard(request: web.Request) -> web.Response:
    return page_response("models_dashboard.html")


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok", "models": request.app[FRONT].repository.served()})


async def forward(request: web.Request) -> web.StreamResponse:
    """The request, as it came, to its model's gateway; the answer streamed back as it comes."""
    front = request.app[FRONT]
    raw = await request.read() if request.can_read_body else b""
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    entry = _entry(front, body.get("model") if isinstance(body, dict) else None)
    if isinstance(body, dict) and body.get("model") not in (None, entry.name):
        # An alias, or a file name: the model's own gateway knows it by its registry name.
        raw = orjson.dumps({**body, "model": entry.name})
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    async with front.loader.use(entry.name):
        backend = front.backends[entry.name]
        async with front.session.request(request.method, backend.url + request.rel_url.path_qs,
                                         headers=headers, data=raw) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _entry(front: Front, name: object) -> ModelEntry:
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError("'model' must be a string", param="model")
    entry = front.repository.lookup(name)
    if entry is None:
        served = ", ".join(f"'{n}'" for n in front.repository.served())
        raise ModelNotFoundError(f"The model '{name}' does not exist; this server serves {served}", param="model")
    return entry


async def _read_json(request: web.Request, config: Config) -> object:
    if request.content_length is not None and request.content_length > config.gateway.max_body_bytes:
        raise PayloadTooLargeError(f"the request body is {request.content_length} bytes; the limit is "
                                   f"{config.gateway.max_body_bytes}")
    try:
        return orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


async def _start(app: web.Application) -> None:
    front = app[FRONT]
    # No total timeout: a long generation streams for as long as it runs.
    front.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def expire() -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            await front.loader.unload_expired()

    app["expiry"] = asyncio.ensure_future(expire())


async def _stop(app: web.Application) -> None:
    front = app[FRONT]
    app["expiry"].cancel()
    for name in list(front.backends):
        await front.loader.unload(name)
    for backend in list(front.backends.values()):  # ones still busy at shutdown
        await backend.stop()
    await front.session.close()



def available_ram() -> int:
    """MemAvailable from /proc/meminfo (free plus reclaimable cache), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


async def serve(config: Config, repository: ModelRepository) -> None:
    front = build_front(config, repository, available_ram())
    runner = web.AppRunner(build_front_app(front), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, config.gateway.host, config.gateway.port).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {config.gateway.host}:{config.gateway.port}: {exc.strerror}") from None
        log.info("front: serving %s on http://%s:%d/v1 (budget %.0f MiB)", ", ".join(repository.served()),
                 config.gateway.host, config.gateway.port, front.loader.residency.budget / 2**20)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reame-front", description="Several models behind one gateway.")
    parser.add_argument("--config", help="reame.conf to read")
    parser.add_argument("--model", action="append", default=[], help="a model to serve (repeat for several)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--state-dir", help="runtime directory; each model's is under it ([server] state_dir)")
    args = parser.parse_args(argv)

    def start() -> None:
        config = load_config(args.config)
        config = override(config, "gateway", host=args.host, port=args.port,
                          api_key=os.environ.get("REAME_API_KEY") or None)
        config = override(config, "server", state_dir=args.state_dir)
        setup_logging(config.logging.level, "front")
        repository = repository_for(config, [model_flag(m) for m in args.model])
        asyncio.run(serve(config, repository))

    return run_process("reame-front", start)


if __name__ == "__main__":
    sys.exit(main())
