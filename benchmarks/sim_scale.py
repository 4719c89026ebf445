"""``kvshare sim --policy cost`` on a big trace: peak memory and CPU against the replay itself.

Builds a trace of ``--copies`` back-to-back copies of the public synthetic Mooncake trace
(each copy's ids shifted past the previous copy's, its timestamps after the previous copy's
end) under ``--tmp`` (never in the repository), runs the CLI under ``/usr/bin/time -v`` and
reports peak RSS and the ratio of the whole run's CPU time to the replay's own CPU time (the
baseline, measured in the same run). 172 copies = 686,796 requests, ~200 MB of JSONL.
Targets (issue 12): peak < 1.5 GB, CPU < 3x the replay's.

    python benchmarks/sim_scale.py --copies 172
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

SYNTH = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=172)
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()
    trace = Path(args.tmp) / f"kvshare_synthetic_x{args.copies}.jsonl"
    n = build(args.copies, trace)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "kvshare.cli", "sim", str(trace),
           "--policy", "cost", "--json", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    trace.unlink()
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))  # type: ignore[union-attr]
    user = float(re.search(r"User time \(seconds\): ([\d.]+)", proc.stderr).group(1))  # type: ignore[union-attr]
    system = float(re.search(r"System time \(seconds\): ([\d.]+)", proc.stderr).group(1))  # type: ignore[union-attr]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = out["cpu_s"]
    replay = cpu["replay cost"]
    print("\n".join(proc.stdout.strip().splitlines()[1:-1]))
    print(f"requests {n:,}  peak RSS {peak_kb / 1e6:.2f} GB  process CPU {user + system:.0f} s  "
          f"replay CPU {replay:.0f} s (load {cpu['load']:.0f} s, reference {cpu['reference']:.0f} s)"
          f"  ratio {(user + system) / replay:.2f}x")
    print(json.dumps({"benchmark": "sim_scale", "requests": n, "peak_rss_gb": peak_kb / 1e6,
                      "cpu_s": user + system, "replay_cpu_s": replay,
                      "cpu_vs_replay": (user + system) / replay,
                      "hit_rate": out["policies"]["cost"]["hit_rate"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
