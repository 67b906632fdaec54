"""The policies: one worker's profile and knobs in, proposed knob changes out. Pure functions.

Each policy names the knob it moves, the value, why (in numbers from the profile), and the goal by
which its effect is judged afterwards (coordinator.py reverts a change whose goal got worse):
- memory: more sequences than the KV pool holds at the sizes seen (preemptions) → fewer.
- bursts: arrivals come in bursts → a shorter batching window (a burst fills a batch anyway;
  the window only delays the lone requests between bursts).
- short requests: many short requests filling the batch → larger batches, and a wider
  window so lone arrivals meet company.
- long generations: long outputs with a full batch → smaller batches, for the tail latency of
  each token.
- busy CPUs: other processes take most of one CPU the worker runs on → run on its node's other
  CPUs only; quiet CPUs: such a CPU is quiet again → take it back. The thread count is not
  chosen here: the worker's kernel tuner times each count on live steps and decides it, never
  above the CPUs this placement leaves (a neighbour on every CPU shows there as slower steps).
- memory binding: on a host of several NUMA nodes, bind the worker's memory to its node (pages
  moved there); kept only if tokens per busy second do not drop.
- long prompts: prompt-chunk steps so long that the requests decoding beside them wait that long for
  each token → decode-only steps after each chunk (decode_share doubled from 1/4), judged by the
  mean gap between tokens, guarded on time to first token. Smaller chunks would shorten those
  steps too, but they were judged by step length, which any smaller chunk lowers, and on documents
  of 3,500 tokens (Qwen2.5-Coder-1.5B, Zen 4) they took p95 time to first token from 39.6 s to 72.9 s.
Steps are doublings and halvings within fixed bounds, so the knobs take few distinct values and
the coordinator's hysteresis settles on one of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from shared.knobs import MAX_DECODE_SHARE, MAX_WINDOW_MS, MIN_BATCH, MIN_WINDOW_MS, Knobs, batch_ceiling
from shared.protocol import Profile


@dataclass(frozen=True)
class Metric:
    """What a change is judged by, measured on the profiles before and after it. `read` gives
    None for a window that measured nothing of it (no request had two tokens in it, say): such
    windows are left out of the means instead of counting as 0."""
    name: str
    read: Callable[[Profile], float | None]
    higher_is_better: bool


METRICS = {m.name: m for m in (
    # Prompt and generated tokens together: output tokens alone fall whenever a window holds more
    # prefill (a burst of new prompts), whatever the knobs did.
    Metric("tokens per busy second",
           lambda p: (p.prefill_tokens + p.output_tokens) / p.busy_seconds if p.busy_seconds else 0.0, True),
    Metric("step ms", lambda p: 1000 * p.busy_seconds / p.steps if p.steps else 0.0, False),
    Metric("prefill step ms", lambda p: p.step_ms_prefill, False),
    Metric("queue wait p95 ms", lambda p: p.queue_wait_ms_p95, False),
    # The mean, not the p95: a share that lets 15 tokens through after each 3 s chunk step cuts the
    # time a streaming client waits per token ~10x, and leaves the p95 gap at the chunk step.
    Metric("token gap ms", lambda p: p.token_gap_ms_mean or None, False),
    Metric("ttft p95 ms", lambda p: p.ttft_ms_p95 or None, False),
)}
THROUGHPUT, STEP_MS, PREFILL_STEP_MS, QUEUE_WAIT, TOKEN_GAP, TTFT = METRICS

# What a policy's change must not cost beside its goal (a METRICS name: the most it may get worse).
# Decode-only steps delay prompts: at the first share, 1/4, a prompt takes at most 25% longer, so a
# time to first token worse by more than 30% is a loss, not the share's price.
GUARDS = {"long prompts": (TTFT, 0.30)}

# Bounds of what the policies may choose are shared.knobs' (MIN_BATCH, MIN/MAX_WINDOW_MS,
# MIN_PREFILL_CHUNK; the batch: batch_ceiling of reame.conf's): an import keeps to them too.

# When a policy fires (measured per profile window).
SHORT_OUTPUT_TOKENS = 96  # a generation this short (p50) is a short request
BUSY_ARRIVALS_PER_S = 0.5
FULL_BATCH = 0.75  # mean batch size / max_batch_size above which the batch counts as full
LONG_OUTPUT_TOKENS = 256
BURSTY = 2.0  # coefficient of variation of arrival gaps (Poisson: 1)
BUSY_NEIGHBOURS = 0.5  # share of the worker's CPU time other processes used
QUIET_NEIGHBOURS = 0.15
MIN_ARRIVALS_FOR_BURSTS = 8
# A token every 400 ms is 2.5 tokens/s, below reading speed: decoders stalled that long (p95 gap,
# behind prompt-chunk steps at least that long) are stalled by the prompts.
STALLED_TOKEN_MS = 400.0
FIRST_DECODE_SHARE = 0.25


@dataclass(frozen=True)
class Proposal:
    policy: str
    knobs: Knobs  # the knobs after the change
    goal: str  # a METRICS name
    reason: str


def propose(profile: Profile, knobs: Knobs, defaults: Knobs) -> list[Proposal]:
    """Every policy that fires on this profile, most urgent first (memory before the rest)."""
    if profile.steps == 0 and profile.arrivals == 0:
        return []  # an idle window says nothing about traffic
    found = [p for rule in (_memory, _busy_cpus, _quiet_cpus, _memory_binding, _bursts, _short_requests,
                            _long_generations, _long_prompts)
             if (p := rule(profile, knobs, defaults)) is not None and p.knobs != knobs]
    return found


def memory_cap(profile: Profile) -> int | None:
    """How many sequences of the sizes seen (p95 prompt + p95 output) the KV pool holds."""
    if not profile.kv_blocks or not profile.kv_block_tokens:
        return None
    tokens = profile.prompt_tokens_p95 + profile.output_tokens_p95
    if tokens <= 0:
        return None
    per_sequence = math.ceil(tokens / profile.kv_block_tokens)
    return max(1, profile.kv_blocks // per_sequence)


def _memory(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    cap = memory_cap(profile)
    if cap is None or profile.preemptions == 0 or knobs.max_batch_size <= cap:
        return None
    size = max(1, cap)
    return Proposal("memory", knobs.with_(max_batch_size=size), THROUGHPUT,
                    f"{profile.preemptions} preemptions: the KV pool ({profile.kv_blocks} blocks) holds {cap} "
                    f"sequences of {profile.prompt_tokens_p95:.0f}+{profile.output_tokens_p95:.0f} tokens")


def others_by_cpu(profile: Profile) -> dict[int, float]:
    return dict(zip(profile.cpus, profile.cpu_others_each)) if len(profile.cpu_others_each) == len(profile.cpus) \
        else {}


def _busy_cpus(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    in_use = knobs.cpus or tuple(profile.cpus)
    others = others_by_cpu(profile)
    if len(in_use) < 2 or not others or profile.steps == 0:
        return None
    worst = max(in_use, key=lambda c: others.get(c, 0.0))
    if others.get(worst, 0.0) < BUSY_NEIGHBOURS:
        return None
    keep = tuple(c for c in in_use if c != worst)
    return Proposal("busy CPUs", knobs.with_(cpus=keep), THROUGHPUT,
                    f"other processes used {100 * others[worst]:.0f}% of CPU {worst}: every parallel kernel "
                    f"waits for its thread there, so run on CPUs {_cpu_list(keep)} only")


def _quiet_cpus(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    others = others_by_cpu(profile)
    if not knobs.cpus or not others:
        return None
    quiet = [c for c in profile.cpus if c not in knobs.cpus and others.get(c, 1.0) <= QUIET_NEIGHBOURS]
    if not quiet:
        return None
    cpus = tuple(sorted(set(knobs.cpus) | set(quiet)))
    return Proposal("quiet CPUs", knobs.with_(cpus=() if set(cpus) == set(profile.cpus) else cpus), THROUGHPUT,
                    f"other processes used only {100 * max(others[c] for c in quiet):.0f}% of CPUs "
                    f"{_cpu_list(quiet)}: take them back")


def _memory_binding(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    if profile.numa_nodes < 2 or knobs.bind_memory or profile.steps == 0:
        return None
    return Proposal("memory binding", knobs.with_(bind_memory=True), THROUGHPUT,
                    f"{profile.numa_nodes} NUMA nodes: weights and KV on the worker's own node are read "
                    f"without crossing the interconnect")


def _cpu_list(cpus) -> str:
    return ",".join(map(str, cpus))


def _bursts(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    if (profile.arrivals < MIN_ARRIVALS_FOR_BURSTS or profile.burstiness < BURSTY
            or knobs.batching_window_ms <= MIN_WINDOW_MS):
        return None
    window = max(MIN_WINDOW_MS, knobs.batching_window_ms / 2)
    return Proposal("bursts", knobs.with_(batching_window_ms=window), QUEUE_WAIT,
                    f"arrivals come in bursts (gap variation {profile.burstiness:.1f}, Poisson 1): "
                    f"a shorter window only delays the lone ones")


def _short_requests(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    rate = profile.arrivals / profile.seconds
    # Requests beyond a worker's batch wait in the gateway's queue, not the worker's: a full batch
    # is the sign of them.
    full = profile.batch_size_mean >= FULL_BATCH * knobs.max_batch_size
    if rate < BUSY_ARRIVALS_PER_S or profile.finished == 0 or profile.output_tokens_p50 > SHORT_OUTPUT_TOKENS or not full:
        return None
    cap = memory_cap(profile)
    limit = min(batch_ceiling(defaults.max_batch_size), cap if cap is not None else 1 << 30)
    size = min(limit, knobs.max_batch_size * 2)
    changes = {"max_batch_size": size, "token_budget": max(knobs.token_budget, size + knobs.prefill_chunk)}
    if profile.burstiness < BURSTY:  # bursts want the opposite; _bursts has it
        changes["batching_window_ms"] = min(MAX_WINDOW_MS, max(knobs.batching_window_ms * 2, 1.0))
    if size <= knobs.max_batch_size and changes.get("batching_window_ms", knobs.batching_window_ms) \
            == knobs.batching_window_ms:
        return None
    return Proposal("short requests", knobs.with_(**changes), THROUGHPUT,
                    f"{rate:.1f} requests/s of {profile.output_tokens_p50:.0f} output tokens (p50) fill "
                    f"the batch ({profile.batch_size_mean:.1f} of {knobs.max_batch_size})")


def _long_generations(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    full = profile.batch_size_mean >= FULL_BATCH * knobs.max_batch_size
    if profile.output_tokens_p50 < LONG_OUTPUT_TOKENS or not full or knobs.max_batch_size <= MIN_BATCH:
        return None
    size = max(MIN_BATCH, (knobs.max_batch_size * 3) // 4)
    return Proposal("long generations", knobs.with_(max_batch_size=size), STEP_MS,
                    f"generations of {profile.output_tokens_p50:.0f} tokens (p50) fill the batch "
                    f"({profile.batch_size_mean:.1f} of {knobs.max_batch_size}): smaller batches for "
                    f"per-token tail latency")


def _long_prompts(profile: Profile, knobs: Knobs, defaults: Knobs) -> Proposal | None:
    # Gaps, not prompt lengths: a prompt whose prefix the cache holds feeds only the rest, and a
    # decode share that already lets decoders through leaves short gaps and asks for no more.
    if (profile.decoders_waiting_on_prefill <= 0 or profile.step_ms_prefill < STALLED_TOKEN_MS
            or profile.token_gap_ms_p95 < STALLED_TOKEN_MS or knobs.decode_share >= MAX_DECODE_SHARE):
        return None
    share = min(MAX_DECODE_SHARE, knobs.decode_share * 2 if knobs.decode_share > 0 else FIRST_DECODE_SHARE)
    return Proposal("long prompts", knobs.with_(decode_share=share), TOKEN_GAP,
                    f"decoders wait {profile.token_gap_ms_p95:.0f} ms between tokens (p95) behind prompt-chunk "
                    f"steps of {profile.step_ms_prefill:.0f} ms ({profile.decoders_waiting_on_prefill:.1f} "
                    f"decoders in each): decode-only steps after each chunk, for {share:g} of its time")
