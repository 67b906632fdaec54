"""The most any drafter could give on the agentic workload: drafts that are always right.

    python bench/draft_ceiling.py [--model smollm2-135m] [--threads 2] [--streams 1 2 3 4 6 8]
                                  [--drafts 1 2 4 8 16] [--runs 3] [--max-tokens 48] [--temperature 0.7]

Speculation is the one lever of adaptivity that changes how many tokens a step yields; the
scheduler knobs and kernel choice only change what a step costs. This measures its ceiling on the
first turns of bench/agentic.py (its four agents' ~550-token system prompts and questions, at
most 48 tokens each: greedy answers may end sooner): for N streams, greedy decoding through the
worker's own loop (BatchGenerator, as in bench/speculative.py), then the same requests with an
oracle drafter that proposes the next k tokens of the greedy output it has already seen. Every
draft is accepted (the table checks it), so no drafter, prompt lookup, archive or learned, can do
better at that draft length: what is left is what verifying k rows per sequence costs against k
plain steps. Beside it runs the worker's own speculator (max_draft 8, prompt lookup and an n-gram
archive in RAM, one per stream count, kept across runs as a worker keeps it, after one unmeasured
run that fills its archive with these outputs, as traffic that repeats would): how much of the
ceiling it reaches.

Decode tok/s counts tokens of steps without prompt rows over those steps' time. The last lines
weigh each stream count by the agentic workload's phases (bench/agentic.PHASES, 30 s each) and
its off rate: the ceiling of the whole run's on/off, before its prefill (which drafts cannot
shorten) dilutes it further.

Sampled requests (--temperature, bench/agentic.py's 0.7): a drafted token is accepted when the
token sampled at its row equals it, so even a drafter that always proposes the model's most
likely token is accepted with probability q = p_max at that temperature. The same prompts are
sampled (8 requests at a time, --runs times) and q read at every position from the 20 best raw
logits (the missing tail only raises q: the bound stays a bound). A draft of k tokens from
position i then yields on average 1 + sum over j <= k of q[i+1]...q[i+j] tokens for its 1 + k
rows; at the rows rate the oracle measured (every row a token) that gives each stream count's
ceiling for the best k (k = 0: no drafting). Not a test: shared, noisy machines; read ratios
from one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import blas_env  # noqa: E402

blas_env.prefer_native_blas()

from benchlib import say  # noqa: E402  (bench/, the script's directory, is on sys.path)
from speculative import load_chat_model, run_batch  # noqa: E402

from worker.speculative.archive import NgramArchive  # noqa: E402
from worker.speculative.speculator import SpecCounters, Speculator  # noqa: E402


class OracleDrafter:
    """Stands in for worker.speculative.Speculator: drafts the next k tokens of a known output."""

    def __init__(self, outputs: dict[str, list[int]], k: int):
        self.outputs, self.k = outputs, k
        self.counters = SpecCounters()
        self._prompt_len: dict[str, int] = {}

    def begin(self, seq_id: str, prompt_ids: list[int]) -> None:
        self._prompt_len[seq_id] = len(prompt_ids)

    def end(self, seq_id: str, tokens: list[int] | None = None, num_prompt: int = 0) -> None:
        self._prompt_len.pop(seq_id, None)

    def before_step(self, decoding: int) -> None:
        pass

    def propose(self, seq_id: str, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - self._prompt_len[seq_id]
        return self.outputs[seq_id][done:done + min(limit, self.k)]

    def observe(self, seq_id: str, drafted: int, accepted: int) -> None:
        c = self.counters
        c.spec_drafts += 1
        c.spec_drafted_tokens += drafted
        c.spec_accepted_tokens += accepted

    def observe_step(self, *args, **kwargs) -> None:
        pass


def agentic_prompts(n: int) -> list[list[dict]]:
    """First turns of bench/agentic.py: agent i % AGENTS's system prompt, question i."""
    from agentic import AGENTS, QUESTIONS, system_prompt
    return [[{"role": "system", "content": system_prompt(i % AGENTS)},
             {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="draft lengths k")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request (bench/agentic.py: 48)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="also bound drafting for requests sampled at this temperature (0: skip)")
    args = parser.parse_args()

    from threadpoolctl import threadpool_limits

    from agentic import PHASES
    from worker.kv.block_manager import BlockManager
    from worker.kv.prefix_cache import PrefixCache

    _, engine, tok, template, stop_ids = load_chat_model(args.model, args.threads)
    prompts = [tok.encode(template.render(m, add_generation_prompt=True)) for m in agentic_prompts(max(args.streams))]
    say(f"prompt tokens: {min(map(len, prompts))}-{max(map(len, prompts))}")
    blocks = BlockManager.for_pool(engine.kv)
    prefix = PrefixCache(blocks, b"bench-draft-ceiling")  # the system prompts prefill once, as when serving
    off_rate: dict[int, float] = {}
    ratio: dict[tuple[int, int], float] = {}
    rows = []  # (streams, k, off tok/s, oracle tok/s, on/off, accepted share)
    speculator_rows = []  # (streams, on/off, accepted, drafted) of the worker's own speculator
    with threadpool_limits(limits=args.threads, user_api="blas"):
        run_batch(engine, [prompts[0][:40]], stop_ids, None, prefix, max_tokens=8)  # compile and warm
        run_batch(engine, prompts, stop_ids, None, prefix, max_tokens=1)  # prompts into the prefix cache
        for streams in args.streams:
            off, oracle, speculator = measure(engine, prompts[:streams], stop_ids, prefix, args)
            off_rate[streams] = off
            for k, (rate, share) in oracle.items():
                ratio[streams, k] = rate / off
                rows.append((streams, k, off, rate, ratio[streams, k], share))
            speculator_rows.append((streams, speculator[0] / off, *speculator[1:]))
    print(f"\nalways-right drafts on agentic first turns (at most {args.max_tokens} tokens), {args.threads} threads, "
          f"medians of {args.runs}")
    print("| streams | draft k | off tok/s | oracle tok/s | ceiling on/off | drafts accepted |")
    print("|---|---|---|---|---|---|")
    for streams, k, plain, drafted, r, share in rows:
        print(f"| {streams} | {k} | {plain:.1f} | {drafted:.1f} | {r:.2f}x | {share:.0%} |")
    print("\nthe worker's speculator (max_draft 8, archive warmed by one run) on the same requests")
    print("| streams | on/off | drafted tokens accepted |")
    print("|---|---|---|")
    for streams, r, acc, drafted in speculator_rows:
        print(f"| {streams} | {r:.2f}x | {acc} of {drafted} ({acc / drafted if drafted else 0:.0%}) |")
    phases = [c for c in PHASES if c in off_rate]
    if not phases:
        return
    for k in args.drafts:
        weighted = phase_weighted(off_rate, {c: ratio[c, k] for c in phases}, phases)
        print(f"agentic phases {phases}, k={k}: decode ceiling {weighted:.2f}x off (every draft right)")
    if args.temperature <= 0:
        return
    with threadpool_limits(limits=args.threads, user_api="blas"):
        q = best_token_probabilities(engine, prompts[:8], stop_ids, prefix, args)
    yields = {k: tokens_per_draft(q, k) for k in args.drafts}
    print(f"\nsampled at temperature {args.temperature}: {sum(map(len, q))} positions, the most likely token's "
          f"probability q: mean {statistics.mean(v for seq in q for v in seq):.2f}, median "
          f"{statistics.median(v for seq in q for v in seq):.2f}")
    print("tokens per step and sequence with drafts of the most likely tokens: "
          + ", ".join(f"k={k} {yields[k]:.2f} of {1 + k} rows" for k in args.drafts))
    print("| streams | best k | ceiling on/off |")
    print("|---|---|---|")
    best = {}
    for c in sorted(off_rate):
        # rows/s with k drafted rows per sequence = the oracle's tok/s (every row was a token there)
        options = {k: ratio[c, k] * yields[k] / (1 + k) for k in args.drafts}
        k = max(options, key=options.get)
        best[c] = max(1.0, options[k])
        print(f"| {c} | {k if options[k] > 1 else 0} | {best[c]:.2f}x |")
    weighted = phase_weighted(off_rate, best, phases)
    print(f"agentic phases {phases} at temperature {args.temperature}: decode ceiling {weighted:.2f}x off")


def phase_weighted(off_rate: dict[int, float], ratio: dict[int, float], phases: list[int]) -> float:
    """The whole run's on/off when each phase of `phases` clients runs as long and at its stream
    count's off rate times its ratio: tokens with drafting over tokens without."""
    return sum(off_rate[c] * ratio[c] for c in phases) / sum(off_rate[c] for c in phases)


def measure(engine, batch, stop_ids, prefix, args) -> tuple[float, dict[int, tuple[float, float]], tuple]:
    """For one stream count, medians over --runs (alternating in each run): plain decode tok/s;
    per draft length k the oracle's tok/s and the share of its drafted tokens accepted; and the
    worker's speculator's (tok/s, accepted, drafted). Every drafted run's output must equal greedy."""
    off, on = [], {k: [] for k in args.drafts}
    accepted = {k: [0, 0] for k in args.drafts}
    speculator = Speculator(max_draft=8, archive=NgramArchive())
    run_batch(engine, batch, stop_ids, speculator, prefix, max_tokens=args.max_tokens)  # fills its archive
    real, real_accepted = [], [0, 0]
    for run in range(args.runs):
        plain = run_batch(engine, batch, stop_ids, None, prefix, max_tokens=args.max_tokens)
        off.append(plain.tok_s)
        for k in args.drafts:
            drafted = run_batch(engine, batch, stop_ids, OracleDrafter(plain.outputs, k), prefix,
                                max_tokens=args.max_tokens)
            if drafted.outputs != plain.outputs:
                raise SystemExit(f"{len(batch)} streams, k={k}: drafted output differs from greedy")
            on[k].append(drafted.tok_s)
            accepted[k][0] += drafted.accepted
            accepted[k][1] += drafted.drafted
        served = run_batch(engine, batch, stop_ids, speculator, prefix, max_tokens=args.max_tokens)
        if served.outputs != plain.outputs:
            raise SystemExit(f"{len(batch)} streams: the speculator's output differs from greedy")
        real.append(served.tok_s)
        real_accepted[0] += served.accepted
        real_accepted[1] += served.drafted
        say(f"{len(batch)} streams run {run + 1}/{args.runs}: off {off[-1]:.1f} tok/s, "
            + ", ".join(f"k={k} {on[k][-1]:.1f}" for k in args.drafts) + f", speculator {real[-1]:.1f}")
    oracle = {k: (statistics.median(on[k]), accepted[k][0] / accepted[k][1] if accepted[k][1] else 0.0)
              for k in args.drafts}
    return statistics.median(off), oracle, (statistics.median(real), *real_accepted)


def best_token_probabilities(engine, prompts, stop_ids, prefix, args) -> list[list[float]]:
    """Per sampled sequence, the probability of the most likely token at each position, at the
    temperature (from the 20 best raw logits: the missing tail would only lower it)."""
    import numpy as np

    from shared.sampling import SamplingParams
    from worker.sched.generation import BatchGenerator, TokenEvent
    from worker.sched.tuning_state import SchedulerKnobs, TuningState

    out = []
    for run in range(args.runs):
        say(f"sampling at temperature {args.temperature}: run {run + 1}/{args.runs}")
        generator = BatchGenerator(engine, TuningState(SchedulerKnobs(max_batch_size=8, batching_window_ms=0.0)),
                                   prefix=prefix, blocks=prefix.block_manager)
        qs = {}
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1000 * run + i,
                                    stop_token_ids=stop_ids)
            generator.add(f"s{i}", ids, params, top_logits=20)
            qs[f"s{i}"] = []
        while generator.has_work:
            for e in generator.step():
                if isinstance(e, TokenEvent) and e.top_logits:
                    logits = np.array([v for _, v in e.top_logits], dtype=np.float64)
                    qs[e.request_id].append(float(1.0 / np.exp((logits - logits.max()) / args.temperature).sum()))
        out += list(qs.values())
    return out


def tokens_per_draft(q: list[list[float]], k: int) -> float:
    """Mean tokens a step yields per sequence when it drafts the k most likely next tokens: the
    sampled one, then each drafted one while every one before it was accepted."""
    total, steps = 0.0, 0
    for seq in q:
        for i in range(len(seq)):
            chain, expected = 1.0, 1.0
            for j in range(1, k + 1):
                if i + j >= len(seq):
                    break
                chain *= seq[i + j]
                expected += chain
            total += expected
            steps += 1
    return total / steps if steps else 1.0


if __name__ == "__main__":
    main()
