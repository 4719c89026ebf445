"""``kvshare sim --policy cost`` on a big trace: peak memory and CPU against the replay itself.

Builds a trace of ``--copies`` back-to-back copies of the public synthetic Mooncake trace
(each copy's ids shifted past the previous copy's, its timestamps after the previous copy's
end) under ``--tmp`` (never in the repository), runs the CLI under ``/usr/bin/time -v`` and
reports peak RSS and the ratio of the whole run's CPU time to the replay's own CPU time (the
baseline, measured in the same run). 172 copies = 686,796 requests, ~200 MB of JSONL.
Targets (issue 12): peak < 1.5 GB, CPU < 3x the replay's.

``--before REV`` also runs the same trace through the code of git revision ``REV`` (exported
under ``--tmp``, with this checkout's compiled extensions) first, so a change's before and
after are measured in one run.

    python benchmarks/sim_scale.py --copies 172
    python benchmarks/sim_scale.py --copies 40 --before main
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SYNTH = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def build(copies: int, out: Path) -> int:
    rows = [json.loads(line) for line in SYNTH.read_text().splitlines() if line.strip()]
    id_span = 1 + max(max(r["hash_ids"]) for r in rows)
    t_span = 1000 + max(r["timestamp"] for r in rows)
    with open(out, "w", encoding="utf-8") as f:
        for c in range(copies):
            for r in rows:
                f.write(json.dumps({
                    "timestamp": r["timestamp"] + c * t_span, "input_length": r["input_length"],
                    "output_length": r["output_length"],
                    "hash_ids": [x + c * id_span for x in r["hash_ids"]],
                }) + "\n")
    return copies * len(rows)


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` under ``into``, with this checkout's compiled extensions."""
    tree = into / "src"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    for so in (REPO / "kvshare").glob("*.so"):
        shutil.copy2(so, tree / "kvshare" / so.name)
    return tree


def measure(trace: Path, cwd: Path) -> dict[str, Any]:
    """``kvshare sim --policy cost`` on ``trace`` with the code under ``cwd``: peak RSS, CPU."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "kvshare.cli", "sim", str(trace),
           "--policy", "cost", "--json", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(1)

    def field(pattern: str) -> float:
        found = re.search(pattern, proc.stderr)
        assert found is not None, pattern
        return float(found.group(1))

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = field(r"User time \(seconds\): ([\d.]+)") + field(r"System time \(seconds\): ([\d.]+)")
    return {"table": "\n".join(proc.stdout.strip().splitlines()[:-1]), "phases": out["cpu_s"],
            "peak_rss_gb": field(r"Maximum resident set size \(kbytes\): (\d+)") / 1e6,
            "cpu_s": cpu, "replay_cpu_s": out["cpu_s"]["replay cost"],
            "hit_rate": out["policies"]["cost"]["hit_rate"]}


def line(name: str, n: int, r: dict[str, Any]) -> str:
    ph = r["phases"]
    return (f"{name}: requests {n:,}  peak RSS {r['peak_rss_gb']:.2f} GB  process CPU "
            f"{r['cpu_s']:.0f} s  replay CPU {r['replay_cpu_s']:.0f} s (load {ph['load']:.0f} s, "
            f"reference {ph['reference']:.0f} s)  ratio {r['cpu_s'] / r['replay_cpu_s']:.2f}x  "
            f"hit {r['hit_rate']:.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=172)
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--before", metavar="REV", help="also measure git revision REV, first")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        trace = Path(d) / f"kvshare_synthetic_x{args.copies}.jsonl"
        n = build(args.copies, trace)
        before = measure(trace, export(args.before, Path(d))) if args.before else None
        after = measure(trace, REPO)
    print(after["table"])
    if before is not None:
        print(line(f"before ({args.before})", n, before))
    print(line("after (this checkout)", n, after))
    summary: dict[str, Any] = {
        "benchmark": "sim_scale", "requests": n, "peak_rss_gb": after["peak_rss_gb"],
        "cpu_s": after["cpu_s"], "replay_cpu_s": after["replay_cpu_s"],
        "cpu_vs_replay": after["cpu_s"] / after["replay_cpu_s"], "hit_rate": after["hit_rate"],
    }
    if before is not None:
        summary |= {"before": args.before, "before_peak_rss_gb": before["peak_rss_gb"],
                    "before_cpu_s": before["cpu_s"], "before_hit_rate": before["hit_rate"],
                    "peak_rss_vs_before": after["peak_rss_gb"] / before["peak_rss_gb"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
