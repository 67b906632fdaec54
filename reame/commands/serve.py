"""`reame serve`: the gateway and its workers from one command.

    reame serve [--config FILE] [--model PATH|NAME] [--host H] [--port P] [--workers N]
                [--api-key K] [--state-dir DIR] [--adaptive on|off]

Pulls the model if it is a known one and missing, starts `reame-gateway` and one `reame-worker`
per NUMA node (or `workers` of them, sharing the nodes' CPUs), prints the URL once the gateway
reports a ready worker, restarts crashed children with back-off, and stops them all cleanly on
Ctrl-C or SIGTERM (a second Ctrl-C kills them at once).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.config import Config, adaptive_flag, add_adaptive_flag, load_config, model_flag, override
from shared.errors import ConfigError
from shared.logs import setup_logging

log = logging.getLogger("reame.serve")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server (gateway + workers)")
    # SUPPRESS: without a value here, the top-level `reame --config` stays in effect.
    p.add_argument("--config", default=argparse.SUPPRESS, help="reame.conf to read")
    p.add_argument("--model", action="append",
                   help="GGUF path or known model name ([model] model_path); repeat it to serve several "
                        "behind one URL, each under its file stem or name ([models] serve)")
    p.add_argument("--host", help="address to listen on ([gateway] host)")
    p.add_argument("--port", type=int, help="port to listen on ([gateway] port)")
    p.add_argument("--workers", type=int, help="worker processes; 0 = one per NUMA node ([serve] workers)")
    p.add_argument("--api-key", help="require this bearer token ([gateway] api_key)")
    p.add_argument("--state-dir", help="runtime directory ([server] state_dir)")
    add_adaptive_flag(p)
    p.set_defaults(handler=run)


def configure(args: argparse.Namespace) -> Config:
    config = load_config(getattr(args, "config", None))
    if args.workers is not None and args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: give 0 (one per NUMA node) or more")
    models = _model_flags(args)
    config = override(config, "model", model_path=models[0] if len(models) == 1 else None)
    config = override(config, "gateway", host=args.host, port=args.port,
                      api_key=args.api_key or os.environ.get("REAME_API_KEY") or None)
    config = override(config, "serve", workers=args.workers)
    config = override(config, "tuning", adaptive=adaptive_flag(args.adaptive))
    state_dir = str(Path(args.state_dir).expanduser().resolve()) if args.state_dir else None
    config = override(config, "server", state_dir=state_dir)
    from gateway.main import check_exposure

    check_exposure(config)  # refused here, before any child starts; the gateway logs the warnings
    return config


def plan_workers(wanted: int, nodes: dict[int, list[int]]) -> list[tuple[int, list[int] | None]]:
    """(node, CPU subset or None for the whole node) per worker. Workers sharing a node split its CPUs."""
    nodes = {n: cpus for n, cpus in nodes.items() if cpus}
    order = sorted(nodes)
    if wanted == 0:
        return [(n, None) for n in order]
    per_node = {n: [] for n in order}
    for i in range(wanted):
        per_node[order[i % len(order)]].append(i)
    plan = []
    for node in order:
        count = len(per_node[node])
        cpus = nodes[node]
        if count > len(cpus):
            raise ConfigError(f"workers = {wanted} leaves NUMA node {node} with more workers ({count}) "
                              f"than CPUs ({len(cpus)})")
        for k in range(count):
            share = cpus[k * len(cpus) // count:(k + 1) * len(cpus) // count]
            plan.append((node, None if count == 1 else share))
    return plan


def build_children(config: Config, model: Path):
    from reame.supervisor import Child
    from worker.numa import list_nodes, node_cpus

    common = ["--model", str(model), "--state-dir", str(config.resolve_path(config.server.state_dir)),
              "--adaptive", "on" if config.tuning.adaptive else "off"]
    if config.source:
        common += ["--config", config.source]
    env = {"REAME_API_KEY": config.gateway.api_key} if config.gateway.api_key else {}
    gateway = Child("gateway", [sys.executable, "-m", "gateway.main", *common, "--host", config.gateway.host,
                                "--port", str(config.gateway.port)], env)
    nodes = {}
    for node in list_nodes():
        try:
            nodes[node] = node_cpus(node)
        except ConfigError:  # a memory-only node: nothing to run there
            continue
    workers = []
    for i, (node, cpus) in enumerate(plan_workers(config.serve.workers, nodes)):
        argv = [sys.executable, "-m", "worker.main", *common, "--numa-node", str(node)]
        if cpus is not None:
            argv += ["--cpus", ",".join(map(str, cpus))]
        workers.append(Child(f"worker {i} (node {node})", argv))
    return gateway, workers


def run(args: argparse.Namespace) -> int:
    config = configure(args)
    setup_logging(config.logging.level, "serve")
    from shared.model_registry import repository_for

    repository = repository_for(config, _model_flags(args))
    if len(repository.entries) > 1:
        return _run_children(config, [_front_child(config, _model_flags(args))],
                             f"{', '.join(repository.served())} (loaded on demand)", 0)
    from shared.model_store import model_file

    model = model_file(config, progress=lambda line: log.info("%s", line))
    gateway, workers = build_children(config, model)
    return _run_children(config, [gateway, *workers], model.name, len(workers))


def _model_flags(args: argparse.Namespace) -> list[str]:
    """--model's values, as paths relative to the current directory (one, or a list of several)."""
    given = args.model if isinstance(args.model, list) else [args.model] if args.model else []
    return [model_flag(m) for m in given]


def _front_child(config: Config, models: list[str]):
    """Several models: the front (gateway.model_front) starts each model's gateway and worker."""
    from reame.supervisor import Child

    argv = [sys.executable, "-m", "gateway.model_front", "--host", config.gateway.host,
            "--port", str(config.gateway.port), "--state-dir", str(config.resolve_path(config.server.state_dir))]
    if config.source:
        argv += ["--config", config.source]
    for model in models:
        argv += ["--model", model]
    env = {"REAME_API_KEY": config.gateway.api_key} if config.gateway.api_key else {}
    return Child("front", argv, env)


def _run_children(config: Config, children: list, what: str, n_workers: int) -> int:
    from reame.supervisor import FatalChildError, Supervisor

    supervisor = Supervisor(children, config.serve.restart_backoff_max)
    signals = []
    previous = {sig: signal.signal(sig, lambda signum, _f: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    url = _public_url(config)
    log.info("serving %s with %d worker(s)", what, n_workers)
    try:
        supervisor.start_all()
        ready = False
        while not signals:
            supervisor.poll()
            if not ready and _healthy(url):
                ready = True
                _announce(url, config)
            time.sleep(0.2)
    except FatalChildError as exc:
        supervisor.stop(timeout=10)
        raise ConfigError(str(exc)) from None
    log.info("stopping: workers finish their requests (Ctrl-C again to stop at once)")
    signals.clear()
    for sig in previous:  # a second signal kills everything now
        signal.signal(sig, lambda signum, _f: supervisor.kill())
    supervisor.stop(timeout=config.worker.drain_timeout + 5)
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    log.info("stopped")
    return 0


def _public_url(config: Config) -> str:
    host = config.gateway.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.gateway.port}"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _announce(url: str, config: Config) -> None:
    key = " -H 'Authorization: Bearer $REAME_API_KEY'" if config.gateway.api_key else ""
    print(f"\nReame is ready: point an OpenAI client at {url}/v1 (model \"{config.model.model_id}\")\n"
          f"  curl {url}/v1/chat/completions{key} -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{config.model.model_id}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello!\"}}], \"stream\": true}}'\n", flush=True)
