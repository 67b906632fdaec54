"""Speculative decoding on and off: decode tok/s, acceptance and draft length per workload.

    python bench/speculative.py [--model smollm2-135m] [--threads 2] [--runs 3] [--streams 1 8]

Workloads (greedy, chat template of the model):
  qa      extractive QA over a ~1,500-token document: answers quote it (prompt lookup's case)
  code    the prompt holds a function; the answer is the function with a small change
  json    the same JSON shape for many inputs: the archive's case. --json-requests requests
          (default 24) in groups of `streams`, then a restart (the speculator saves what it
          learned, the archive store closes; a new one is built as a worker builds it, from
          [speculative]) and as many requests again with other inputs. Rows: `json-1` (the first
          group), `json-warm` (the second half of the first run), `json-restart-1` (the first
          group after the restart: it should run at json-warm's speed) and `json-restart`
          (every group after it). Per group: on and off tok/s, printed and plotted
          (--plot, default bench-speculative-json.png)
  free    low-overlap free text (stories on different topics)
Each runs with the speculator off and on, alternately (--runs times each), at every stream
count; streams share one engine through the real BatchGenerator (the server's loop), and one
speculator serves a workload's runs as a worker's serves its traffic (--fresh: one per run). Decode
tok/s counts tokens emitted by steps without prompt rows, over those steps' wall time
(drafting and sampling included). Prints medians and the on/off ratio, and `on = off`: the on runs
whose every output is the off run's beside it, token for token (greedy drafting changes none).

`full batch on/off` (streams > 1): the same ratio over only the steps in which every stream was
decoding, what a server whose finished requests are replaced by new ones sees. The whole-run ratio
is a closed batch's: drafting lets some requests finish early, and the last steps then carry fewer
rows at nearly the same cost (0.5B, free text, 8 streams, Zen 4: 126 steps on against 127 off, the
on run's plain steps 6.2 rows on average against 8.0), so a closed batch can lose where every
step gained.

`lookup bound` (qa, code, free): the most prompt lookup could give on these greedy outputs at the
step costs measured in the run (the speculator's fit, base + per_row × rows): every step drafts
exactly the tokens prompt lookup gets right, at most max_draft, and nothing when it gets none. A
ratio above it needs other drafts (the archive), cheaper rows or a model that copies more.
Not a test: shared, noisy machines; read ratios from one run.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import blas_env  # noqa: E402

blas_env.prefer_native_blas()

from benchlib import say  # noqa: E402  (bench/, the script's directory, is on sys.path)

MAX_TOKENS = 128

# ---- workload texts ------------------------------------------------------------------------------

_PLACES = ["Harbor Street", "the north wing", "Lakeview Park", "the old mill", "Station Road", "the east quay",
           "Maple Avenue", "the river bank", "Hill Court", "the market square"]
_THINGS = ["water pumps", "solar panels", "bicycle racks", "street lamps", "bus shelters", "heat pumps",
           "rain gardens", "charging points", "fibre cables", "tram rails"]
_PEOPLE = ["Maria Lopez", "Tom Becker", "Aiko Tanaka", "Samuel Osei", "Ingrid Holm", "Ravi Patel",
           "Chloe Martin", "Omar Haddad", "Lena Novak", "Peter Walsh"]


def document(rng: random.Random) -> list[str]:
    """Eighteen numbered sections of a city works report, ~80 tokens each."""
    sections = []
    for i in range(18):
        place, thing, person = rng.choice(_PLACES), rng.choice(_THINGS), rng.choice(_PEOPLE)
        n, cost, month = rng.randint(3, 90), rng.randint(12, 900), rng.choice(["March", "June", "October"])
        sections.append(
            f"Section {i + 1}. At {place}, the council installed {n} new {thing} in {month}. The work cost "
            f"{cost} thousand euros and was led by {person}, who said the project finished on time. "
            f"Residents asked for longer opening hours and better signs, and the team agreed to review "
            f"the {thing} again next year. A second phase near {rng.choice(_PLACES)} depends on funding.")
    return sections


CODE = '''def summarize_orders(orders, currency="EUR"):
    """Total, average and largest order per customer."""
    totals = {}
    counts = {}
    largest = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            amount = convert(amount, order["currency"], currency)
        totals[customer] = totals.get(customer, 0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        if amount > largest.get(customer, 0):
            largest[customer] = amount
    summary = []
    for customer, total in sorted(totals.items()):
        average = total / counts[customer]
        summary.append({"customer": customer, "total": round(total, 2),
                        "average": round(average, 2), "largest": largest[customer]})
    return summary
'''
_EDITS = ["Rename the variable `totals` to `sums`.", "Rename the parameter `orders` to `order_list`.",
          "Change the default currency to \"USD\".", "Rename `largest` to `biggest`.",
          "Round to 3 decimals instead of 2.", "Rename the function to `order_summary`.",
          "Rename `counts` to `tallies`.", "Rename `summary` to `rows`."]
_TOPICS = ["a dragon who is afraid of heights", "the first day at a new school", "a storm at sea",
           "a robot learning to paint", "a lost dog finding its way home", "a chef who cannot taste",
           "a city under snow", "two friends building a boat", "a clock that runs backwards"]
_JSON_NAMED = [(f"{first} {last}", age, city) for first, last, age, city in [
    ("Anna", "Berg", 34, "Oslo"), ("Luis", "Gomez", 51, "Madrid"), ("Mei", "Chen", 27, "Taipei"),
    ("John", "Smith", 45, "Leeds"), ("Fatima", "Ali", 39, "Cairo"), ("Nils", "Olsen", 62, "Bergen"),
    ("Sara", "Rossi", 23, "Turin"), ("Ken", "Ito", 58, "Osaka"), ("Eva", "Kral", 31, "Brno"),
    ("Tariq", "Khan", 44, "Lahore"), ("Ola", "Nowak", 29, "Gdansk"), ("Ben", "Cole", 36, "Austin"),
    ("Ines", "Silva", 48, "Porto"), ("Yuki", "Mori", 26, "Kyoto"), ("Paul", "Roy", 53, "Lyon"),
    ("Zoe", "Hart", 41, "Perth"), ("Ivan", "Petrov", 37, "Sofia"), ("Lara", "Diaz", 33, "Quito"),
    ("Omar", "Said", 57, "Tunis"), ("Emma", "Wood", 22, "Cork"), ("Raj", "Iyer", 49, "Pune"),
    ("Kim", "Park", 35, "Busan"), ("Hugo", "Lind", 60, "Malmo"), ("Ada", "Obi", 28, "Lagos")]]
_JSON_SYSTEM = ("You convert descriptions of people into JSON. Answer with one JSON object only, with the keys "
                "\"name\", \"age\", \"city\", \"occupation\" and \"hobbies\" (a list), in that order, nothing else.")
_JOBS = ["teacher", "nurse", "engineer", "baker", "pilot", "farmer", "lawyer", "painter"]
_HOBBIES = ["chess", "hiking", "cooking", "cycling", "reading", "gardening", "music", "fishing"]


def json_people(rng: random.Random, n: int) -> list[tuple[str, int, str]]:
    """n (name, age, city): the named ones first, then recombinations of them."""
    people = list(_JSON_NAMED[:n])
    firsts = [p[0].split()[0] for p in _JSON_NAMED]
    lasts = [p[0].split()[1] for p in _JSON_NAMED]
    cities = [p[2] for p in _JSON_NAMED]
    while len(people) < n:
        people.append((f"{rng.choice(firsts)} {rng.choice(lasts)}", rng.randint(20, 70), rng.choice(cities)))
    return people


def workloads(rng: random.Random, json_requests: int = 48) -> dict[str, list[list[dict]]]:
    """Workload → chat conversations (a list of messages each), as many as the most streams."""
    sections = document(rng)
    doc = "\n".join(sections)
    qa = [[{"role": "user", "content": f"{doc}\n\nQuote section {i} of the report above exactly, word for word."}]
          for i in rng.sample(range(1, 19), 8)]
    code = [[{"role": "user", "content": f"```python\n{CODE}```\n\n{edit} Reply with the whole changed function "
                                         "in a code block."}] for edit in _EDITS]
    free = [[{"role": "user", "content": f"Write a short story about {topic}."}] for topic in _TOPICS[:8]]
    json_convs = []
    for name, age, city in json_people(rng, json_requests):
        job, hobbies = rng.choice(_JOBS), rng.sample(_HOBBIES, 2)
        json_convs.append([{"role": "system", "content": _JSON_SYSTEM},
                              {"role": "user", "content": f"{name} is {age}, lives in {city}, works as a {job} and "
                                                          f"likes {hobbies[0]} and {hobbies[1]}."}])
    return {"qa": qa, "code": code, "free": free, "json": json_convs}


# ---- measuring -----------------------------------------------------------------------------------

@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    outputs: dict[str, list[int]] | None = None  # request id -> its generated tokens
    full_tokens: int = 0  # tokens and time of the decode steps in which every request was decoding
    full_seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def full_tok_s(self) -> float:
        return self.full_tokens / self.full_seconds if self.full_seconds else 0.0


def run_batch(engine, prompts: list[list[int]], stop_ids: tuple[int, ...], speculator, prefix,
              max_tokens: int | None = None) -> Result:
    """All prompts at once through one BatchGenerator; decode-only steps measured."""
    from shared.sampling import SamplingParams
    from worker.sched.generation import BatchGenerator, TokenEvent
    from worker.sched.tuning_state import SchedulerKnobs, TuningState

    generator = BatchGenerator(engine, TuningState(SchedulerKnobs(max_batch_size=8, batching_window_ms=0.0)),
                               prefix=prefix, blocks=prefix.block_manager, speculator=speculator)
    params = SamplingParams(max_tokens=max_tokens or MAX_TOKENS, temperature=0.0, stop_token_ids=stop_ids)
    for i, ids in enumerate(prompts):
        generator.add(f"r{i}", ids, params)
    before = vars(speculator.counters).copy() if speculator is not None else {}
    result = Result(outputs={f"r{i}": [] for i in range(len(prompts))})
    while generator.has_work:
        started = time.perf_counter()
        events = generator.step()
        seconds = time.perf_counter() - started
        for e in events:
            if isinstance(e, TokenEvent):
                result.outputs[e.request_id].append(e.token)
        step = generator.last_step
        if step.sequences and step.decode_rows == step.sequences:  # no prompt rows in this step
            emitted = sum(1 for e in events if isinstance(e, TokenEvent))
            result.tokens += emitted
            result.seconds += seconds
            if step.sequences == len(prompts):
                result.full_tokens += emitted
                result.full_seconds += seconds
    if speculator is not None:
        after = vars(speculator.counters)
        result.drafts = after["spec_drafts"] - before["spec_drafts"]
        result.drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
        result.accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return result


def lookup_bound(prompts: list[list[int]], outputs: list[list[int]], base: float, per_row: float,
                 max_draft: int) -> float:
    """on/off if every step drafted exactly what prompt lookup gets right (see the docstring):
    the sequences step together, as in the batch, each verifying its right draft tokens."""
    from worker.speculative.prompt_lookup import PromptLookup

    longest = max(map(len, outputs))
    off = sum(base + per_row * sum(1 for out in outputs if len(out) > s) for s in range(longest))
    seqs = [(list(prompt), out, PromptLookup()) for prompt, out in zip(prompts, outputs)]
    done = [0] * len(seqs)
    on = 0.0
    while any(d < len(out) for d, (_, out, _) in zip(done, seqs)):
        rows = 0
        for i, (tokens, out, lookup) in enumerate(seqs):
            if done[i] >= len(out):
                continue
            right = 0
            found = lookup.find(tokens)
            if found is not None:
                draft = lookup.read(tokens, found[0], max_draft)
                while right < len(draft) and done[i] + right < len(out) and draft[right] == out[done[i] + right]:
                    right += 1
            tokens.extend(out[done[i]:done[i] + right + 1])
            done[i] += right + 1
            rows += right + 1
        on += base + per_row * rows
    return off / on if on else 0.0


def main() -> None:
    global MAX_TOKENS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="+", default=["qa", "code", "json", "free"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fresh", action="store_true",
                        help="a new speculator for every run (default: one per workload and stream count, kept "
                             "across its runs as a worker keeps it; its gate then decides from the first run)")
    parser.add_argument("--json-requests", type=int, default=24, help="requests per json run (two runs)")
    parser.add_argument("--plot", default="bench-speculative-json.png",
                        help="the json workload's tok/s by request group (PNG); '' for none")
    args = parser.parse_args()
    MAX_TOKENS = args.max_tokens

    from threadpoolctl import threadpool_limits

    from worker.kv.block_manager import BlockManager
    from worker.kv.prefix_cache import PrefixCache
    from worker.speculative.speculator import Speculator

    _, engine, tok, template, stop_ids = load_chat_model(args.model, args.threads)
    texts = workloads(random.Random(7), 2 * args.json_requests)
    prompts = {name: [tok.encode(template.render(m, add_generation_prompt=True)) for m in convs]
               for name, convs in texts.items()}
    say(f"prompt tokens: " + ", ".join(f"{n} {len(p[0])}" for n, p in prompts.items()))
    blocks = BlockManager.for_pool(engine.kv)
    prefix = PrefixCache(blocks, b"bench-speculative")  # RAM only: shared documents prefill once
    series = {}  # streams -> (off Results, on Results) by json group, the restart after half of them
    rows = []  # (workload, streams, off Result list, on Result list)
    bounds = {}  # (workload, streams) -> lookup_bound
    with threadpool_limits(limits=args.threads, user_api="blas"):
        # Compile and warm: one short request each way.
        run_batch(engine, [prompts["free"][0][:40]], stop_ids, None, prefix, max_tokens=8)
        for name in args.workloads:
            for streams in args.streams:
                if name == "json":
                    json_out, series[streams] = json_rows(engine, prompts["json"], streams, stop_ids, prefix,
                                                          engine.gguf.fingerprint())
                    rows += json_out
                    continue
                batch = prompts[name][:streams]
                say(f"{name} x{streams}: prefilling the prompts into the prefix cache")
                run_batch(engine, batch, stop_ids, None, prefix, max_tokens=1)
                off, on = [], []
                speculator = Speculator(max_draft=8)
                for run in range(args.runs):
                    off.append(run_batch(engine, batch, stop_ids, None, prefix))
                    if args.fresh or run == 0:
                        speculator = Speculator(max_draft=8)
                    on.append(run_batch(engine, batch, stop_ids, speculator, prefix))
                    stats = speculator.stats()
                    say(f"{name} x{streams} run {run + 1}: off {off[-1].tok_s:.1f} tok/s, on {on[-1].tok_s:.1f} tok/s, "
                        f"{on[-1].drafts} drafts of {on[-1].drafted} tokens ({on[-1].accepted} accepted) over "
                        f"{on[-1].tokens} tokens; "
                        f"step fit base {1e3 * (stats['step_base_s'] or 0):.1f} ms + "
                        f"{1e3 * (stats['step_per_row_s'] or 0):.2f} ms/row, break-even {stats['break_even']:.2f}, "
                        f"switched off {stats['spec_switched_off']}, gate "
                        + ", ".join(f"{k[5:]} {v}" for k, v in stats.items() if k.startswith("gate_"))
                        + "; acceptance by agreement length "
                        + (", ".join(f"{low}+: {p:.0%}" for low, p in stats["agreement_acceptance"].items()) or "-"))
                rows.append((name, streams, off, on))
                fit = speculator.cost.fit()
                if fit is not None:
                    outputs = [off[-1].outputs[f"r{i}"] for i in range(len(batch))]
                    bounds[name, streams] = lookup_bound(batch, outputs, *fit, speculator.max_draft)
    print_table(rows, bounds, args)
    if series:
        print_series(series)
        if args.plot:
            plot_series(series, args.plot, args)


def load_chat_model(model: str, threads: int):
    """(path, engine, tokenizer, chat template, stop token ids) of a model by name, loaded as a
    worker loads it (context 2,048), with numba at `threads` threads."""
    import numba

    from gateway.chat_template import template_for
    from gateway.tokenizer import Tokenizer
    from shared.config import Config, EngineSection
    from shared.model_store import ensure_model
    from worker.engine.engine import load_engine

    path = ensure_model(model, Path("~/.cache/reame/models").expanduser())
    engine = load_engine(path, EngineSection(threads=threads, context_length=2048), progress=say)
    numba.set_num_threads(threads)
    tok = Tokenizer.from_gguf(path)
    template = template_for(tok, Config())
    stop_ids = tuple(sorted(set(template.stop_ids) | ({tok.eos_id} if tok.eos_id is not None else set())))
    return path, engine, tok, template, stop_ids


def json_rows(engine, prompts, streams, stop_ids, prefix, model_sha256):
    """Two runs of the json workload with a restart between, each group of `streams` requests
    off then on. The speculator is built as a worker builds it (build_speculator, an archive in
    a fresh directory) and shut down as a worker shuts down (save, then close the store)."""
    from shared.config import Config, override
    from worker.speculative.setup import build_speculator

    config = override(Config(), "speculative", archive_path=tempfile.mkdtemp(prefix="reame-spec-archive-"),
                      archive_budget="64MiB")
    half = len(prompts) // 2
    groups = [prompts[i:i + streams] for i in range(0, len(prompts), streams)]
    restart_at = half // streams
    off, on = [], []
    speculator, store = build_speculator(config, model_sha256)
    for g, group in enumerate(groups):
        if g == restart_at:
            speculator.save()
            store.close()
            say(f"json x{streams}: restart")
            speculator, store = build_speculator(config, model_sha256)
        off.append(run_batch(engine, group, stop_ids, None, prefix))
        on.append(run_batch(engine, group, stop_ids, speculator, prefix))
        say(f"json x{streams} group {g + 1}/{len(groups)}: off {off[-1].tok_s:.1f} tok/s, on {on[-1].tok_s:.1f} "
            f"tok/s ({on[-1].tok_s / off[-1].tok_s if off[-1].tok_s else 0:.2f}x), acceptance "
            f"{on[-1].accepted / on[-1].drafted if on[-1].drafted else 0:.0%}")
    speculator.save()
    store.close()
    warm = slice(max(1, restart_at // 2), restart_at)
    out = [("json-1", streams, off[:1], on[:1]), ("json-warm", streams, off[warm], on[warm]),
           ("json-restart-1", streams, off[restart_at:restart_at + 1], on[restart_at:restart_at + 1]),
           ("json-restart", streams, off[restart_at:], on[restart_at:])]
    return out, (off, on, restart_at)


def print_series(series) -> None:
    print("\njson workload by request group (a restart before the marked group)")
    print("| streams | group | off tok/s | on tok/s | on/off | acceptance |")
    print("|---|---|---|---|---|---|")
    for streams, (off, on, restart_at) in series.items():
        for g, (o, n) in enumerate(zip(off, on)):
            mark = " (restarted)" if g == restart_at else ""
            print(f"| {streams} | {g + 1}{mark} | {o.tok_s:.1f} | {n.tok_s:.1f} | "
                  f"{n.tok_s / o.tok_s if o.tok_s else 0:.2f}x | {n.accepted / n.drafted if n.drafted else 0:.0%} |")


def plot_series(series, path: str, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4), squeeze=False)
    for ax, (streams, (off, on, restart_at)) in zip(axes[0], series.items()):
        x = range(1, len(off) + 1)
        ax.plot(x, [r.tok_s for r in off], "o-", label="off")
        ax.plot(x, [r.tok_s for r in on], "o-", label="on")
        ax.axvline(restart_at + 0.5, color="grey", linestyle="--", label="restart")
        ax.set_title(f"json, {streams} stream{'s' if streams > 1 else ''}")
        ax.set_xlabel(f"request group ({streams} request{'s' if streams > 1 else ''} each)")
        ax.set_ylabel("decode tok/s")
        ax.legend()
    fig.suptitle(f"{args.model}, {args.threads} threads: speculative decoding across a restart")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    say(f"wrote {path}")


def print_table(rows, bounds, args) -> None:
    from worker.engine.kernels import matmul_i8
    isa = {"vnni": "AVX-512 VNNI", "avx2": "AVX2"}.get(matmul_i8.ISA, matmul_i8.ISA)
    load = os.getloadavg()[0]
    print(f"\n{args.model}, {args.threads} threads, {isa}, greedy, max_tokens {MAX_TOKENS}, medians of {args.runs} "
          f"runs, host load average {load:.1f}")
    print(f"| workload | streams | off tok/s | on tok/s | on/off | full batch on/off | lookup bound | acceptance "
          f"| mean draft | mean accepted | on = off |")
    print(f"|---|---|---|---|---|---|---|---|---|---|---|")
    for name, streams, off, on in rows:
        off_s = statistics.median(r.tok_s for r in off)
        on_s = statistics.median(r.tok_s for r in on)
        full_off = statistics.median(r.full_tok_s for r in off)
        full_on = statistics.median(r.full_tok_s for r in on)
        drafts = sum(r.drafts for r in on)
        drafted = sum(r.drafted for r in on)
        accepted = sum(r.accepted for r in on)
        bound = bounds.get((name, streams))
        # Greedy drafting must not change a token: on runs whose every output equals the off run's beside it.
        same = sum(o.outputs == f.outputs for o, f in zip(on, off))
        print(f"| {name} | {streams} | {off_s:.1f} | {on_s:.1f} | {on_s / off_s if off_s else 0:.2f}x | "
              f"{f'{full_on / full_off:.2f}x' if streams > 1 and full_off else '-'} | "
              f"{f'{bound:.2f}x' if bound else '-'} | "
              f"{accepted / drafted if drafted else 0:.0%} | {drafted / drafts if drafts else 0:.1f} | "
              f"{accepted / drafts if drafts else 0:.1f} | {same}/{len(on)} |")


if __name__ == "__main__":
    main()
