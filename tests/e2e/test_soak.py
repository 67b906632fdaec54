"""The soak of bench/soak.py in its short form: 4 streaming clients for 30 s against `reame serve`.

No request lost (each ends with a finish_reason) and every process's RSS flat after a 10 s
warm-up; the full run (16 clients, 30 minutes) is `python bench/soak.py`.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import REPO


def test_short_soak(smollm2_gguf, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "bench/soak.py", "--model", str(smollm2_gguf), "--clients", "4",
                          "--duration", "30", "--sample", "5", "--warmup", "10", "--workers", "1",
                          "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] >= 8 and report["errors"] == 0 and report["rss_flat"] and not report["server_problems"]
    assert {name.split("/")[0] for name in report["rss_end"]} == {"serve", "gateway", "worker"}
