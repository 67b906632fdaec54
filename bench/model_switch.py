"""The cost of switching models behind one front (issue 38): for each model, a streamed short chat
(a fixed prompt, greedy, 16 tokens) through `gateway.model_front`

- cold:   the first request after the front starts, the model's file dropped from the page cache
          first (posix_fadvise DONTNEED; `fincore` says how much stayed resident: pages another
          process maps stay);
- warm:   the first request after an unload (/admin/models), the file still in the page cache;
- loaded: a request to the model loaded and idle;

with the time to first token and to the last, medians over --reps, and the front's own "loaded in"
time. Then an alternating run (every model in turn, --rounds times, under a budget that holds only
one of them) samples the resident memory of every process of the front every 50 ms and prints the
peak beside the budget, which counts each loaded model's measured RSS, at least its estimate
(gateway.model_backends.estimate_bytes).

    python bench/model_switch.py [--models smol,gemma,qwen] [--reps 3] [--rounds 3] [--png switch.png]

Numba's kernel cache is used as it is (the script says whether it held this engine version's
kernels before it started); one unmeasured start per model first compiles what is missing and
saves the model's kernel table, so no measured load calibrates. Prefix cache and speculation are
off: a repeated prompt would otherwise reuse its K/V and drafts, and the "loaded" request would
measure the cache. Each model's worker gets a 512 MiB KV pool (SmolLM2 needs 377 MiB for 8192
tokens) and [engine]'s other defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

from benchlib import say  # bench/, the script's directory, is on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests import harness  # noqa: E402

MODELS_DIR = Path(os.environ.get("REAME_TEST_MODELS", "~/.cache/reame/models")).expanduser()
MODELS = {"smol": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma": "gemma-3-270m-q4_k_m.gguf",
          "qwen": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}
PROMPT = "Name three colours."
MAX_TOKENS = 16
KV_POOL = "512MiB"
MIB = 2**20
SAMPLE_S = 0.05


def host() -> str:
    text = Path("/proc/cpuinfo").read_text()
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = set(re.search(r"^flags\s*:\s*(.+)$", text, re.M).group(1).split())
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags)
    return f"{name.group(1) if name else 'unknown CPU'}, {os.cpu_count()} CPUs, {isa or 'no AVX2'}"


def numba_cache() -> str:
    """The kernel cache directory this engine version's workers use (named by its sources' digest)."""
    return subprocess.run([sys.executable, "-c", "import os, worker.engine; print(os.environ['NUMBA_CACHE_DIR'])"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def cached_kernels(directory: str) -> int:
    """Compiled kernel signatures in numba's cache (its .nbc files): growth means a run compiled."""
    return sum(1 for _ in Path(directory).rglob("*.nbc")) if Path(directory).is_dir() else 0


def evict(path: Path) -> int:
    """Drop the file's pages from the page cache; the bytes that stayed resident (fincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, check=True).stdout.strip()
        return int(out)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return -1


def write_config(directory: Path, port: int, names: list[str], budget: str) -> Path:
    serve = "".join(f"\n    {name} = {MODELS_DIR / MODELS[name]}" for name in names)
    return harness.write_config(directory, MODELS_DIR / MODELS[names[0]], port, {
        "engine": {"kv_cache_memory": KV_POOL},
        "prefix_cache": {"enabled": "false"},
        "speculative": {"enabled": "off"},
        # "" = each model's own <state_dir>/models/NAME/tuning, kept across this run's fronts
        "tuning": {"state_path": ""},
        "models": {"serve": serve, "memory_budget": budget, "load_timeout": 900, "keep_alive": 3600},
    })


def start_front(directory: Path, config: Path, port: int) -> harness.Server:
    argv = [sys.executable, "-m", "gateway.model_front", "--config", str(config)]
    return harness.start_server("front", directory, port, {"front": argv}, workers=0)


def chat(url: str, model: str) -> tuple[float, float]:
    """(seconds to the first content token, seconds to the end) of one streamed greedy chat."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = time.perf_counter() - started
    return first if first is not None else float("nan"), time.perf_counter() - started


def unload(url: str, model: str) -> None:
    for _ in range(50):  # 409 while the request just answered is still counted as running
        r = requests.post(url + "/admin/models", json={"model": model, "action": "unload"}, timeout=120)
        if r.status_code != 409:
            break
        time.sleep(0.1)
    r.raise_for_status()


def load_time(server: harness.Server, model: str) -> float:
    """The front's last "model NAME: loaded in S s" for `model`."""
    found = re.findall(rf"model {model}: loaded in ([\d.]+) s", server.log("front"))
    return float(found[-1]) if found else float("nan")


def measure(directory: Path, config: Path, port: int, model: str, reps: int) -> dict[str, list]:
    """Per rep: a fresh front's first request (file evicted), an unload and a request, one more."""
    out: dict[str, list] = {"cold": [], "cold_load": [], "resident": [], "warm": [], "warm_load": [], "loaded": []}
    for rep in range(reps):
        out["resident"].append(evict(MODELS_DIR / MODELS[model]))
        with start_front(directory, config, port) as server:
            out["cold"].append(chat(server.url, model))
            out["cold_load"].append(load_time(server, model))
            unload(server.url, model)
            out["warm"].append(chat(server.url, model))
            out["warm_load"].append(load_time(server, model))
            out["loaded"].append(chat(server.url, model))
        say(f"  {model} rep {rep + 1}, TTFT / total: " + ", ".join(
            f"{kind} {out[kind][-1][0]:.2f} / {out[kind][-1][1]:.2f} s" for kind in ("cold", "warm", "loaded")))
    return out


class PeakMemory:
    """Samples the summed RSS of a process and all its descendants every SAMPLE_S in a thread."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak, self.peak_worker, self.samples = 0, 0, 0
        self.at_peak: dict[str, int] = {}
        self.per_model: dict[str, int] = {}  # model file name → its worker's peak RSS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            roles: dict[str, int] = {}
            for process in [self.root, *self.root.children(recursive=True)]:
                try:
                    cmd = process.cmdline()
                    rss = process.memory_info().rss
                except psutil.Error:
                    continue
                role = cmd[2] if len(cmd) > 2 and cmd[1] == "-m" else "helpers"
                roles[role] = roles.get(role, 0) + rss
                if role == "worker.main":
                    model = Path(cmd[cmd.index("--model") + 1]).name
                    self.per_model[model] = max(self.per_model.get(model, 0), rss)
            total = sum(roles.values())
            self.samples += 1
            self.peak_worker = max(self.peak_worker, roles.get("worker.main", 0))
            if total > self.peak:
                self.peak, self.at_peak = total, roles
            self._stop.wait(SAMPLE_S)


def alternate(directory: Path, names: list[str], rounds: int, budget_mib: int) -> dict:
    port = harness.free_port()
    config = write_config(directory, port, names, f"{budget_mib}MiB")
    switches, estimates = [], {}
    with start_front(directory, config, port) as server, PeakMemory(server.processes[0].pid) as memory:
        for _ in range(rounds):
            for name in names:
                switches.append(chat(server.url, name)[0])
                state = requests.get(server.url + "/admin/models", timeout=10).json()
                loaded = [m["id"] for m in state["models"] if m["state"] == "loaded"]
                estimates.update({m["id"]: m["size"] for m in state["models"] if m["state"] == "loaded"})
                say(f"  alternating: {name} answered, loaded {loaded}, {state['used'] / MIB:.0f} MiB of "
                    f"{state['budget'] / MIB:.0f} MiB")
    return {"peak": memory.peak, "peak_worker": memory.peak_worker, "at_peak": memory.at_peak,
            "samples": memory.samples, "switches": switches, "budget": budget_mib * MIB, "estimates": estimates,
            "per_model": {name: memory.per_model.get(MODELS[name], 0) for name in names}}


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [("cold", "cold load"), ("warm", "warm re-load"), ("loaded", "loaded")]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(kinds)
    for i, (kind, label) in enumerate(kinds):
        values = [statistics.median(t for t, _ in results[m][kind]) for m in results]
        ax.bar([x + i * width for x in range(len(results))], values, width, label=label)
    ax.set_xticks([x + width for x in range(len(results))], list(results))
    ax.set_ylabel("time to first token, s (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Switching models behind one front")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smol,gemma", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds for the memory peak")
    parser.add_argument("--budget-mib", type=int, default=2200, help="the alternating run's memory budget")
    parser.add_argument("--png", type=Path, help="also plot the medians to this file")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep it (logs, state); "
                        "default: a temporary one")
    args = parser.parse_args()
    names = args.models.split(",")
    for name in names:
        if name not in MODELS or not (MODELS_DIR / MODELS[name]).is_file():
            parser.error(f"no model {name!r} under {MODELS_DIR}")

    cache_dir = numba_cache()
    cached_before = cached_kernels(cache_dir)
    say(f"host: {host()}; numba cache {cache_dir}: {cached_before} compiled kernels")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="reame-switch-") as tmp:
        directory = args.keep or Path(tmp)
        for name in names:
            port = harness.free_port()
            config = write_config(directory / name, port, [name], "90%")
            say(f"{name}: an unmeasured first start (compiles missing kernels, saves the kernel table)")
            with start_front(directory / name, config, port) as server:
                chat(server.url, name)
            results[name] = measure(directory / name, config, port, name, args.reps)
        say("alternating run")
        memory = alternate(directory / "alternate", names, args.rounds, args.budget_mib)

    print(f"\nhost: {host()}; load average {os.getloadavg()[0]:.1f}")
    cached_after = cached_kernels(cache_dir)
    print(f"numba kernel cache ({cache_dir}): {cached_before} compiled kernels before the run, {cached_after} "
          f"after: " + ("warm, nothing compiled" if cached_after == cached_before else
                        "it compiled some, so some loads or requests include compiling"))
    print(f"prompt {PROMPT!r}, {MAX_TOKENS} tokens greedy, streamed; medians of {args.reps}; seconds\n")
    print("| model | file MiB | cold: load / TTFT / total | file resident before cold | "
          "warm re-load: load / TTFT / total | loaded: TTFT / total |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        def med(kind: str, i: int | None = None) -> float:
            return statistics.median(v[i] if i is not None else v for v in r[kind])
        size = (MODELS_DIR / MODELS[name]).stat().st_size / MIB
        print(f"| {name} | {size:.0f} | {med('cold_load'):.2f} / {med('cold', 0):.2f} / {med('cold', 1):.2f} | "
              f"{max(r['resident']) / MIB:.0f} MiB | {med('warm_load'):.2f} / {med('warm', 0):.2f} / "
              f"{med('warm', 1):.2f} | {med('loaded', 0):.3f} / {med('loaded', 1):.3f} |")
    at_peak = ", ".join(f"{role} {rss / MIB:.0f}" for role, rss in sorted(memory["at_peak"].items()))
    print(f"\nalternating {','.join(names)} x {args.rounds} under a {memory['budget'] / MIB:.0f} MiB budget "
          f"({len(memory['switches'])} requests, each a switch; median TTFT {statistics.median(memory['switches']):.2f} s): "
          f"peak RSS of all the front's processes {memory['peak'] / MIB:.0f} MiB ({at_peak} MiB at the peak); "
          f"peak worker RSS {memory['peak_worker'] / MIB:.0f} MiB; {memory['samples']} samples\n")
    print("| model | the budget counts (measured RSS, at least the estimate), MiB | its worker's peak RSS, MiB |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {memory['estimates'].get(name, 0) / MIB:.0f} | {memory['per_model'][name] / MIB:.0f} |")
    if args.png:
        plot(results, args.png)
        say(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
