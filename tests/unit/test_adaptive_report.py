"""The adaptive report on a synthetic history: its exact shape, deltas against boot, the plateau
statement, and lines in the log at the configured interval."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import deque

from gateway.coordinator.coordinator import Decision
from gateway.coordinator.report import AdaptiveReport, Sample
from gateway.coordinator.service import TuningService
from tests.fakes import fake_config
from tests.unit.test_coordinator import profile

BOOT_WALL = 1_000_000.0


def history_of(report: AdaptiveReport, minutes: int, slow_minutes: int = 1) -> None:
    """One 5-second profile of one worker at a time: 100 tok/s, p95 400 ms, hit-rate 0.40 for
    `slow_minutes`, then 150 tok/s, 300 ms, 0.70."""
    for i in range(1, minutes * 12 + 1):
        slow = i <= slow_minutes * 12
        report.add(profile(output_tokens=500 if slow else 750, latency_ms_p95=400 if slow else 300, finished=10,
                           prefix_query_tokens=1000, prefix_hit_tokens=400 if slow else 700,
                           sources={"kernels": {"gemm": "q4_1_i8_avx2"}}), now=5.0 * i)


def test_report_lines_have_the_issues_shape_and_deltas_against_boot():
    report = AdaptiveReport(boot=0.0, window_s=60.0)
    history_of(report, minutes=30)
    lines = report.lines(1800.0, [], BOOT_WALL)
    assert lines[:5] == [
        "[reame] adaptive report @ 30m",
        "  prefix cache hit-rate: 0.70 (+0.30 vs boot)",
        "  chosen gemm kernel:   q4_1_i8_avx2",
        "  effective throughput: 150.0 tok/s (+50% vs boot)",
        "  p95 latency:          300 ms (-25% vs boot)",
    ]
    assert lines[5].startswith("  strategy:             0 changes, 0 reverted; converged:")


def test_each_learned_choice_is_reported_as_its_own_ab_against_the_shipped_default():
    report = AdaptiveReport(boot=0.0, window_s=60.0)
    assert report.lines(30.0, [], BOOT_WALL)[-1] == "    nothing measured yet: every layer runs its shipped default"
    kernels = {"gemm": "1:int8_serialx1t", "ab 1 choice": "int8_serialx1t", "ab 1 default": "int8x2t",
               "ab 1 gain": 0.41, "ab 1 noise": 0.03, "ab 1 steps": 12.0}
    speculative = {"gate_1+": "on", "gate_1+_gain": 0.18, "gate_1+_noise": 0.06, "gate_1+_steps": 48.0,
                   "gate_8+": "off", "gate_8+_gain": -0.2, "gate_8+_noise": 0.05, "gate_8+_steps": 48.0}
    report.add(profile(sources={"kernels": kernels, "speculative": speculative}), now=5.0)
    kept = Decision(3, "h/node0/cpus0-1", BOOT_WALL + 60.0, "change", "short requests", "...", {}, {},
                    goal="tokens per busy second", effect={"change": 0.04, "noise": 0.05}, outcome="kept")
    reverted = Decision(5, "h/node0/cpus0-1", BOOT_WALL + 90.0, "change", "long prompts", "...", {}, {},
                        goal="prefill step ms", effect={"change": 0.30, "noise": 0.06}, outcome="reverted")
    lines = report.lines(120.0, [kept, reverted], BOOT_WALL)
    assert lines[-5:] == [
        "  what each learned choice is worth (its own A/B on this traffic, ± one standard error):",
        "    kernels, 1 rows a step: int8_serialx1t vs shipped int8x2t (time per row): +41% ±3% (12 paired steps)",
        # drafting off in 8+ is the default's choice: nothing learned to weigh
        "    drafting, 1+ sequences a step: on (tokens/s drafting vs plain decoding): +18% ±6% (48 steps)",
        "    knobs, v3 short requests on h/node0/cpus0-1 (tokens per busy second): +4% ±5% "
        "(profiles before vs after; kept; within the noise)",
        # a step time 30% longer is a loss: the sign says better or worse, not up or down
        "    knobs, v5 long prompts on h/node0/cpus0-1 (prefill step ms): -30% ±6% (profiles before vs after; reverted)",
    ]
    worth = report.as_json(120.0, [kept, reverted], BOOT_WALL)["worth"]
    assert [w["within_noise"] for w in worth] == [False, False, True, False]


def test_the_report_says_when_it_is_still_learning():
    report = AdaptiveReport(boot=0.0, window_s=60.0)
    history_of(report, minutes=10)
    change = Decision(3, "h/node0/cpus0-1", BOOT_WALL + 590.0, "change", "short requests", "...", {}, {},
                      outcome="kept")
    lines = report.lines(600.0, [change], BOOT_WALL)
    assert lines[5] == "  strategy:             1 changes, 0 reverted; still learning (1 changes in the last 3m)"
    early = AdaptiveReport(boot=0.0, window_s=60.0)
    history_of(early, minutes=1)
    assert early.lines(60.0, [], BOOT_WALL)[3] == "  effective throughput: 100.0 tok/s (+0% vs boot)"
    assert "too little traffic" in early.lines(60.0, [], BOOT_WALL)[5]
    idle = AdaptiveReport(boot=0.0, window_s=60.0)
    assert idle.lines(30.0, [], BOOT_WALL)[1] == "  prefix cache hit-rate: 0.00 (n/a vs boot)"


def minutes_at(report: AdaptiveReport, rates: list[float]) -> float:
    """Minute m at rates[m] tok/s (12 five-second profiles a minute); returns the time after them."""
    for m, rate in enumerate(rates):
        for i in range(1, 13):
            report.add(profile(output_tokens=round(5 * rate), finished=10, latency_ms_p95=300), now=60.0 * m + 5.0 * i)
    return 60.0 * len(rates)


def plateau_of(rates: list[float]) -> tuple[bool, str]:
    report = AdaptiveReport(boot=0.0, window_s=60.0)
    return report.plateau(minutes_at(report, rates), [], BOOT_WALL)


def test_a_load_that_varies_without_a_trend_is_a_plateau():
    # bench/agentic.py's adaptive run, minutes 1-10 (2-8 clients by design): ±9-12% minute to minute.
    converged, why = plateau_of([171.0, 194.6, 179.6, 201.2, 207.2, 183.1, 195.3, 164.6, 186.7, 202.6])
    assert converged, why
    assert why.startswith("converged: no strategy change and throughput 184.7 tok/s over the last 3m vs 195.2 "
                          "the 3m before (-5%; windows vary ±8%)"), why


def test_a_trend_or_a_step_is_not_a_plateau():
    rising = [100.0 * 1.04 ** m for m in range(10)]  # +4% a minute: +12% from one 3 minutes to the next
    assert plateau_of(rising) == (False, "still moving: throughput 136.9 tok/s over the last 3m vs 121.7 the 3m "
                                         "before (+12%; windows vary ±4%)")
    step = [100.0, 101.0, 99.0, 100.0, 101.0, 99.0, 100.0, 108.0, 107.0, 108.0]  # +8% in the last 3 minutes
    converged, why = plateau_of(step)
    assert not converged and why.startswith("still moving"), why
    # The same +8% inside windows that vary by ±14% is within their noise: no trend shown.
    varying = [100.0, 115.0, 85.0, 100.0, 115.0, 85.0, 100.0, 124.0, 100.0, 100.0]
    converged, why = plateau_of(varying)
    assert converged and "(+8%; windows vary ±14%)" in why, why


def test_windows_too_noisy_to_judge_claim_no_plateau():
    noisy = [100.0, 140.0, 60.0, 100.0, 140.0, 60.0, 100.0, 150.0, 74.0, 100.0]
    assert plateau_of(noisy) == (False, "too noisy to tell: throughput 108.0 tok/s over the last 3m vs 100.0 the "
                                        "3m before (+8%; windows vary ±39%)")
    # A change under PLATEAU_SPREAD is flat however noisy.
    assert plateau_of([100.0, 140.0, 60.0, 100.0, 140.0, 60.0, 100.0, 141.0, 62.0, 100.0])[0]


def test_report_lines_reach_the_log_at_the_configured_interval(tmp_path, caplog):
    config = fake_config(tmp_path, f"[tuning]\nreport_interval = 0.2\nstate_path = {tmp_path}\n")

    class Pool:
        on_profile = on_register = None

    async def run() -> None:
        service = TuningService(config, Pool())
        service.start()
        await asyncio.sleep(0.5)
        await service.close()

    with caplog.at_level(logging.INFO, logger="reame.coordinator"):
        asyncio.run(run())
    headers = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[reame] adaptive report @ ")]
    assert len(headers) == 2  # at 0.2 s and 0.4 s


class _CountedSample(Sample):
    """A Sample that counts how often its arrival time is read: the work a series does."""
    reads = 0

    def __getattribute__(self, name):
        if name == "at":
            _CountedSample.reads += 1
        return super().__getattribute__(name)


def test_a_series_reads_each_sample_a_few_times_not_once_per_bucket():
    """Issue 41: /admin/series summed every sample for every bucket, 4.25 s per call at the cap
    (2000 buckets x 100,000 samples) on the gateway's event loop."""
    report = AdaptiveReport(boot=0.0, window_s=60.0)
    history_of(report, minutes=20)  # 240 samples over 1200 s
    expected = report.series(1200.0, 1.0)
    report.samples = deque(_CountedSample(*dataclasses.astuple(s)) for s in report.samples)
    _CountedSample.reads = 0
    points = report.series(1200.0, 1.0)
    assert len(points) == 1201 and points == expected
    assert [p.throughput for p in points if p.throughput] == [500.0] * 12 + [750.0] * 228  # one sample a bucket
    assert _CountedSample.reads <= 20 * len(report.samples)  # a full scan per bucket: 1201 each


def test_the_series_and_an_import_are_worked_out_off_the_event_loop(tmp_path):
    config = fake_config(tmp_path, f"[tuning]\nstate_path = {tmp_path}\n")

    class Pool:
        on_profile = on_register = None

        def send_strategy(self, worker_id, strategy):
            return True

    threads: dict[str, str] = {}

    async def run() -> None:
        service = TuningService(config, Pool())
        series, check_import = service.report.series, service.coordinator.check_import

        def spy(name, fn):
            def called(*args):
                threads[name] = threading.current_thread().name
                return fn(*args)
            return called
        service.report.series = spy("series", series)
        service.coordinator.check_import = spy("import", check_import)
        service.on_profile(profile(worker_id="h/node0/1", cpus=[0]))
        assert (await service.call("series", 5.0))["bucket_s"] == 5.0
        knobs = service.coordinator.defaults.as_dict()
        assert (await service.call("import", {"workers": {"*": {"knobs": knobs}}}))["frozen"] is True
        threads["loop"] = threading.current_thread().name

    asyncio.run(run())
    assert threads["series"] != threads["loop"] and threads["import"] != threads["loop"]
