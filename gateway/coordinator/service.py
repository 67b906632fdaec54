"""The coordinator inside the gateway: profiles from the worker pool in, strategies out to the
workers, the strategy saved under the deployment's tuning directory (Config.tuning_path) after
each change, and the adaptive report in the log every `[tuning] report_interval`. A frozen strategy
resumed at start is announced loudly: its age and what it pins.

With `[tuning] adaptive = false` the profiles still feed the report and the dashboard, but no
decision is made and no strategy is sent or resumed: the workers keep reame.conf's knobs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from gateway.coordinator.coordinator import Coordinator, Outgoing, slot_of
from gateway.coordinator.report import AdaptiveReport
from gateway.coordinator.store import StrategyStore, describe, legacy_strategy
from shared.config import Config
from shared.errors import ConfigError
from shared.knobs import Knobs
from shared.protocol import Profile, Register

log = logging.getLogger("reame.coordinator")

REPORT_WINDOW_S = 60.0  # the report compares per-minute windows (shorter when the interval is)


class TuningService:
    def __init__(self, config: Config, pool, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        """pool: gateway.workers.WorkerPool (send_strategy, set_capacity, on_profile, on_register)."""
        self.config = config
        self.pool = pool
        self.clock = clock
        self.wall = wall
        self.boot_wall = wall()
        self.coordinator = Coordinator(Knobs.from_config(config), adaptive=config.tuning.adaptive, wall=wall)
        self.store = StrategyStore(config.tuning_path)
        self.report = AdaptiveReport(clock(), min(REPORT_WINDOW_S, config.tuning.report_interval))
        self._report_task: asyncio.Task | None = None
        self._saved_state: Any = None
        self._resume()
        pool.on_profile = self.on_profile
        pool.on_register = self.on_register

    def _resume(self) -> None:
        old = legacy_strategy(self.store.path.parent)
        if old is not None:
            log.warning("coordinator: ignoring %s: a strategy in the user's home, shared by every server of the user "
                        "(an older Reame's default). This deployment keeps its own in %s; `reame strategy import "
                        "FILE` pins it here if it is wanted, else delete it", old, self.store.path.parent)
        doc = self.store.load()
        if doc is None:
            return
        try:
            self.coordinator.restore(doc)
        except (ConfigError, TypeError, ValueError) as exc:
            log.warning("coordinator: ignoring the saved strategy %s: %s", self.store.path, exc)
            return
        if not self.config.tuning.adaptive:
            log.info("coordinator: adaptivity is off; the saved strategy %s is not applied", self.store.path)
            return
        log.info("coordinator: resumed strategy v%d from %s (%d workers%s)", self.coordinator.version,
                 self.store.path, len(self.coordinator.slots), ", frozen" if self.coordinator.frozen else "")
        if self.coordinator.frozen:
            log.warning("coordinator: THE RESUMED STRATEGY IS FROZEN: nothing is learned until POST "
                        "/admin/strategy/unfreeze (a placement chosen for a neighbour is still re-tested). %s",
                        "; ".join(line.strip() for line in describe(doc, self.wall())))
        self._saved_state = self._state_key()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    async def close(self) -> None:
        if self._report_task is not None:
            self._report_task.cancel()
            await asyncio.gather(self._report_task, return_exceptions=True)
        self._save()

    # ---- the pool's hooks ----------------------------------------------------------------------

    def on_register(self, info: Register) -> None:
        strategy = self.coordinator.strategy_for(info.worker_id, info.cpus)
        if strategy is not None:
            log.info("coordinator: worker %s resumes strategy v%d", info.worker_id, strategy.version)
            self.pool.send_strategy(info.worker_id, strategy)

    def on_profile(self, profile: Profile) -> None:
        now = self.clock()
        self.report.add(profile, now)
        self._send(self.coordinator.observe(profile, now))
        slot = self.coordinator.slots.get(slot_of(profile.worker_id, profile.cpus))
        if slot is not None and slot.version and profile.knobs_version == slot.version:
            self.pool.set_capacity(profile.worker_id, slot.knobs.max_batch_size)
        self._save()

    # ---- operator controls ---------------------------------------------------------------------

    def set_frozen(self, frozen: bool) -> None:
        if not self.config.tuning.adaptive:
            raise ConfigError("adaptivity is off ([tuning] adaptive = false): there is no strategy to freeze")
        self._send(self.coordinator.set_frozen(frozen))
        self._save()

    def import_strategy(self, doc: Any) -> None:
        self._send(self.coordinator.import_strategy(doc))
        self._save()

    def strategy(self) -> dict[str, Any]:
        doc = self.coordinator.export()
        del doc["history"]
        return doc

    def report_json(self) -> dict[str, Any]:
        at = self.clock() - self.report.boot
        body = self.report.as_json(at, self.coordinator.history, self.boot_wall)
        body.update(adaptive=self.coordinator.adaptive, frozen=self.coordinator.frozen,
                    version=self.coordinator.version, history=[d.as_dict() for d in self.coordinator.history])
        return body

    def series(self, bucket_s: float) -> dict[str, Any]:
        """The dashboard's curves: one point per bucket since boot, and the strategy changes."""
        return self._series(bucket_s, self.clock() - self.report.boot, list(self.report.samples),
                            self.coordinator.history)

    def _series(self, bucket_s: float, at: float, samples: list, history: list) -> dict[str, Any]:
        return {"bucket_s": bucket_s, "uptime_s": round(at, 1),
                "points": [s.as_dict() for s in self.report.series(at, bucket_s, samples)],
                "changes": [{"at": round(d.at - self.boot_wall, 1), "kind": d.kind, "policy": d.policy,
                             "slot": d.slot, "outcome": d.outcome, "version": d.version}
                            for d in history if d.at >= self.boot_wall]}

    def dispatch(self, action: str, argument: Any = None) -> dict[str, Any]:
        """One operator call by name (shared.protocol.AdminAction): the /admin routes, and the
        AdminCalls a standalone coordinator gets from its gateways. ConfigError when refused."""
        if action == "import":
            self.import_strategy(argument)
        elif action in ("freeze", "unfreeze"):
            self.set_frozen(action == "freeze")
        elif action == "report":
            return self.report_json()
        elif action == "series":
            return self.series(float(argument))
        elif action != "strategy":
            raise ValueError(f"unknown tuning action {action!r}")
        return self.strategy()

    async def call(self, action: str, argument: Any = None) -> dict[str, Any]:
        """dispatch(), as gateway.admin awaits it (the remote twin, RemoteTuning, waits on a socket).
        An import's checks and the series' summing run in a thread, over copies taken here: the
        event loop serves every tenant's streams meanwhile. What changes state stays on the loop."""
        if action == "import":
            chosen = await asyncio.to_thread(self.coordinator.check_import, argument, frozenset(self.coordinator.slots))
            self._send(self.coordinator.pin(chosen))
            self._save()
            return self.strategy()
        if action == "series":
            bucket_s, samples = float(argument), list(self.report.samples)
            at, changes = self.clock() - self.report.boot, list(self.coordinator.history)
            return await asyncio.to_thread(self._series, bucket_s, at, samples, changes)
        return self.dispatch(action, argument)

    def report_lines(self) -> list[str]:
        return self.report.lines(self.clock() - self.report.boot, self.coordinator.history, self.boot_wall)

    # ---- internals -----------------------------------------------------------------------------

    def _send(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            if not self.pool.send_strategy(out.worker_id, out.strategy):
                log.debug("coordinator: worker %s left before strategy v%d", out.worker_id, out.strategy.version)

    def _state_key(self) -> tuple:
        c = self.coordinator
        return c.version, c.frozen, len(c.history), tuple(d.outcome for d in c.history[-3:])

    def _save(self) -> None:
        if not self.coordinator.adaptive:
            return  # nothing was decided; leave whatever an adaptive run saved for the next one
        key = self._state_key()
        if key != self._saved_state:
            self.store.save(self.coordinator.export())
            self._saved_state = key

    async def _report_loop(self) -> None:
        interval = self.config.tuning.report_interval
        while True:
            await asyncio.sleep(interval)
            try:
                for line in self.report_lines():
                    log.info("%s", line)
            except Exception:  # the report is for people; its failure must not touch serving
                log.exception("coordinator: the adaptive report failed")
