"""CURVE between gateway and workers: key files, the config checks, and the ZAP handler letting in
only authorized keys (real ZeroMQ sockets over loopback TCP)."""
from __future__ import annotations

import asyncio
import logging
import shutil
import stat

import pytest
import zmq
import zmq.asyncio

from gateway.worker_auth import WorkerAuthenticator
from shared.config import parse_config
from shared.zmq_keys import (check_transport, client_keys, generate, insecure_endpoints, load_key, secure_clients,
                          secure_server, server_keys)
from shared.errors import ConfigError


@pytest.fixture
def keys(tmp_path):
    """gateway and two worker key pairs; only worker-a's public key is authorized."""
    for name in ("gateway", "worker-a", "worker-b"):
        generate(tmp_path / "keys", name)
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(tmp_path / "keys/worker-a.key", authorized)
    return tmp_path


def test_generate_writes_a_private_secret_and_refuses_to_overwrite(tmp_path):
    public, secret = generate(tmp_path, "gateway")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pub, sec = load_key(secret, need_secret=True, what="x")
    assert load_key(public, need_secret=False, what="x") == (pub, None) and len(pub) == 40 and sec
    with pytest.raises(ConfigError, match="--force"):
        generate(tmp_path, "gateway")
    assert generate(tmp_path, "gateway", overwrite=True) == (public, secret)
    assert load_key(public, need_secret=False, what="x")[0] != pub


def conf(keys, server: str):
    return parse_config(f"[server]\n{server}\n", str(keys / "reame.conf"))


def test_config_checks_name_the_setting(keys):
    with pytest.raises(ConfigError, match="holds no secret key"):
        server_keys(conf(keys, "curve_gateway_key = keys/gateway.key\ncurve_authorized_keys = authorized"))
    with pytest.raises(ConfigError, match="curve_authorized_keys is not"):
        server_keys(conf(keys, "curve_gateway_key = keys/gateway.key_secret"))
    with pytest.raises(ConfigError, match="curve_worker_key is not"):
        client_keys(conf(keys, "curve_gateway_key = keys/gateway.key"))
    with pytest.raises(ConfigError, match="cannot read"):
        client_keys(conf(keys, "curve_gateway_key = keys/missing.key\ncurve_worker_key = keys/worker-a.key_secret"))
    assert server_keys(conf(keys, "")) is None and client_keys(conf(keys, "")) is None
    assert server_keys(conf(keys, "curve_gateway_key = keys/gateway.key_secret\ncurve_authorized_keys = authorized"))


@pytest.mark.parametrize("server, refused", [
    ("endpoint = tcp://0.0.0.0:5557", "reachable from other machines"),
    ("endpoint = tcp://10.0.0.1:5557", "reachable from other machines"),
    # Loopback is no boundary: any local user could register as a worker and be sent prompts.
    ("endpoint = tcp://127.0.0.1:5557", "open to every local user"),
    ("endpoint = tcp://[::1]:5557", "open to every local user"),
    ("endpoint = tcp://127.0.0.1:5557\ninsecure_tcp = true", None),
    ("endpoint = tcp://0.0.0.0:5557\ninsecure_tcp = true", None),
    ("endpoint = tcp://0.0.0.0:5557\ncurve_gateway_key = k", None),
    ("", None),  # ipc://, the default: the socket is the owner's alone
    ("endpoint = ipc:///run/reame/workers.ipc", None),
])
def test_a_tcp_endpoint_needs_curve_or_insecure_tcp(keys, server, refused):
    config = conf(keys, server)
    if refused:
        with pytest.raises(ConfigError, match=f"{refused} without authentication.*insecure_tcp = true"):
            check_transport(config)
    else:
        check_transport(config)


def test_insecure_tcp_is_logged_for_each_endpoint_it_opens(keys):
    config = parse_config("[server]\nendpoint = tcp://127.0.0.1:5557\ninsecure_tcp = true\n"
                          "[tuning]\ncoordinator = tcp://127.0.0.1:5560\n", str(keys / "reame.conf"))
    warnings = insecure_endpoints(config)
    assert len(warnings) == 2 and "tcp://127.0.0.1:5557" in warnings[0] and "tcp://127.0.0.1:5560" in warnings[1]
    assert insecure_endpoints(conf(keys, "")) == []


async def _exchange(keys, worker: str | None, authorized_later: bool = False) -> tuple[bool, WorkerAuthenticator]:
    """Whether a worker with `worker`'s key (None: no CURVE) gets a message through the gateway's socket."""
    config = conf(keys, "curve_gateway_key = keys/gateway.key_secret\ncurve_authorized_keys = authorized")
    context = zmq.asyncio.Context()
    auth = WorkerAuthenticator(context, keys / "authorized")
    auth.start()
    router = context.socket(zmq.ROUTER)
    secure_server(router, server_keys(config))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    if authorized_later:
        shutil.copy(keys / f"keys/{worker}.key", keys / "authorized")
    client_context = zmq.asyncio.Context()
    if worker is not None:
        worker_conf = conf(keys, f"curve_gateway_key = keys/gateway.key\ncurve_worker_key = keys/{worker}.key_secret")
        secure_clients(client_context, client_keys(worker_conf))
    dealer = client_context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    await dealer.send(b"hello")
    got = await router.poll(1500)
    for sock in (dealer, router):
        sock.close(linger=0)
    await auth.close()
    client_context.term()
    context.term()
    return bool(got), auth


@pytest.mark.parametrize("worker, admitted", [("worker-a", True), ("worker-b", False), (None, False)])
def test_only_authorized_workers_get_through(keys, caplog, worker, admitted):
    with caplog.at_level(logging.INFO, logger="reame"):
        got, auth = asyncio.run(_exchange(keys, worker))
    assert got == admitted
    assert (auth.refused > 0) == (not admitted and worker is not None)
    if worker == "worker-b":
        public = load_key(keys / "keys/worker-b.key", need_secret=False, what="x")[0].decode()
        refusals = [r for r in caplog.records if "refused a worker from 127.0.0.1" in r.getMessage()]
        assert len(refusals) == 1 and public in refusals[0].getMessage()  # once, though it retries


def test_a_key_added_to_the_directory_is_let_in_without_a_restart(keys):
    got, _ = asyncio.run(_exchange(keys, "worker-b", authorized_later=True))
    assert got


def test_a_refused_worker_says_so_in_its_own_log(keys, caplog):
    """The worker side of a refusal: its log names the key to authorize."""
    import threading

    from worker.refusal_watch import RefusalWatch

    config = conf(keys, "curve_gateway_key = keys/gateway.key_secret\ncurve_authorized_keys = authorized")
    ready, done = threading.Event(), threading.Event()
    port = []

    def gateway():
        async def serve():
            context = zmq.asyncio.Context()
            auth = WorkerAuthenticator(context, keys / "authorized")
            auth.start()
            router = context.socket(zmq.ROUTER)
            secure_server(router, server_keys(config))
            port.append(router.bind_to_random_port("tcp://127.0.0.1"))
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)
            router.close(linger=0)
            await auth.close()
            context.term()
        asyncio.run(serve())

    thread = threading.Thread(target=gateway)
    thread.start()
    ready.wait(5)
    worker_conf = conf(keys, "curve_gateway_key = keys/gateway.key\ncurve_worker_key = keys/worker-b.key_secret")
    client = client_keys(worker_conf)
    context = zmq.Context()
    secure_clients(context, client)
    sock = context.socket(zmq.DEALER)
    endpoint = f"tcp://127.0.0.1:{port[0]}"
    watch = RefusalWatch(sock, endpoint, client.public)
    watch.start()
    try:
        with caplog.at_level(logging.INFO, logger="reame"):
            sock.connect(endpoint)
            for _ in range(100):
                if watch.refused:
                    break
                threading.Event().wait(0.05)
    finally:
        watch.stop()
        sock.close(linger=0)
        context.term()
        done.set()
        thread.join(5)
    assert watch.refused >= 1
    own = [r.getMessage() for r in caplog.records if "refused this worker's CURVE key" in r.getMessage()]
    assert len(own) == 1 and client.public.decode() in own[0]
