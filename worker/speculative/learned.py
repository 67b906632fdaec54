"""What the speculator learned that should outlive its process: request classes' acceptance,
the gate's measured step rates and the step-cost fit, kept beside the n-gram archive.

Without it a restarted worker drafted from a warm archive but decided from nothing: the gate
spent its first 48 decode steps per batch size measuring (half of them not drafting), every class
started at the prior's 2-token drafts, and the cost fit started from a default. On the repeated-
JSON workload the first requests after a restart ran at the speed of a cold start
(bench/speculative.py, json-restart).

Saved as learned state is (shared.saved_state: JSON, its kind and version, a CRC); a blob that
fails any check decodes to None (the worker then starts fresh, with a warning).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared import saved_state

KIND = "reame.speculator"
# 4: the gate's steps as (tokens, seconds), its rates being ratios of sums (3 kept per-step rates:
# a 3 save starts fresh, once); 3: saved in shared.saved_state's format (2 had a binary header of
# its own); 2: class records keyed by a prompt-prefix key, with their draft count
VERSION = 4
MAX_CLASSES = 4000  # most recently used class records kept across a restart (~40 bytes each)


@dataclass
class LearnedState:
    # (class key, decayed accepted tokens, decayed rejections, drafts seen), least recently used first
    classes: list[tuple[int, float, float, int]] = field(default_factory=list)
    # per gate bucket: (plain steps, drafted steps), each (tokens emitted, seconds), oldest first
    gate: list[tuple[list[tuple[int, float]], list[tuple[int, float]]]] = field(default_factory=list)
    # StepCost's forgetting sums: (n, x, y, xx, xy)
    cost: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    # prompt-lookup drafts per agreement bucket: (decayed accepted, decayed rejections, drafts)
    agreement: list[tuple[float, float, int]] = field(default_factory=list)


def encode(state: LearnedState) -> bytes:
    return saved_state.encode(KIND, VERSION, {"classes": state.classes[-MAX_CLASSES:], "gate": state.gate,
                                              "cost": list(state.cost), "agreement": state.agreement})


def decode(blob: bytes | None) -> LearnedState | None:
    """The state in a blob, or None when it is absent, of another version, or damaged."""
    raw = saved_state.decode(blob, KIND, VERSION)
    if raw is None:
        return None
    try:
        classes = [(int(key), float(a), float(r), int(n)) for key, a, r, n in raw["classes"]]
        gate = [([(int(t), float(s)) for t, s in plain], [(int(t), float(s)) for t, s in drafted])
                for plain, drafted in raw["gate"]]
        n, x, y, xx, xy = (float(v) for v in raw["cost"])
        agreement = [(float(a), float(r), int(c)) for a, r, c in raw["agreement"]]
    except (ValueError, TypeError, KeyError):
        return None
    return LearnedState(classes, gate, (n, x, y, xx, xy), agreement)
