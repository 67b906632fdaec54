"""`reame-worker --numa-node N`: one engine process, pinned to one NUMA node's CPUs.

    reame-worker [--config FILE] --numa-node N [--model PATH|NAME] [--cpus LIST] [--state-dir DIR]
                 [--adaptive on|off]

Start-up order matters: the CPU affinity and numba's thread settings must be in place before
numba is imported (its thread pool is sized once), and the model is loaded and warmed before
the worker registers, so the gateway never routes to a worker that would stall on compiling.
SIGTERM (or Ctrl-C) drains: requests under way finish, then the worker leaves. A second one stops at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from shared import zmq_keys
from shared.command_line import add_common_flags, load_with_common_flags, run_process
from shared.config import Config, override
from shared.errors import ConfigError
from shared.logs import setup_logging
from worker.numa import list_nodes, node_cpus, parse_cpulist

if TYPE_CHECKING:  # imported when the worker is built, after pin() (module docstring)
    import zmq

    from shared.protocol import Profile, Register
    from worker.profiler import ProfileCollector
    from worker.pulse import Pulse
    from worker.refusal_watch import RefusalWatch
    from worker.sched.generation import BatchGenerator
    from worker.service import WorkerService

log = logging.getLogger("reame.worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reame-worker", description="A Reame engine worker for one NUMA node.")
    add_common_flags(parser)
    parser.add_argument("--numa-node", type=int, default=0, help="NUMA node whose CPUs this worker runs on (default 0)")
    parser.add_argument("--cpus", help="use only these CPUs of the node, e.g. 0-3,8 (reame serve splits nodes so)")
    parser.add_argument("--store-path", help="the host's prefix store ([prefix_cache] store_path; \"\" = RAM only)")
    return parser


def configure(args: argparse.Namespace) -> Config:
    config = load_with_common_flags(args)
    config = override(config, "prefix_cache", store_path=args.store_path)
    zmq_keys.check_transport(config)
    zmq_keys.client_keys(config)  # the key files are checked before the model loads
    return config


def choose_cpus(node: int, subset: str | None) -> list[int]:
    cpus = node_cpus(node)
    if subset is not None:
        wanted = parse_cpulist(subset)
        outside = sorted(set(wanted) - set(cpus))
        if outside:
            raise ConfigError(f"--cpus {subset}: CPUs {outside} are not on NUMA node {node}")
        cpus = wanted
    allowed = os.sched_getaffinity(0)
    usable = [c for c in cpus if c in allowed]
    if not usable:
        raise ConfigError(f"none of NUMA node {node}'s CPUs {cpus} are available to this process")
    return usable


def pin(cpus: list[int], config: Config) -> Config:
    """Pin this process and size numba's and BLAS's thread pools to its CPUs. Runs before numpy
    and numba load, because both size their pools once, on import."""
    import psutil

    from shared import blas_env

    blas_env.prefer_native_blas()
    psutil.Process().cpu_affinity(cpus)
    threads = config.engine.threads or len(cpus)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(threads))
    return override(config, "engine", threads=threads)


def load(config: Config):
    from shared import blas_env
    from shared.model_store import resolve_model
    from worker.engine.engine import load_engine_from_config

    path = resolve_model(config.model_reference(), config.resolve_path(config.model.models_dir))
    started = time.perf_counter()
    log.info("loading %s (%d threads, kernels %s)", path, config.engine.threads, config.engine.kernels)
    engine = load_engine_from_config(config, model=str(path), progress=_progress)
    log.info("loaded %s (%s, context %d) in %.1fs; %s", engine.model_name, engine.arch, engine.n_ctx,
             time.perf_counter() - started, blas_env.describe())
    import psutil
    from worker.engine.paged_kv import memory_plan
    log.info("%s", memory_plan(engine.model.w.table.nbytes, engine.kv.nbytes, psutil.virtual_memory().available,
                               engine.kv.dtype))
    started = time.perf_counter()
    engine.kv.reserve()
    log.info("KV cache: %d MiB reserved in %.1fs (%d blocks of %d tokens)", engine.kv.nbytes >> 20,
             time.perf_counter() - started, engine.kv.num_blocks, engine.kv.block_size)
    if config.worker.warmup:
        _warm(engine)
    return engine, path


def _progress(line: str) -> None:
    log.info("loading: %s", line)


def _warm(engine) -> None:
    """Two short requests batched together, so every kernel of the hot path (prompt chunks, the
    one- and many-row decode steps) is compiled or loaded from the numba cache before serving."""
    from shared.sampling import SamplingParams
    from worker.engine import heap
    from worker.sched.one_request import generate_ids, solo_generator

    log.info("warming up: loading the compiled kernels from %s, or compiling them on a first start "
             "(a minute or more)", os.environ.get("NUMBA_CACHE_DIR", "numba's cache"))
    started = time.perf_counter()
    generator = solo_generator(engine)
    generator.add("warm-up-1", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))
    generator.add("warm-up-2", [5, 6], SamplingParams(max_tokens=3, temperature=0.0))
    while generator.has_work:
        generator.step()
    generate_ids(generator, [1, 2, 3, 4], 2)  # and one alone
    heap.trim()  # what loading the kernels freed
    log.info("warmed up in %.1fs", time.perf_counter() - started)


def build_worker(config: Config, node: int, cpus: list[int], engine, path: Path) -> Worker:
    """Every part of a serving worker, each built whole from the config and the loaded engine, in
    the order each needs the ones before it."""
    from worker.engine.tuning.kernel_table_store import build_kernel_tuner
    from worker.engine.tuning.kernel_tuner import kernel_profile
    from worker.kv.block_manager import BlockManager
    from worker.kv.prefix_setup import build_prefix_cache
    from worker.placement import Placement
    from worker.profiler import ProfileCollector
    from worker.pulse import Pulse
    from worker.sched.constraint import Constraints
    from worker.sched.generation import BatchGenerator
    from worker.sched.tuning_state import SchedulerKnobs, TuningState
    from worker.service import WorkerService
    from worker.speculative.setup import build_speculator

    knobs = SchedulerKnobs.from_config(config)
    info = _registration(node, cpus, engine, path, capacity=knobs.max_batch_size)
    link = GatewayLink.connect(config, info.worker_id)
    blocks = BlockManager.for_pool(engine.kv)
    prefix = build_prefix_cache(config, engine, blocks)
    # The grammar token table is built at the first constrained request (~0.3 s for 49k tokens).
    constraints = Constraints.from_gguf(str(path), engine.vocab_size, knobs.max_batch_size)
    speculator, archive_store = build_speculator(config, engine.gguf.fingerprint())
    tuning = TuningState(knobs)
    kernel_tuner = build_kernel_tuner(config, engine)  # on this thread, the steps' own: numba's threads are per thread
    generator = BatchGenerator(engine, tuning, prefix=prefix, blocks=blocks, constraints=constraints,
                               speculator=speculator, kernel_tuner=kernel_tuner)
    log.info("batching: %s (adaptive %s)", ", ".join(f"{k}={v}" for k, v in knobs.as_dict().items()),
             "on" if config.tuning.adaptive else "off")
    # Profiles are sent with adaptivity off too (the report and the dashboard show them); only the
    # coordinator's decisions are off then.
    placement = Placement(node, cpus, numa_nodes=len(list_nodes()))
    profiler = ProfileCollector(info.worker_id, cpus, placement=placement)
    profiler.add_source("kernels", lambda: kernel_profile(kernel_tuner.snapshot()))
    if speculator is not None:
        profiler.add_source("speculative", speculator.stats)
    service = WorkerService(generator, link.socket, info, drain_timeout=config.worker.drain_timeout, tuning=tuning,
                            profiler=profiler, adaptive=config.tuning.adaptive, placement=placement)
    service.on_freeze(kernel_tuner.freeze)  # a frozen strategy freezes the kernel table too
    # The kernel tuner decides the thread count (FixedKernels: [engine] threads); the coordinator's
    # placement only caps it: no more threads than the CPUs the worker is placed on.
    service.on_cpus(kernel_tuner.limit_threads)
    pulse = Pulse(link.context, config.endpoint, service, config.server.heartbeat_interval,
                  counters=generator.heartbeat_counters,
                  profile=_profile_window(generator, profiler, service),
                  profile_interval=config.tuning.profile_interval)
    return Worker(info.worker_id, config.endpoint, link, generator, archive_store, service, pulse)


@dataclass
class Worker:
    """A serving worker's parts (build_worker); `run` serves until drained, then closes them."""
    worker_id: str
    endpoint: str
    link: GatewayLink
    generator: BatchGenerator  # its prefix cache, grammars, speculator and kernel tuner with it
    archive_store: object | None  # the speculator's n-gram archive on disk, closed after a last save
    service: WorkerService
    pulse: Pulse

    def run(self) -> None:
        """SIGTERM (or Ctrl-C) drains: requests under way finish, then the worker leaves. A second
        one stops at once."""
        from shared.protocol import Error, encode

        def on_signal(signum, _frame) -> None:
            if self.service.drain_requested:
                self.service.request_stop()
            else:
                self.service.request_drain()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log.info("worker %s: registering with %s", self.worker_id, self.endpoint)
        self.pulse.start()
        try:
            self.service.run()
        except Exception as exc:
            # Tell the gateway before dying, so it moves this worker's requests at once.
            log.exception("worker %s: serve loop failed", self.worker_id)
            self.link.socket.send(encode(Error("", type(exc).__name__, f"worker failed: {exc}", fatal=True)))
            raise
        finally:
            self.close()

    def close(self) -> None:
        self.pulse.stop()
        generator = self.generator
        generator.constraints.close()
        if generator.prefix is not None:
            generator.prefix.close()
        if self.archive_store is not None:
            generator.speculator.save()  # what it learned since the last periodic save
            self.archive_store.close()
        self.link.close()


@dataclass
class GatewayLink:
    """The worker's side of ZeroMQ: one context (the pulse's socket shares it and its CURVE keys),
    the DEALER socket jobs and tokens travel on, and the watch that logs a refused key."""
    context: zmq.Context
    socket: zmq.Socket
    watch: RefusalWatch | None

    @classmethod
    def connect(cls, config: Config, worker_id: str) -> GatewayLink:
        import zmq

        from worker.refusal_watch import RefusalWatch

        context = zmq.Context()
        keys = zmq_keys.client_keys(config)
        if keys is not None:
            zmq_keys.secure_clients(context, keys)  # the pulse's socket too
            log.info("worker %s: CURVE key %s", worker_id, keys.public.decode())
        elif zmq_keys.is_tcp(config.endpoint):
            log.warning("worker %s: connecting over %s without CURVE (insecure_tcp = true): whoever reaches it "
                        "could pose as the gateway and send this worker its requests", worker_id, config.endpoint)
        sock = context.socket(zmq.DEALER)
        # A token no one else knows in the routing id (gateway.workers): were this connection lost, no
        # other could take up its routing id and be sent this worker's requests meanwhile.
        sock.setsockopt(zmq.IDENTITY, f"{worker_id}@{secrets.token_hex(16)}".encode())
        sock.setsockopt(zmq.LINGER, 2000)  # long enough for the goodbye to reach the gateway
        # A refused key is otherwise silent here: the worker would just never be registered.
        watch = RefusalWatch(sock, config.endpoint, keys.public) if keys is not None else None
        if watch is not None:
            watch.start()
        sock.connect(config.endpoint)
        return cls(context, sock, watch)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        self.socket.close()
        self.context.term()


def _registration(node: int, cpus: list[int], engine, path: Path, capacity: int) -> Register:
    """What the worker tells the gateway about itself when it registers."""
    from shared.protocol import Register

    host = socket.gethostname()
    return Register(worker_id=f"{host}/node{node}/{os.getpid()}", numa_node=node, cpus=cpus,
                    model_name=engine.model_name, model_path=str(path), arch=engine.arch, n_ctx=engine.n_ctx,
                    vocab_size=engine.vocab_size, capacity=capacity, host=host, pid=os.getpid())


def _profile_window(generator: BatchGenerator, profiler: ProfileCollector,
                    service: WorkerService) -> Callable[[], Profile]:
    """The pulse's profile: the generator's counters over the last window, on the threads that ran it."""
    def profile() -> Profile:
        counters = generator.heartbeat_counters()
        counters["kv_block_tokens"] = generator.engine.kv.block_size
        window = profiler.profile(service.tuning.version, counters, generator.preemptions, generator.engine.threads)
        # A neighbour arriving or leaving is a drift: the kernel tuner explores again.
        generator.kernel_tuner.note_neighbours(window.cpu_others)
        return window
    return profile


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def start() -> None:
        config = configure(args)
        setup_logging(config.logging.level, f"worker[{args.numa_node}]")
        cpus = choose_cpus(args.numa_node, args.cpus)
        config = pin(cpus, config)
        log.info("NUMA node %d: pinned to CPUs %s", args.numa_node, ",".join(map(str, cpus)))
        engine, path = load(config)
        build_worker(config, args.numa_node, cpus, engine, path).run()

    return run_process("reame-worker", start)


if __name__ == "__main__":
    sys.exit(main())
