"""The emulated multi-node cluster the demo and benchmarks start (:mod:`kvshare.actors.local_cluster`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from paths import ROOT

SCRIPT = """
import json, os, ray
from kvshare.actors.local_cluster import local_cluster
with local_cluster(1, node_cpus=1, head_store_mib=80, node_store_mib=80) as cluster:
    print(json.dumps({"node_0": ray.cluster_resources().get("node_0", 0),
                      "nodes": len([n for n in ray.nodes() if n["Alive"]])}))
"""


def test_a_machine_that_never_ran_ray_starts_the_local_cluster(tmp_path: Path) -> None:
    """`make demo` on a fresh machine: Ray's default temp folder (/tmp/ray, here under a fresh
    RAY_TMPDIR) does not exist yet, and Ray's Cluster writes the head's address there."""
    ray_tmp = tmp_path / "fresh"
    ray_tmp.mkdir()
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '{"node_0": 1.0, "nodes": 2}'
    assert (ray_tmp / "ray").is_dir()  # where Ray recorded the address (removed at shutdown)
