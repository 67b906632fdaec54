"""Per-worker strategies from the workers' profiles: which policy to act on, when, and whether
what it did helped. Pure: no sockets, no files; time is passed in, so tests drive it with
synthetic profiles.

A worker's life under the coordinator:
1. Each profile runs the policies (policy.py). A proposal is acted on only when the same one
   (policy and resulting knobs) comes out of CONFIRM consecutive profiles: one odd window
   changes nothing (hysteresis).
2. A change is a new version of that worker's knobs, sent to it and applied between two steps.
   Its effect is then measured on the goal metric of its policy: the mean over the MEASURE
   profiles with traffic before the change against MEASURE after it (the first profile under
   the new version is skipped: part of its window ran the old knobs).
3. A change whose goal got worse by more than TOLERANCE (or that lost more than THROUGHPUT_GUARD
   of the tokens per busy second, whatever its goal, or more than its policy's GUARDS allow), or a
   CONDITIONAL one (it takes CPUs away)
   that did not improve its goal by more than PROOF_Z standard errors of the windows' noise, is
   reverted, and its policy is not tried
   again on that worker for TABU_S: no oscillation between two values. Each further revert of
   the same policy doubles its rest (to MAX_TABU_S): a trial is a cost, and the same traffic
   gives the same verdict. A rest ends early only when the profile drifts from the one the
   revert was measured on (the request mix, the arrival rate, a neighbour: MIX_DRIFT).
No decision while a change is being measured, while frozen, or with adaptivity off.

No decision outlives its cause. A placement chosen because other processes loaded the worker's
CPUs (CONDITIONAL: fewer CPUs) records that cause; once the cause has been gone for
CONFIRM profiles the placement is released, frozen or not (a freeze pins what was learned about
the traffic, not a neighbour that has left: one 45 s hog, then a freeze, kept every later server
on one of two CPUs for hours). A restored strategy never resumes such a placement: its worker
starts on all its CPUs and the policies re-test the cause on live profiles. The rest of a resumed
(unfrozen) strategy is checked against the shipped defaults on the first profiles with traffic
("resume check": the same trial as any change, from the resumed knobs to the defaults) and
dropped unless it was clearly faster. Knobs a policy chose for a traffic mix remember that mix;
once the profiles have drifted from it (MIX_DRIFT) for MEASURE profiles and no policy fires, they
are tried against the defaults the same way ("re-test").

Workers are keyed by slot (host, NUMA node and CPUs, not the process id), so a worker that
restarts gets its slot's strategy back.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from gateway.coordinator.policy import (BUSY_NEIGHBOURS, GUARDS, METRICS, QUIET_NEIGHBOURS, THROUGHPUT, Proposal,
                                        others_by_cpu, propose)
from gateway.coordinator.store import age
from shared.errors import ConfigError
from shared.knobs import Knobs
from shared.protocol import Profile, Strategy

log = logging.getLogger("reame.coordinator")

CONFIRM = 2
MEASURE = 3
TOLERANCE = 0.05
THROUGHPUT_GUARD = 0.10
PROOF_Z = 2.0  # standard errors by which a CONDITIONAL change must beat its goal's noise to be kept
TABU_S = 600.0
MAX_TABU_S = 8 * TABU_S
MIX_DRIFT = 0.7  # |log| change (2x) of a request-mix figure that makes a rested policy worth a new trial
HISTORY = 500  # decisions kept (and persisted)
CONDITIONAL = ("busy CPUs",)  # policies whose choice holds only while other processes load the CPUs
RESUME_CHECK = "resume check"
RETEST = "re-test"  # learned knobs against the defaults, once the traffic they were chosen for has changed


@dataclass
class Decision:
    """One change of one worker's knobs, as the report and /admin/report show it."""
    version: int
    slot: str
    at: float  # wall-clock seconds
    kind: str  # change | revert | import | freeze | unfreeze | release (a conditional choice's cause is gone)
    policy: str
    reason: str
    before: dict[str, float]
    after: dict[str, float]
    goal: str = ""
    effect: dict[str, float] = field(default_factory=dict)  # goal before/after and the relative change
    outcome: str = "applied"  # measuring | kept | reverted | applied

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Outgoing:
    worker_id: str
    strategy: Strategy


@dataclass
class _Trial:
    decision: Decision
    previous: Knobs
    before: list[Profile]
    after: list[Profile] = field(default_factory=list)
    skipped_first: bool = False
    cause: dict | None = None  # the slot's cause before the change (a revert restores it)


@dataclass
class _Slot:
    knobs: Knobs
    version: int = 0
    worker_id: str = ""
    streak: tuple[str, Knobs] | None = None
    streak_count: int = 0
    streak_profiles: list = field(default_factory=list)  # the streak's profiles with traffic: a trial's "before"
    recent: deque = field(default_factory=lambda: deque(maxlen=MEASURE))  # profiles with traffic
    trial: _Trial | None = None
    blocked: dict[str, float] = field(default_factory=dict)  # policy → monotonic time it may fire again
    reverts: dict[str, int] = field(default_factory=dict)  # policy → its reverts on this worker
    blocked_mix: dict[str, tuple] = field(default_factory=dict)  # policy → the mix its last revert saw
    # Why the placement (cpus) is narrowed: {"policy", "reason", "cpus": the loaded CPUs, "at":
    # wall seconds}; None: it is not narrowed, or an operator pinned it.
    cause: dict | None = None
    calm: int = 0  # consecutive profiles in which the cause was gone
    resume_check: bool = False  # resumed knobs not yet compared with the defaults
    chosen_for: tuple | None = None  # the mix (_mix) the scheduler knobs were chosen under
    drifting: int = 0  # consecutive profiles drifted from chosen_for


def slot_of(worker_id: str, cpus: list[int]) -> str:
    """"host/node0/1234" on CPUs 0,1 → "host/node0/cpus0-1": stable across the worker's restarts."""
    base = worker_id.rsplit("/", 1)[0] if worker_id.count("/") >= 2 else worker_id
    if not cpus:
        return base
    return f"{base}/cpus{min(cpus)}-{max(cpus)}" if len(cpus) > 1 else f"{base}/cpus{cpus[0]}"


class Coordinator:
    def __init__(self, defaults: Knobs, *, adaptive: bool = True, wall: Callable[[], float] = time.time):
        self.defaults = defaults
        self.adaptive = adaptive
        self.frozen = False
        self.version = 0  # the newest version handed out (versions are global, so never reused)
        self.slots: dict[str, _Slot] = {}
        self.history: list[Decision] = []
        self.wall = wall
        self.frozen_at: float | None = None  # wall seconds of the freeze in force

    # ---- workers -------------------------------------------------------------------------------

    def strategy_for(self, worker_id: str, cpus: list[int]) -> Strategy | None:
        """What a worker that (re)registers should run; None: its defaults (nothing decided for it)."""
        slot = self._slot(worker_id, cpus)
        if not self.adaptive or slot.version == 0:
            return None
        return Strategy(slot.version, "resumed", slot.knobs, self.frozen)

    def observe(self, profile: Profile, now: float) -> list[Outgoing]:
        """Take one profile; return the strategies to send (none, mostly)."""
        slot = self._slot(profile.worker_id, profile.cpus)
        if profile.knobs_version > self.version:  # a worker older than our persisted state
            self.version = profile.knobs_version
        if not self.adaptive:
            return []
        if profile.knobs_version < slot.version:
            # The worker restarted, or a Strategy was lost: send what it should run.
            return [Outgoing(slot.worker_id, Strategy(slot.version, "resent", slot.knobs, self.frozen))]
        if slot.trial is None and slot.cause is not None and profile.knobs_version == slot.version:
            released = self._release_if_gone(slot, profile)
            if released is not None:
                return [released]
        if self.frozen:
            return []
        busy = profile.steps > 0
        if slot.trial is not None:
            if busy and profile.knobs_version == slot.version:
                return self._measure(slot, profile, now)
            return []
        if busy and (not slot.resume_check or profile.knobs_version == slot.version):
            slot.recent.append(profile)
        if slot.resume_check:
            return self._check_resumed(slot)
        proposals = [p for p in propose(profile, slot.knobs, self.defaults)
                     if slot.blocked.get(p.policy, 0.0) <= now or self._drifted(slot, p.policy, profile)]
        if not proposals:
            # A window in which no step ended saw nothing: it neither confirms nor breaks a streak.
            # (A 3,500-token document's 512-token chunk steps took ~4.5 s on the 1.5B file, so its
            # 3 s profiles alternated one step and none: bench/adaptive.py traffic-shift, Zen 4, 12-07.)
            if busy:
                slot.streak, slot.streak_count, slot.streak_profiles = None, 0, []
            retest = self._retest_if_drifted(slot, profile, now)
            return [retest] if retest is not None else []
        first = proposals[0]
        key = (first.policy, first.knobs)
        if slot.streak != key:
            slot.streak_count, slot.streak_profiles = 0, []
        slot.streak_count += 1
        slot.streak = key
        if busy:
            slot.streak_profiles.append(profile)
        if slot.streak_count < CONFIRM or len(slot.recent) < 1:
            return []
        before = slot.streak_profiles or list(slot.recent)
        slot.streak, slot.streak_count, slot.streak_profiles = None, 0, []
        return [self._change(slot, first, profile, before)]

    # ---- operator controls ---------------------------------------------------------------------

    def set_frozen(self, frozen: bool) -> list[Outgoing]:
        """Freeze (or thaw) every worker's strategy; the workers hear it so whatever else learns
        there (kernel choice) stops too. A change being measured is kept as it is."""
        if frozen == self.frozen:
            return []
        self.frozen = frozen
        self.frozen_at = self.wall() if frozen else None
        kind = "freeze" if frozen else "unfreeze"
        out = []
        for name, slot in self.slots.items():
            if slot.trial is not None:
                slot.trial.decision.outcome = "kept (frozen while measured)"
                slot.trial = None
            if not slot.worker_id:
                continue
            self.version += 1
            slot.version = self.version
            slot.resume_check = False  # the operator has looked at these knobs
            self._record(Decision(self.version, name, self.wall(), kind, "operator", f"strategy {kind}",
                                  slot.knobs.as_dict(), slot.knobs.as_dict()))
            out.append(Outgoing(slot.worker_id, Strategy(slot.version, kind, slot.knobs, frozen)))
        log.info("coordinator: strategy %s (%d workers told)", "frozen" if frozen else "unfrozen", len(out))
        return out

    def export(self) -> dict[str, Any]:
        """The strategy as JSON: knobs per slot, the version counter, freeze, and the history."""
        return {"version": self.version, "frozen": self.frozen, "frozen_at": self.frozen_at,
                "saved_at": self.wall(), "adaptive": self.adaptive, "defaults": self.defaults.as_dict(),
                "workers": {name: {"version": slot.version, "knobs": slot.knobs.as_dict(),
                                   **({"cause": slot.cause} if slot.cause else {})}
                            for name, slot in self.slots.items() if slot.version},
                "history": [d.as_dict() for d in self.history]}

    def restore(self, doc: dict[str, Any]) -> None:
        """Resume a persisted strategy (export()'s output); ConfigError when it is malformed. A
        slot whose knobs are out of bounds (saved by a version that let any key import knobs of
        1) is dropped with a warning: its worker starts from reame.conf's knobs."""
        version = doc.get("version", 0)
        if not isinstance(version, int) or version < 0:
            raise ConfigError(f"strategy: bad version {version!r}")
        self.version = max(self.version, version)
        self.frozen = bool(doc.get("frozen", False))
        frozen_at = doc.get("frozen_at")
        self.frozen_at = float(frozen_at) if self.frozen and isinstance(frozen_at, (int, float)) else None
        history = doc.get("history", [])
        if isinstance(history, list):
            self.history = [Decision(**d) for d in history[-HISTORY:] if isinstance(d, dict) and _is_decision(d)]
        for name, entry in _workers(doc).items():
            knobs = Knobs.from_dict(entry.get("knobs"), f"strategy workers[{name!r}]")
            try:
                knobs.check_within(self.defaults, f"strategy workers[{name!r}]", min_batch=1)
            except ConfigError as exc:
                log.warning("coordinator: the saved strategy's slot %r is dropped: %s", name[:80], exc.message)
                continue
            slot = self.slots.setdefault(name, _Slot(self.defaults))
            slot.version = int(entry.get("version", 0)) if isinstance(entry.get("version"), int) else 0
            slot.knobs = self._without_stale_placement(name, knobs, entry.get("cause"))
            slot.resume_check = not self.frozen and slot.knobs != self._defaults_at(slot.knobs)

    def import_strategy(self, doc: dict[str, Any]) -> list[Outgoing]:
        """Pin an exported strategy: each slot it names (or every slot, for "*") takes its knobs
        now, under a new version, and the strategy is frozen so nothing learns it away
        (`unfreeze` lets learning resume from it). The document's own "frozen" is not read: it
        says how the exporting server was, not what the operator wants now."""
        return self.pin(self.check_import(doc, frozenset(self.slots)))

    def check_import(self, doc: Any, known: frozenset[str]) -> dict[str, Knobs]:
        """The knobs an import pins per slot; ConfigError naming what is wrong. Reads only its
        arguments and the defaults, so it may run off the event loop (`known`: the slot names,
        copied on it). A slot must be one of `known` or "*": an import cannot make slots (thousands
        of new names grew a gateway by 96 MB), and knobs keep to Knobs.check_within's bounds."""
        if not self.adaptive:
            raise ConfigError("adaptivity is off ([tuning] adaptive = false): the knobs stay as reame.conf says")
        workers = _workers(doc)
        if not workers:
            raise ConfigError("strategy: no workers to import (expected {\"workers\": {SLOT: {\"knobs\": {...}}}})")
        unknown = [name for name in workers if name != "*" and name not in known]
        if unknown:
            shown = ", ".join(repr(name[:80]) for name in unknown[:3]) + (", ..." if len(unknown) > 3 else "")
            raise ConfigError(f"strategy: {len(unknown)} worker slot(s) this server does not know ({shown}); "
                              "name slots of GET /admin/strategy's workers, or \"*\" for every worker")
        chosen = {name: Knobs.from_dict(entry.get("knobs"), f"strategy workers[{name!r}]")
                  for name, entry in workers.items()}
        for name, knobs in chosen.items():
            knobs.check_within(self.defaults, f"strategy workers[{name!r}]")
        return chosen

    def pin(self, chosen: dict[str, Knobs]) -> list[Outgoing]:
        """Apply check_import's knobs, frozen."""
        if not self.adaptive:
            raise ConfigError("adaptivity is off ([tuning] adaptive = false): the knobs stay as reame.conf says")
        frozen = True
        targets = set(self.slots) | (set(chosen) - {"*"})
        out = []
        for name in sorted(targets):
            knobs = chosen.get(name, chosen.get("*"))
            if knobs is None:
                continue
            slot = self.slots.setdefault(name, _Slot(self.defaults))
            slot.trial = None
            self.version += 1
            decision = Decision(self.version, name, self.wall(), "import", "operator", "imported strategy",
                                slot.knobs.as_dict(), knobs.as_dict())
            slot.knobs, slot.version = knobs, self.version
            slot.cause, slot.resume_check = None, False  # an operator's placement has no cause to outlive
            self._record(decision)
            if slot.worker_id:
                out.append(Outgoing(slot.worker_id, Strategy(slot.version, "imported", knobs, frozen)))
        if not self.frozen:
            self.frozen_at = self.wall()
        self.frozen = frozen
        return out

    # ---- changes and their measurement ---------------------------------------------------------

    def _change(self, slot: _Slot, proposal: Proposal, profile: Profile | None = None,
                before: list[Profile] | None = None) -> Outgoing:
        """Act on `proposal`; its trial measures against `before`, the profiles that proposed it
        (default: the recent ones). Not the recent ones then: a neighbour that arrived two
        profiles ago left a quiet profile among them, and a CPU placement measured against that
        was reverted as a loss (-23% ±54%) while it was a gain (neighbour scenario, 2026-12-06,
        AMD Zen 3)."""
        self.version += 1
        name = self._name_of(slot)
        decision = Decision(self.version, name, self.wall(), "change", proposal.policy, proposal.reason,
                            slot.knobs.as_dict(), proposal.knobs.as_dict(), goal=proposal.goal, outcome="measuring")
        slot.trial = _Trial(decision, slot.knobs, list(slot.recent) if before is None else before, cause=slot.cause)
        slot.cause = self._cause_after(slot, proposal, profile)
        log.info("coordinator: %s v%d: %s (%s), because %s; measuring %s", name, self.version,
                 proposal.knobs.describe(slot.knobs), proposal.policy, proposal.reason, proposal.goal)
        slot.knobs, slot.version = proposal.knobs, self.version
        self._record(decision)
        return Outgoing(slot.worker_id, Strategy(slot.version, f"{proposal.policy}: {proposal.reason}", slot.knobs))

    def _measure(self, slot: _Slot, profile: Profile, now: float) -> list[Outgoing]:
        trial = slot.trial
        if not trial.skipped_first:
            trial.skipped_first = True
            return []
        trial.after.append(profile)
        if len(trial.after) < MEASURE:
            return []
        slot.trial = None
        slot.recent.clear()
        slot.recent.extend(trial.after)
        decision = trial.decision
        goal = METRICS[decision.goal]
        before, after = _mean(goal.read, trial.before), _mean(goal.read, trial.after)
        change = _relative_change(goal.read, trial.before, trial.after)
        better = change if goal.higher_is_better else -change
        tput_change = _relative_change(METRICS[THROUGHPUT].read, trial.before, trial.after)
        decision.effect = {"before": round(before, 3), "after": round(after, 3), "change": round(change, 4),
                           "noise": round(_change_noise(goal.read, trial.before, trial.after), 4),
                           "throughput_change": round(tput_change, 4)}
        # A placement takes CPUs away: it must prove itself beyond the windows' noise. Kept
        # whenever it was not clearly worse, a move off CPU 1 made while the bench's quiet phase
        # shared the host with other work (+12% ±31%) held 3.6 minutes at half the throughput
        # (bench/adaptive.py --scenario neighbour, Qwen2.5-1.5B, 12-06).
        unproven = decision.policy in CONDITIONAL and better <= PROOF_Z * decision.effect["noise"]
        costly = False
        if decision.policy in GUARDS:  # what the change must not cost beside its goal
            guarded, allowed = GUARDS[decision.policy]
            guard = METRICS[guarded]
            cost = _relative_change(guard.read, trial.before, trial.after)
            decision.effect["guard_change"] = round(cost, 4)
            costly = (-cost if guard.higher_is_better else cost) > allowed
        negative = better < -TOLERANCE or tput_change < -THROUGHPUT_GUARD or unproven or costly
        name = self._name_of(slot)
        if decision.policy == RESUME_CHECK:
            log.info("coordinator: %s: the resumed strategy %s: the shipped defaults made %s %.3g → %.3g (%+.0f%%)",
                     name, "is kept" if negative else "is dropped", goal.name, before, after, 100 * change)
        if not negative:
            decision.outcome = "kept"
            if decision.policy in (RESUME_CHECK, RETEST):
                slot.chosen_for = None  # the defaults serve again
            elif decision.policy not in CONDITIONAL:
                slot.chosen_for = _mix(trial.before)
            log.info("coordinator: %s v%d kept: %s %.3g → %.3g (%+.0f%%)%s", name, decision.version, goal.name,
                     before, after, 100 * change,
                     "" if goal.name == THROUGHPUT else f", tokens per busy second {100 * tput_change:+.0f}%")
            return []
        decision.outcome = "reverted"
        count = slot.reverts[decision.policy] = slot.reverts.get(decision.policy, 0) + 1
        rest = min(MAX_TABU_S, TABU_S * 2 ** (count - 1))
        slot.blocked[decision.policy] = now + rest
        slot.blocked_mix[decision.policy] = _mix(trial.after)
        self.version += 1
        revert = Decision(self.version, name, self.wall(), "revert", decision.policy,
                          f"v{decision.version} made {goal.name} {100 * change:+.0f}% (tokens per busy second "
                          f"{100 * tput_change:+.0f}%"
                          + (f", {GUARDS[decision.policy][0]} {100 * decision.effect['guard_change']:+.0f}%"
                             if "guard_change" in decision.effect else "") + ")",
                          slot.knobs.as_dict(), trial.previous.as_dict(),
                          goal=decision.goal, effect=dict(decision.effect))
        log.info("coordinator: %s v%d reverted by v%d: %s; %r not tried again for %.0f s (revert %d) unless "
                 "the traffic changes", name, decision.version, self.version, revert.reason, decision.policy, rest,
                 count)
        slot.knobs, slot.version, slot.cause = trial.previous, self.version, trial.cause
        if decision.policy == RETEST:
            slot.chosen_for = _mix(trial.after)  # the learned knobs still win on this traffic
        self._record(revert)
        return [Outgoing(slot.worker_id, Strategy(slot.version, f"revert: {revert.reason}", slot.knobs))]

    def _drifted(self, slot: _Slot, policy: str, profile: Profile) -> bool:
        """Whether a resting policy may be tried again before its rest ends: the profile moved from
        the one its revert was measured on."""
        then = slot.blocked_mix.get(policy)
        if then is None or profile.steps == 0:
            return False
        moved = _moved(then, _mix([profile]))
        if not moved:
            return False
        del slot.blocked[policy], slot.blocked_mix[policy]
        log.info("coordinator: %s: %r may be tried again before its rest ends: the profile drifted (%s)",
                 self._name_of(slot), policy, ", ".join(moved))
        return True

    def _retest_if_drifted(self, slot: _Slot, profile: Profile, now: float) -> Outgoing | None:
        """Try the defaults against knobs chosen for a mix the traffic has left."""
        if slot.chosen_for is None or profile.steps == 0 or slot.blocked.get(RETEST, 0.0) > now:
            return None
        target = self._defaults_at(slot.knobs)
        if target == slot.knobs:
            slot.chosen_for = None
            return None
        moved = _moved(slot.chosen_for, _mix([profile]), neighbours=False)
        slot.drifting = slot.drifting + 1 if moved else 0
        if slot.drifting < max(CONFIRM, MEASURE):  # and the trial's "before" is all of the new mix
            return None
        slot.drifting = 0
        return self._change(slot, Proposal(RETEST, target, THROUGHPUT,
                                           f"the traffic these knobs were chosen for has changed ({', '.join(moved)})"))

    # ---- conditional choices and resumed strategies --------------------------------------------

    def _cause_after(self, slot: _Slot, proposal: Proposal, profile: Profile | None) -> dict | None:
        """The slot's cause once `proposal` is applied: recorded when a CONDITIONAL policy narrows
        the placement, dropped once the placement is the defaults' again."""
        new, old = proposal.knobs, slot.knobs
        if new.cpus == ():
            return None
        if profile is None or proposal.policy not in CONDITIONAL:
            return slot.cause
        cause = dict(slot.cause or {"cpus": []})
        removed = set(old.cpus or profile.cpus) - set(new.cpus or profile.cpus)
        cause["cpus"] = sorted(set(cause["cpus"]) | removed)
        cause.update(policy=proposal.policy, reason=proposal.reason, at=self.wall())
        return cause

    def _release_if_gone(self, slot: _Slot, profile: Profile) -> Outgoing | None:
        """Undo a conditional placement once its cause has been gone for CONFIRM profiles (~10 s at
        the default profile_interval); not measured (the measurement was made under the cause)."""
        cause = slot.cause
        others = others_by_cpu(profile)
        loaded = cause["cpus"] if others else []
        now_load = max(others.get(c, 1.0) for c in loaded) if loaded else profile.cpu_others
        slot.calm = slot.calm + 1 if now_load <= QUIET_NEIGHBOURS else 0
        if slot.calm < CONFIRM:
            return None
        slot.calm, slot.cause = 0, None
        knobs = slot.knobs.with_(cpus=())
        where = f"CPU {','.join(map(str, loaded))}" if loaded else "this worker's CPUs"
        self.version += 1
        name = self._name_of(slot)
        reason = (f"its cause is gone: other processes use {100 * now_load:.0f}% of {where} now "
                  f"({cause.get('policy')}, {age(self.wall() - cause.get('at', self.wall()))} ago: "
                  f"{cause.get('reason', '')})")
        decision = Decision(self.version, name, self.wall(), "release", cause.get("policy", ""), reason,
                            slot.knobs.as_dict(), knobs.as_dict())
        log.info("coordinator: %s v%d: %s, %s%s", name, self.version, knobs.describe(slot.knobs), reason,
                 " (the strategy stays frozen otherwise)" if self.frozen else "")
        slot.knobs, slot.version = knobs, self.version
        self._record(decision)
        return Outgoing(slot.worker_id, Strategy(slot.version, f"release: {reason}", knobs, self.frozen))

    def _defaults_at(self, knobs: Knobs) -> Knobs:
        """The shipped scheduler knobs at `knobs`' placement (placement has its own rules)."""
        return self.defaults.with_(cpus=knobs.cpus, bind_memory=knobs.bind_memory)

    def _check_resumed(self, slot: _Slot) -> list[Outgoing]:
        """Once MEASURE profiles with traffic ran the resumed knobs: try the defaults against them."""
        if len(slot.recent) < MEASURE:
            return []
        slot.resume_check = False
        target = self._defaults_at(slot.knobs)
        if target == slot.knobs:
            return []
        return [self._change(slot, Proposal(RESUME_CHECK, target, THROUGHPUT,
                                            "a resumed strategy is trusted only if it beats the shipped defaults"))]

    def _without_stale_placement(self, name: str, knobs: Knobs, cause: Any) -> Knobs:
        """A restored slot's knobs, less a placement that was chosen because of other processes'
        load: that load is not trusted across a restart, the policies re-test it live. A placement
        an operator imported stays. Strategies saved before causes were recorded: the slot's
        history says which policy chose it."""
        if not knobs.cpus:
            return knobs
        if not isinstance(cause, dict):
            chosen_by = next((d for d in reversed(self.history) if d.slot == name
                              and (d.policy in CONDITIONAL or d.kind == "import")), None)
            if chosen_by is None or chosen_by.kind == "import":
                return knobs
            cause = {"policy": chosen_by.policy, "reason": chosen_by.reason, "at": chosen_by.at}
        at = cause.get("at")
        since = age(self.wall() - at) if isinstance(at, (int, float)) else "some time"
        log.warning("coordinator: %s: the saved placement (cpus %s) is not resumed: %s chose it %s ago "
                    "because %s; the worker starts on all its CPUs and the policies re-test that live",
                    name[:80], ",".join(map(str, knobs.cpus)), cause.get("policy"), since, cause.get("reason"))
        return knobs.with_(cpus=())

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _slot(self, worker_id: str, cpus: list[int]) -> _Slot:
        name = slot_of(worker_id, cpus)
        slot = self.slots.get(name)
        if slot is None:
            slot = self.slots[name] = _Slot(self.defaults)
        slot.worker_id = worker_id
        return slot

    def _name_of(self, slot: _Slot) -> str:
        return next(name for name, s in self.slots.items() if s is slot)

    def _record(self, decision: Decision) -> None:
        self.history.append(decision)
        del self.history[:-HISTORY]


_MIX_NAMES = ("prompt tokens p50", "output tokens p50", "arrivals/s", "other processes")


def _mix(profiles: list[Profile]) -> tuple[float | None, ...]:
    """What a verdict depended on, averaged over its profiles: the request mix, the rate, the
    neighbours. A length is None when no profile measured it: a window without arrivals has no
    prompt lengths, not prompts of 0 tokens (traffic-shift, Zen 5, 12-07: documents of ~4 s chunk
    steps left most 3 s windows without an arrival, and each such window read as "prompt tokens
    p50 1.37e+03→0", a drift that let a rested policy be tried again 4 times in 150 s)."""
    n = max(1, len(profiles))
    return (_mean_of([p.prompt_tokens_p50 for p in profiles if p.arrivals]),
            _mean_of([p.output_tokens_p50 for p in profiles if p.finished]),
            sum(p.arrivals / p.seconds for p in profiles) / n, sum(p.cpu_others for p in profiles) / n)


def _mean_of(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _moved(then: tuple, now: tuple, neighbours: bool = True) -> list[str]:
    """What moved by more than MIX_DRIFT between two _mix()es, in words (a figure one side did not
    measure has not moved)."""
    moved = [f"{name} {a:.3g}→{b:.3g}" for name, a, b in zip(_MIX_NAMES[:-1], then[:-1], now[:-1])
             if a is not None and b is not None and abs(math.log((b + 1.0) / (a + 1.0))) > MIX_DRIFT]
    if neighbours and _load(then[-1]) != _load(now[-1]):
        moved.append(f"other processes' share {100 * then[-1]:.0f}%→{100 * now[-1]:.0f}%")
    return moved


def _load(others: float) -> str:
    return "busy" if others >= BUSY_NEIGHBOURS else "quiet" if others <= QUIET_NEIGHBOURS else "some"


def _values(read: Callable[[Profile], float | None], profiles: list[Profile]) -> list[float]:
    """The metric in each window that measured it."""
    return [v for v in map(read, profiles) if v is not None]


def _mean(read: Callable[[Profile], float | None], profiles: list[Profile]) -> float:
    return _mean_of(_values(read, profiles)) or 0.0


def _relative_change(read: Callable[[Profile], float | None], before: list[Profile], after: list[Profile]) -> float:
    """(mean after - mean before) / mean before; 0 when a side has no window that measured it
    (no evidence either way)."""
    was, now = _mean_of(_values(read, before)), _mean_of(_values(read, after))
    return (now - was) / was if was and now is not None else 0.0


def _change_noise(read: Callable[[Profile], float | None], before: list[Profile], after: list[Profile]) -> float:
    """The standard error of (mean after - mean before) / mean before, from the windows' own
    variation: what the load alone moves the goal by (the report marks a smaller change as noise)."""
    def variance_of_mean(profiles: list[Profile]) -> float:
        values = _values(read, profiles)
        if len(values) < 2:
            return 0.0
        m = sum(values) / len(values)
        return sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values)

    base = _mean(read, before)
    return math.sqrt(variance_of_mean(before) + variance_of_mean(after)) / abs(base) if base else 0.0


def _workers(doc: Any) -> dict[str, dict]:
    if not isinstance(doc, dict):
        raise ConfigError("strategy: expected a JSON object")
    workers = doc.get("workers", {})
    if not isinstance(workers, dict) or not all(isinstance(v, dict) for v in workers.values()):
        raise ConfigError("strategy: workers must map slot names to {\"knobs\": {...}}")
    return workers


def _is_decision(data: dict) -> bool:
    return set(data) == set(Decision.__dataclass_fields__)
