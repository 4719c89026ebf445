"""``kvshare sim`` as a user runs it: bad numbers refused, every phase shows progress, the
agentic format replayed natively, prompts that do not fit a worker reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from paths import TRACES

DYNAMO = TRACES / "dynamo_mooncake_trace_1000.jsonl"
AGENTIC = TRACES / "agentic"

pytestmark = pytest.mark.skipif(not DYNAMO.exists(), reason=f"trace {DYNAMO} not present")


def _sim(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvshare.cli", "sim", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args", [
    ("--host-tokens", "1e3000"), ("--host-tokens", "inf"), ("--disk-tokens", "nan"),
    ("--limit", "0"), ("--limit", "-5"), ("--block-tokens", "0"), ("--users", "0"),
    ("--gpu-cache-tokens", "-1"), ("--replicas", "0"), ("--jitter-ms", "-1"),
    ("--jitter-ms", "nan"),
])
def test_bad_numbers_are_refused_without_a_traceback(args: tuple[str, str]) -> None:
    proc = _sim(str(DYNAMO), *args, "--no-progress", timeout=60)
    assert proc.returncode == 2 and args[0] in proc.stderr and "Traceback" not in proc.stderr


def test_every_phase_ticks_and_the_plot_is_written(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    proc = _sim(str(DYNAMO), "--limit", "120", "--policy", "cost", "--workers", "4", "--plot",
                str(png), "--progress")
    assert proc.returncode == 0, proc.stderr
    for phase in ("load", "reference global_lru", "replay cost", "plot"):
        done = [line for line in proc.stderr.replace("\r", "\n").splitlines()
                if line.startswith(phase) and "100%" in line]
        assert done, f"no finished {phase!r} bar in {proc.stderr[-2000:]}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not AGENTIC.is_dir(), reason="agentic traces not present")
def test_agentic_files_replay_and_unfit_prompts_are_reported() -> None:
    files = [str(AGENTIC / f"trace_{n}.json") for n in ("0187", "0102", "0014")]
    proc = _sim(*files, "--block-tokens", "512", "--policy", "cost", "--workers", "4",
                "--gpu-gb", "160", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    cost = json.loads(proc.stdout.strip().splitlines()[-1])["policies"]["cost"]
    # 160 GB less 138 GB of Llama-2-70B weights holds 67,138 tokens of KV: longer prompts of
    # these conversations are reported, not replayed
    assert cost["unfit"] > 0 and cost["requests"] > 0
    assert "exceed the 67,138 tokens" in proc.stderr
    assert cost["hit_rate"] > 0.5  # conversations reuse their own prefix turn after turn


def test_engines_prefix_caches_can_be_sized_or_left_out() -> None:
    """By default each engine keeps what it computed or loaded (reused from its gpu tier);
    ``--gpu-cache-tokens 0`` models engines without a prefix cache of their own."""
    gpu = {}
    for value in ("0", None):
        extra = ("--gpu-cache-tokens", value) if value is not None else ()
        proc = _sim(str(DYNAMO), "--limit", "150", "--policy", "cost", "--workers", "4",
                    "--json", "--no-progress", *extra)
        assert proc.returncode == 0, proc.stderr
        gpu[value] = json.loads(proc.stdout.strip().splitlines()[-1])["policies"]["cost"]["hit_gpu"]
    assert gpu["0"] == 0 and gpu[None] > 0


def test_replicas_show_each_policys_spread_and_which_gaps_are_noise() -> None:
    proc = _sim(str(DYNAMO), "--limit", "300", "--workers", "6", "--replicas", "3", "--json",
                "--no-progress")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    reps = out["replicas"]
    assert reps["count"] == 3 and reps["jitter_ms"] == 0.5
    for name, fig in out["policies"].items():  # replica 0 is the replay the main table shows
        assert len(reps["ttft_mean_s"][name]) == 3 and len(reps["ttft_p99_s"][name]) == 3
        assert reps["ttft_mean_s"][name][0] == fig["ttft_mean_s"]
        assert reps["ttft_p99_s"][name][0] == fig["ttft_p99_s"]
        assert f"| {name} | " in proc.stdout
    assert "replicas: 3 (replica 0: the trace as it is; 1-2: each arrival moved within +-0.5 ms)" in proc.stdout
    assert len(set(reps["ttft_mean_s"]["cost"])) > 1  # the replicas are different replays
    table = proc.stdout.split("replicas: 3", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(out["policies"])
    for col in (2, 4):  # mean and p99: one best each, the others a gap (noise or not)
        marks = [r[col].strip(" |") for r in rows]
        assert marks.count("best") == 1 and all(m == "best" or m.startswith("+") for m in marks)
