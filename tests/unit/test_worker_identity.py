"""A worker id belongs to the connection that registered it (issue 41.5, 41.7): over CURVE to its
key, over ipc:// to its process; a second connection cannot register it, take its routing id and
be sent its prompts, or beat and profile in its name. And a worker whose serve loop does not read
what it is sent is dropped although its pulse beats (liveness from the data path).

Real ZeroMQ sockets: the gateway's WorkerPool against raw DEALER peers (another key over loopback
TCP; another process over ipc://)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import shutil
import subprocess
import sys
import textwrap

import zmq
import zmq.asyncio

from gateway.metrics import Metrics
from gateway.workers import Job, Restarted, WorkerPool
from shared import protocol
from shared.config import parse_config
from shared.zmq_keys import client_keys, generate, secure_clients, server_keys
from shared.protocol import Generate, Heartbeat, Profile
from shared.sampling import SamplingParams
from tests.harness import REPO, free_port
from tests.unit.test_worker_pool import GOOD, settle


def job(request_id: str) -> Job:
    return Job(request_id, 0, [1, 2, 3], SamplingParams(max_tokens=4), asyncio.Queue(), b"k")


def curve_keys(tmp_path):
    """The gateway's keys, and two authorized worker keys: "a" (the real worker) and "b" (another
    process with a valid key of its own, which must still not get a's prompts)."""
    for name in ("gateway", "a", "b"):
        generate(tmp_path / "keys", name)
    (tmp_path / "authorized").mkdir()
    for name in ("a", "b"):
        shutil.copy(tmp_path / f"keys/{name}.key", tmp_path / "authorized")
    gateway = parse_config("[server]\ncurve_gateway_key = keys/gateway.key_secret\ncurve_authorized_keys = authorized\n",
                           str(tmp_path / "reame.conf"))

    def worker(name: str):
        return client_keys(parse_config(f"[server]\ncurve_gateway_key = keys/gateway.key\n"
                                        f"curve_worker_key = keys/{name}.key_secret\n", str(tmp_path / "reame.conf")))
    return server_keys(gateway), worker("a"), worker("b")


def test_another_key_cannot_register_a_worker_id_take_its_jobs_or_beat_for_it(tmp_path, caplog):
    gateway_keys, key_a, key_b = curve_keys(tmp_path)
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    async def main():
        pool = WorkerPool(endpoint, Metrics(), heartbeat_interval=0.1, worker_timeout=30, curve=gateway_keys)
        profiles = []
        pool.on_profile = profiles.append
        await pool.start()
        contexts = {name: zmq.asyncio.Context() for name in ("a", "b")}
        secure_clients(contexts["a"], key_a)
        secure_clients(contexts["b"], key_b)

        def dealer(name: str, identity: bytes):
            sock = contexts[name].socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            return sock

        socks = [dealer("a", b"w0@4e1f0c")]  # worker.main's routing id: its id and a token
        real = socks[0]
        try:
            await real.send(protocol.encode(GOOD))
            await settle(lambda: "w0" in pool.workers)
            # b connects as w0 (the takeover: with ROUTER_HANDOVER it got w0's next prompt), and as
            # w0's pulse, and claims w0 in a Register, a Heartbeat and a Profile.
            thief = dealer("b", b"w0")
            thief_pulse = dealer("b", b"w0#pulse")
            socks += [thief, thief_pulse]
            await thief.send(protocol.encode(GOOD))
            await thief_pulse.send(protocol.encode(Heartbeat("w0", read_request="x", read_ms=0)))
            await thief_pulse.send(protocol.encode(Profile("w0", 1.0, 0)))
            await settle(timeout=0.3)
            pool.submit([job("r1")])
            got = await asyncio.wait_for(real.recv(), 5)
            thief_got = await thief.poll(300)
            # a's connection goes; b's stays and b connects again: w0 is still a's until the
            # gateway drops it, and a's routing id is not b's to take up.
            real.close()
            late = dealer("b", b"w0")
            socks.append(late)
            for sock in (thief, late):
                await sock.send(protocol.encode(GOOD))
            await settle(timeout=0.3)
            owner = pool.workers["w0"].peer
            pool.submit([job("r2")])
            thief_got = thief_got or await thief.poll(300) or await late.poll(300)
            return protocol.decode(got), thief_got, profiles, owner
        finally:
            for sock in socks:
                sock.close()
            for context in contexts.values():
                context.term()
            await pool.close()

    with caplog.at_level(logging.INFO, "reame.gateway"):
        got, thief_got, profiles, owner = asyncio.run(main())
    assert isinstance(got, Generate) and got.request_id == "r1"  # the prompt reached the real worker
    assert not thief_got  # and nothing ever reached the other key
    assert profiles == []
    assert owner == f"key {key_a.public.decode()}"
    assert "registered: node 0" in caplog.text and "(a.key)" in caplog.text
    ignored = [r.getMessage() for r in caplog.records if "worker w0: ignored a message from" in r.getMessage()]
    assert ignored and all(f"key {key_b.public.decode()}" in m for m in ignored)


IPC_THIEF = textwrap.dedent("""
    import sys, time, zmq
    from shared import protocol
    from shared.protocol import Heartbeat, Profile
    from tests.unit.test_worker_pool import GOOD
    context = zmq.Context()
    socks = []
    for identity in (b"w0", b"w0#pulse"):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(sys.argv[1])
        socks.append(sock)
    socks[0].send(protocol.encode(GOOD))
    socks[1].send(protocol.encode(Heartbeat("w0", read_request="x")))
    socks[1].send(protocol.encode(Profile("w0", 1.0, 0)))
    got = socks[0].poll(1500)
    for sock in socks:
        sock.close()
    context.term()
    print("GOT" if got else "NOTHING")
""")


def test_over_ipc_a_worker_id_belongs_to_the_process_that_registered_it(tmp_path, caplog):
    """Same user, another process: the kernel's peer credentials tell them apart."""
    endpoint = f"ipc://{tmp_path}/state/workers.ipc"

    async def main():
        pool = WorkerPool(endpoint, Metrics(), heartbeat_interval=0.1, worker_timeout=30)
        profiles = []
        pool.on_profile = profiles.append
        await pool.start()
        context = zmq.asyncio.Context()
        real = context.socket(zmq.DEALER)
        # As worker.main names it: the worker id, "@", a secret token; the thief knows only "w0".
        # (With a bare "w0" the thief would take the routing id up once the real socket went,
        # and whether it was sent r1 depended on how fast it started: CI saw GOT.)
        real.setsockopt(zmq.IDENTITY, b"w0@" + secrets.token_hex(16).encode())
        real.setsockopt(zmq.LINGER, 0)
        real.connect(endpoint)
        try:
            await real.send(protocol.encode(GOOD))
            await settle(lambda: "w0" in pool.workers)
            owner = pool.workers["w0"].peer
            real.close()  # the real worker's socket goes (a reconnect, a crash): "w0" is free for a routing id
            thief = await asyncio.create_subprocess_exec(sys.executable, "-c", IPC_THIEF, endpoint, cwd=REPO,
                                                         stdout=subprocess.PIPE)
            await settle(timeout=0.3)
            pool.submit([job("r1")])
            out, _ = await asyncio.wait_for(thief.communicate(), 30)
            return owner, out.decode().strip(), profiles, pool.workers["w0"].peer
        finally:
            real.close()
            context.term()
            await pool.close()

    with caplog.at_level(logging.INFO, "reame.gateway"):
        owner, thief_said, profiles, still = asyncio.run(main())
    assert owner.startswith("uid ") and f" pid {__import__('os').getpid()}" in owner
    assert thief_said == "NOTHING" and profiles == [] and still == owner
    assert "worker w0: ignored a message from uid" in caplog.text


def test_a_worker_that_does_not_read_its_requests_is_dropped_though_its_pulse_beats(tmp_path, caplog):
    """Before: its heartbeats kept it ready (and /health at 200) while its requests went nowhere."""
    endpoint = f"ipc://{tmp_path}/state/workers.ipc"

    async def main():
        pool = WorkerPool(endpoint, Metrics(), heartbeat_interval=0.05, worker_timeout=0.5)
        await pool.start()
        context = zmq.asyncio.Context()
        socks = {}
        for identity in (b"w0", b"w0#pulse"):
            socks[identity] = context.socket(zmq.DEALER)
            socks[identity].setsockopt(zmq.IDENTITY, identity)
            socks[identity].setsockopt(zmq.LINGER, 0)
            socks[identity].connect(endpoint)
        read = {"request": ""}

        async def beat():
            while True:
                await socks[b"w0#pulse"].send(protocol.encode(Heartbeat("w0", read_request=read["request"])))
                await asyncio.sleep(0.05)

        beating = asyncio.create_task(beat())
        try:
            await socks[b"w0"].send(protocol.encode(GOOD))
            await settle(lambda: "w0" in pool.workers)
            first = job("r1")
            pool.submit([first])
            # A loop that reads its requests says so in its beats, however long it takes to answer.
            generate = protocol.decode(await asyncio.wait_for(socks[b"w0"].recv(), 5))
            read["request"] = generate.request_id
            await settle(timeout=1.0)  # twice worker_timeout
            kept = "w0" in pool.workers
            # Now its loop stops reading (as when another connection held its routing id).
            second = job("r2")
            pool.submit([second])
            await settle(lambda: "w0" not in pool.workers, timeout=5)
            return kept, "w0" in pool.workers, None if second.sink.empty() else second.sink.get_nowait()[1]
        finally:
            beating.cancel()
            for sock in socks.values():
                sock.close()
            context.term()
            await pool.close()

    with caplog.at_level(logging.INFO, "reame.gateway"):
        kept, still_there, event = asyncio.run(main())
    assert kept and not still_there
    assert isinstance(event, Restarted)  # nothing reached the client: it runs again elsewhere
    assert "worker w0 dropped: its serve loop has not read request r2" in caplog.text
