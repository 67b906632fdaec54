"""The gateway's side of ZeroMQ: registered workers, the queue of requests waiting for a slot,
and what happens when a worker goes away.

Requests wait here (not in the workers) until a worker has a free slot, so a worker that dies
takes only its running requests with it. Those are re-run elsewhere when no output has reached
the client yet (`Job.delivered`); otherwise their consumer gets a WorkerLostError. A worker is
dropped when it says it is leaving, goes silent for `worker_timeout`, does not read what it is
sent for `worker_timeout` (its heartbeats say which request its serve loop read last), or — when
it runs on this host — its process no longer exists (noticed within a sweep, far sooner than a
timeout).

A worker id belongs to the connection that registered it, as far as the transport can tell who
that is: over CURVE its public key, over ipc:// its process (uid and pid, from the kernel). Its
Register, Heartbeat, Profile and answers from anyone else are ignored, and no connection takes
over another's routing id (no ROUTER_HANDOVER): a second process cannot be sent the worker's
prompts. Plain tcp:// (`insecure_tcp`) proves nothing, so nothing is bound there.

Each Generate gets exactly one terminal answer from a live worker (Finished or Error), so a
slot is freed only on that answer; an Abort merely asks for it sooner.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import zmq
import zmq.asyncio

from gateway.errors import OverloadedError, ServiceUnavailableError
from gateway.metrics import Metrics
from gateway.router import Candidate, Router
from gateway.worker_auth import WorkerAuthenticator
from shared import protocol
from shared.config import GatewaySection, ServerSection
from shared.zmq_keys import ServerKeys, secure_server
from shared.protocol import Abort, Drain, Error, Finished, Generate, Heartbeat, Profile, Register, Strategy, TokenChunk
from shared.sampling import SamplingParams

log = logging.getLogger("reame.gateway")

MAX_ATTEMPTS = 3  # runs of one request across workers before it fails
MAX_LOGGED_IMPOSTORS = 1000  # (worker id, routing id, peer) remembered so each is logged once
_SERVER, _GATEWAY = ServerSection(), GatewaySection()  # reame.conf's defaults, the one source


@dataclass(frozen=True)
class Restarted:
    """Sink event: the job's worker was lost before any output was delivered; it runs again."""
    request_id: str


@dataclass(eq=False)
class Job:
    """One choice of one HTTP request, as it travels to a worker and back."""
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue  # receives (job, TokenChunk | Finished | Error | Restarted)
    key: bytes  # prefix-affinity key
    warm: bool = False  # prefill only (POST /v1/warm): the worker fills its prefix caches and finishes
    cache_namespace: bytes = b""  # whose cached prefixes it may reuse (gateway.cache_namespace)
    tenant: str = ""  # whose key sent it (gateway.auth): free slots are shared fairly between tenants
    speculative: bool = True  # the worker may draft tokens for it
    worker_id: str | None = None
    delivered: bool = False  # output reached the client: it can no longer move to another worker
    closed: bool = False  # the HTTP side is done with it
    attempts: int = 0
    queued_at: float = 0.0


@dataclass(eq=False)
class WorkerHandle:
    info: Register
    identity: bytes
    last_seen: float
    local: bool  # runs on this host and the gateway can see its process, so its pid can be checked
    draining: bool = False
    jobs: dict[str, Job] = field(default_factory=dict)
    tuned_capacity: int | None = None  # max_batch_size of a strategy the worker confirmed running
    peer: str = ""  # who registered it (peer_of): its other messages must come from the same
    unread: deque[tuple[str, float]] = field(default_factory=deque)  # (request id, sent at) not yet read
    unread_since: float | None = None  # since when its heartbeats say that a request sent long ago is unread

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def capacity(self) -> int:
        return self.tuned_capacity or self.info.capacity

    @property
    def has_slot(self) -> bool:
        return not self.draining and len(self.jobs) < self.capacity


class WorkerPool:
    def __init__(self, endpoint: str, metrics: Metrics, *, heartbeat_interval: float = _SERVER.heartbeat_interval,
                 worker_timeout: float = _SERVER.worker_timeout, max_queue: int = _GATEWAY.max_queue,
                 queue_timeout: float = _GATEWAY.queue_timeout,
                 model_arch: str | None = None, vocab_size: int | None = None,
                 clock: Callable[[], float] = time.monotonic, curve: ServerKeys | None = None,
                 routing: str = _GATEWAY.routing):
        """`model_arch` and `vocab_size` are the tokenizer's (general.architecture, its token count):
        a worker whose model differs is refused, as its token ids would mean other text. With
        `curve`, workers connect over CURVE and only those with an authorized key get in."""
        self.endpoint = endpoint
        self._ipc = endpoint.startswith("ipc://")
        self.model_arch = model_arch
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.worker_timeout = worker_timeout
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.sweep_interval = min(0.25, heartbeat_interval / 2)
        # A request counts as unread when the worker's serve loop finished a read this long after
        # it was sent without having read it (transit, and a heartbeat that waited in our queue).
        self.read_slack = max(1.0, 2 * heartbeat_interval)
        self.clock = clock
        self.router = Router(affinity=routing == "affinity")
        self.workers: dict[str, WorkerHandle] = {}  # by worker id (its routing id up to an "@")
        self.queue: deque[Job] = deque()
        self.n_ctx = 0  # of the registered model; kept when workers leave
        self.model_names: set[str] = set()
        self._ready = asyncio.Event()
        self._host = socket.gethostname()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a connection with a routing id already in use is not let in, so no
        # one can take over a worker's id (and be sent its prompts) while it is connected.
        self.curve = curve
        self.authenticator = WorkerAuthenticator(self._context, curve.authorized_dir) if curve else None
        self._tasks: list[asyncio.Task] = []
        self._refused: set[tuple[str, str]] = set()  # (worker id, reason) already logged
        self._impostors: set[tuple[str, bytes, str]] = set()  # (worker id, routing id, peer) already logged
        self._dispatched = 0  # jobs sent to workers so far
        self._served: dict[str, int] = {}  # tenant → the number of its latest dispatched job
        # The tuning coordinator's hooks (gateway.coordinator.service): profiles in, and what a
        # worker that registers should run.
        self.on_profile: Callable[[Profile], None] | None = None
        self.on_register: Callable[[Register], None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self.curve is not None:
            self.authenticator.start()  # before the bind: libzmq lets everyone in while no handler answers
            secure_server(self._socket, self.curve)
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):  # @: abstract, no file
            bind_private(self._socket, Path(self.endpoint[len("ipc://"):]))
        else:
            self._socket.bind(self.endpoint)
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._sweep_loop())]
        log.info("gateway: waiting for workers on %s", self.endpoint)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.authenticator is not None:
            await self.authenticator.close()
        self._socket.close(linger=0)
        self._context.term()

    # ---- what the HTTP side uses -------------------------------------------------------------

    @property
    def ready(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if not w.draining]

    async def wait_ready(self, timeout: float) -> None:
        """Wait until some worker has registered; ServiceUnavailableError after `timeout`."""
        if self.ready:
            return
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError("no worker is ready to serve requests; try again shortly") from None

    def submit(self, jobs: list[Job]) -> None:
        if len(self.queue) + len(jobs) > self.max_queue:
            raise OverloadedError(f"the server is overloaded ({len(self.queue)} requests waiting); retry shortly")
        now = self.clock()
        for job in jobs:
            job.queued_at = now
            self.queue.append(job)
        self._dispatch()

    def release(self, job: Job) -> None:
        """The HTTP side is done with a job: drop it from the queue, or ask its worker to abort it."""
        if job.closed:
            return
        job.closed = True
        if job.worker_id is None:
            try:
                self.queue.remove(job)
            except ValueError:
                pass
            self._update_gauges()
            return
        worker = self.workers.get(job.worker_id)
        if worker is not None and job.request_id in worker.jobs:
            self._send(worker.identity, Abort(job.request_id))

    def send_strategy(self, worker_id: str, strategy: Strategy) -> bool:
        """Send a tuning decision to a worker; False when it is not registered (any more)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return False
        self._send(worker.identity, strategy)
        return True

    def set_capacity(self, worker_id: str, capacity: int) -> None:
        """A worker runs up to `capacity` sequences now (its confirmed max_batch_size)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.tuned_capacity != capacity:
            worker.tuned_capacity = capacity
            self._dispatch()

    # ---- messages from workers ---------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            # A worker's routing id, then one frame per message: a worker sends all the events
            # of one engine step (a token for each running request...) as one multipart message.
            frames = await self._socket.recv_multipart(copy=False)
            if len(frames) < 2:
                log.warning("gateway: dropped a message of %d frames", len(frames))
                continue
            identity = frames[0].bytes
            peer = peer_of(frames[1], self._ipc)
            for frame in frames[1:]:
                try:
                    message = protocol.decode(frame.bytes)
                except protocol.ProtocolError as exc:
                    log.warning("gateway: dropped a bad frame from %r: %s", identity, exc)
                    continue
                try:
                    self._on_message(identity, message, peer)
                except Exception:  # one bad message must not stop the loop that serves every request
                    log.exception("gateway: failed to handle %s", type(message).__name__)

    def _on_message(self, identity: bytes, message: protocol.Message, peer: str = "") -> None:
        if isinstance(message, Register):
            self._register(identity, message, peer)
            return
        if isinstance(message, Heartbeat):
            # Heartbeats come from the worker's pulse thread on a socket of its own, so the
            # worker is named by the id inside the message, and that socket's routing id is it + "#pulse".
            if message.worker_id not in self.workers:  # we restarted, or dropped it: ask it to register again
                self._send(identity, Heartbeat(message.worker_id, registered=False))
                return
            worker = self._sender(message.worker_id, identity, peer, pulse=True)
            if worker is not None:
                worker.last_seen = self.clock()
                self._check_reads(worker, message)
                self.metrics.observe_heartbeat(message)
            return
        if isinstance(message, Profile):
            if self._sender(message.worker_id, identity, peer, pulse=True) is not None and self.on_profile is not None:
                self.on_profile(message)
            return
        worker = self._sender(_worker_id_of(identity), identity, peer, pulse=False)
        if worker is None:
            return
        worker.last_seen = self.clock()
        if isinstance(message, TokenChunk):
            job = worker.jobs.get(message.request_id)
            self.metrics.generated_tokens.inc(len(message.tokens))
            if job is None:  # work we gave up on (we restarted, or dropped the worker): stop it
                self._send(identity, Abort(message.request_id))
            elif not job.closed:
                job.sink.put_nowait((job, message))
        elif isinstance(message, (Finished, Error)) and message.request_id:
            job = worker.jobs.pop(message.request_id, None)
            if job is not None and not job.closed:
                job.sink.put_nowait((job, message))
            self._dispatch()
        elif isinstance(message, Error):
            log.error("worker %s failed: %s", worker.worker_id, message.message)
            if message.fatal:
                self._drop(worker, "reported a fatal error")
        elif isinstance(message, Drain):
            if message.done:
                self._drop(worker, "left")
            else:
                log.info("worker %s: draining", worker.worker_id)
                worker.draining = True
                self._update_gauges()
                self._dispatch()

    def _sender(self, worker_id: str, identity: bytes, peer: str, *, pulse: bool) -> WorkerHandle | None:
        """The registered worker `worker_id` if this message comes from it (its routing id, or its
        pulse's, and the peer that registered it); None, logged once per impostor, otherwise."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return None
        expected = f"{worker_id}#pulse".encode() if pulse else worker.identity
        if identity == expected and peer == worker.peer:
            return worker
        self._impostor(worker_id, identity, peer, worker.peer)
        return None

    def _impostor(self, worker_id: str, identity: bytes, peer: str, owner: str) -> None:
        if (worker_id, identity, peer) not in self._impostors:
            if len(self._impostors) >= MAX_LOGGED_IMPOSTORS:  # routing ids are the sender's to vary
                self._impostors.clear()
            self._impostors.add((worker_id, identity, peer))
            log.warning("worker %s: ignored a message from %s (routing id %r); the worker id belongs to %s",
                        worker_id, peer or "an unauthenticated peer", identity, owner or "an unauthenticated peer")

    def _register(self, identity: bytes, info: Register, peer: str = "") -> None:
        if info.version != protocol.PROTOCOL_VERSION:
            log.error("worker %s speaks protocol %d, this gateway %d: ignored",
                      info.worker_id, info.version, protocol.PROTOCOL_VERSION)
            return
        if _worker_id_of(identity) != info.worker_id:
            log.error("worker %s registered from routing id %r: ignored", info.worker_id, identity)
            return
        known = self.workers.get(info.worker_id)
        if known is not None and known.peer != peer:
            # Someone else claims a registered worker's id (a worker restarted under the same id
            # is let in once the gateway has dropped its predecessor).
            self._impostor(info.worker_id, identity, peer, known.peer)
            return
        mismatch = self._model_mismatch(info)
        if mismatch:
            self._refuse(identity, info, mismatch)
            return
        if known is not None:
            known.info = info
            if known.identity != identity:  # the same key, restarted under the same id: a new routing id
                known.identity = identity
                known.unread.clear()  # sent to its predecessor
                known.unread_since = None
            known.last_seen = self.clock()
        else:
            local = info.host == self._host and _process_alive(info.pid)
            if info.host == self._host and not local:
                # Sandboxed services (systemd's PrivateUsers= with ProtectProc=invisible, separate PID
                # namespaces) hide each other's processes: a pid check would drop a live worker.
                log.info("worker %s: its process %d is not visible to the gateway; its heartbeats tell "
                         "whether it is alive", info.worker_id, info.pid)
            self.workers[info.worker_id] = WorkerHandle(info, identity, self.clock(), local=local, peer=peer)
            log.info("worker %s registered: node %d, cpus %s, model %s, context %d, from %s",
                     info.worker_id, info.numa_node, _cpu_ranges(info.cpus), info.model_name, info.n_ctx,
                     self._describe(peer))
        self.n_ctx = min(w.info.n_ctx for w in self.workers.values())
        self.model_names.add(info.model_name)
        if self.on_register is not None:
            self.on_register(info)
        self._update_gauges()
        self._dispatch()

    def _model_mismatch(self, info: Register) -> str:
        """Why this worker's model cannot serve this gateway's tokenizer ("" when it can)."""
        if self.model_arch is not None and info.arch != self.model_arch:
            return f"its model is a {info.arch} ({info.model_path}), the gateway's tokenizer is for {self.model_arch}"
        if self.vocab_size is not None and info.vocab_size != self.vocab_size:
            return (f"its model ({info.model_path}) has {info.vocab_size} tokens, "
                    f"the gateway's tokenizer {self.vocab_size}")
        return ""

    def _refuse(self, identity: bytes, info: Register, reason: str) -> None:
        # A refused worker registers again after each Heartbeat(registered=False): log once, tell it each time.
        if (info.worker_id, reason) not in self._refused:
            self._refused.add((info.worker_id, reason))
            log.error("worker %s refused: %s", info.worker_id, reason)
        self._send(identity, Error("", "ConfigError", f"the gateway refused this worker: {reason}", fatal=True))

    def _describe(self, peer: str) -> str:
        if peer.startswith("key ") and self.authenticator is not None:
            return f"{peer} ({self.authenticator.name_of(peer[4:].encode())})"
        return peer or "an unauthenticated peer (insecure_tcp)"

    # ---- liveness ----------------------------------------------------------------------------

    def _check_reads(self, worker: WorkerHandle, beat: Heartbeat) -> None:
        """Liveness from the data path: a beat names the last request the worker's serve loop
        read and when it last finished reading. Requests sent to it go down one ordered pipe, so
        everything up to that one was read; one sent well before that read but not read means
        our Generates do not reach that loop (its connection lost or replaced, the pipe full)."""
        if beat.read_request and any(rid == beat.read_request for rid, _ in worker.unread):
            while worker.unread and worker.unread.popleft()[0] != beat.read_request:
                pass
        read_at = self.clock() - beat.read_ms / 1000
        if worker.unread and worker.unread[0][1] < read_at - self.read_slack:
            if worker.unread_since is None:
                worker.unread_since = self.clock()
        else:
            worker.unread_since = None

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            try:
                self._sweep()
            except Exception:
                log.exception("gateway: worker sweep failed")

    def _sweep(self) -> None:
        now = self.clock()
        for worker in list(self.workers.values()):
            if now - worker.last_seen > self.worker_timeout:
                self._drop(worker, f"silent for {now - worker.last_seen:.1f}s")
            elif worker.unread_since is not None and now - worker.unread_since > self.worker_timeout:
                self._drop(worker, f"its serve loop has not read request {worker.unread[0][0]} sent "
                                   f"{now - worker.unread[0][1]:.1f}s ago, though its heartbeats go on")
            elif worker.local and not _process_alive(worker.info.pid):
                self._drop(worker, "its process exited")
        if not self.ready:  # nobody to wait for: requests give up after queue_timeout
            for job in [j for j in self.queue if now - j.queued_at > self.queue_timeout]:
                self.queue.remove(job)
                job.sink.put_nowait((job, Error(job.request_id, "ServiceUnavailableError",
                                                "no worker became ready to serve this request")))
            self._update_gauges()

    def _drop(self, worker: WorkerHandle, reason: str) -> None:
        log.log(logging.INFO if reason == "left" else logging.WARNING, "worker %s dropped: %s (%d requests running)",
                worker.worker_id, reason, len(worker.jobs))
        del self.workers[worker.worker_id]
        self.router.forget(worker.worker_id)
        if reason != "left":
            self.metrics.workers_lost.inc()
        self.metrics.set_worker(worker.worker_id, worker.info.numa_node, None)
        moved = []
        for job in worker.jobs.values():
            if job.closed:
                continue
            self._send(worker.identity, Abort(job.request_id))  # in case it is alive but stalled
            job.worker_id = None
            if not job.delivered and job.attempts < MAX_ATTEMPTS:
                moved.append(job)
                job.sink.put_nowait((job, Restarted(job.request_id)))
            else:
                job.sink.put_nowait((job, Error(job.request_id, "WorkerLostError",
                                                f"the worker running this request stopped ({reason})")))
        self.queue.extendleft(reversed(moved))  # they were first in line once already
        self._update_gauges()
        self._dispatch()

    # ---- dispatch ----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self.queue:
            free = [w for w in self.workers.values() if w.has_slot]
            if not free:
                break
            picked = self._next_job(free)
            if picked is None:
                break  # what waits is constrained jobs of tenants at their share of every free worker
            job, free = picked
            candidates = [Candidate(w.worker_id, len(w.jobs), w.capacity, w.info.host) for w in free]
            worker = self.workers[self.router.choose(candidates, job.key)]
            worker.jobs[job.request_id] = job
            worker.unread.append((job.request_id, self.clock()))
            job.worker_id = worker.worker_id
            job.attempts += 1
            self._send(worker.identity, Generate(job.request_id, job.prompt_ids, job.params, warm=job.warm,
                                                   cache_namespace=job.cache_namespace.hex(),
                                                   speculative=job.speculative))
        self._update_gauges()

    def _next_job(self, free: list[WorkerHandle]) -> tuple[Job, list[WorkerHandle]] | None:
        """The oldest queued job of the tenant with the fewest jobs running, and of those the one
        served least recently: one tenant's burst (a request with n = 16, a client in a loop)
        takes turns with the other tenants' requests instead of every free slot. With one tenant
        (or none: no API keys) this is first in, first out. Returned with the free workers it may
        go to: a constrained job only to those where its tenant holds under its share
        (constrained_share); None when every queued job waits for that."""
        running: dict[str, int] = {}
        for worker in self.workers.values():
            for job in worker.jobs.values():
                running[job.tenant] = running.get(job.tenant, 0) + 1
        best, best_rank, best_free, seen = 0, None, free, set()
        for i, job in enumerate(self.queue):
            if job.tenant in seen:
                continue
            allowed = [w for w in free if _under_constrained_share(w, job)]
            if not allowed:
                continue  # the tenant's next job, if free text, may go instead
            seen.add(job.tenant)
            rank = (running.get(job.tenant, 0), self._served.get(job.tenant, -1))
            if best_rank is None or rank < best_rank:
                best, best_rank, best_free = i, rank, allowed
        if best_rank is None:
            return None
        job = self.queue[best]
        del self.queue[best]
        self._dispatched += 1
        self._served[job.tenant] = self._dispatched
        return job, best_free

    def _update_gauges(self) -> None:
        ready = self.ready
        if ready:
            self._ready.set()
        else:
            self._ready.clear()
        self.metrics.workers_ready.set(len(ready))
        self.metrics.queue_depth.set(len(self.queue))
        self.metrics.running.set(sum(len(w.jobs) for w in self.workers.values()))
        for w in self.workers.values():
            self.metrics.set_worker(w.worker_id, w.info.numa_node, "draining" if w.draining else "ready", len(w.jobs))

    def _send(self, identity: bytes, message: protocol.Message) -> None:
        # ROUTER sends never block: a message for a peer that is gone or full is dropped, and
        # heartbeats and timeouts deal with such peers.
        future = self._socket.send_multipart([identity, protocol.encode(message)], flags=zmq.NOBLOCK)
        future.add_done_callback(_consume_result)


def constrained_share(capacity: int) -> int:
    """How many grammar-constrained jobs of one tenant a worker runs at once: a quarter of its
    slots, at least one. Every constrained row costs the worker's step loop its grammar's token
    taking (an ambiguous grammar: 15 ms a token at 200 tokens, growing) and the mask thread its
    masks, so one tenant's n = 8 of them took every slot of a worker of 8 and another tenant's
    token gap p99 from 39 to 253 ms (bench/abuse.py grammar_stall); its other
    jobs wait in the queue instead, and its free-text jobs are not held by them."""
    return max(1, capacity // 4)


def _under_constrained_share(worker: WorkerHandle, job: Job) -> bool:
    if not job.params.grammar:
        return True
    held = sum(1 for j in worker.jobs.values() if j.tenant == job.tenant and j.params.grammar)
    return held < constrained_share(worker.capacity)


def _worker_id_of(identity: bytes) -> str:
    """A data socket's routing id is its worker id, then "@" and a random token (worker.main): when
    the worker's connection goes, no one else can take up that routing id and be sent what the
    gateway still sends the worker before it notices."""
    return identity.decode(errors="replace").split("@", 1)[0]


def peer_of(frame: zmq.Frame, ipc: bool) -> str:
    """Who sent `frame`, as far as the transport proves it: "key Z85" (the CURVE public key the
    ZAP handler let in); on ipc:// "uid U pid P" (the kernel's SO_PEERCRED, which libzmq appends
    to Peer-Address as host:uid:gid:pid); "" over plain tcp://, where nothing is proven."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        user = None
    if user:
        return f"key {user}"
    if not ipc:
        return ""
    try:
        address = frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""
    parts = address.rsplit(":", 3)
    if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
        return f"uid {parts[1]} pid {parts[3]}"
    return ""


def bind_private(sock: zmq.Socket, path: Path) -> None:
    """Bind an ipc:// socket that only this user can reach: a directory of 0700, a socket of 0600.

    Anyone who can connect can register as a worker and read prompts, so the directory is made
    private before the bind (no window in which the socket is open to others). A shared directory
    such as /tmp (sticky, or not ours) is left as it is; the socket's own mode still applies.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.parent.stat()
    if info.st_uid == os.getuid() and not info.st_mode & stat.S_ISVTX:
        os.chmod(path.parent, 0o700)
    sock.bind(f"ipc://{path}")
    os.chmod(path, 0o600)


def _consume_result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cpu_ranges(cpus: list[int]) -> str:
    if not cpus:
        return "-"
    parts, start, prev = [], cpus[0], cpus[0]
    for cpu in cpus[1:] + [None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)
