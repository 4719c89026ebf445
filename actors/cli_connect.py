"""Joining the Ray cluster from a ``kvshare`` command: the address given, a running local
cluster, or (``kvshare up`` only) a local one started for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def _ray_env() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def connect_from_cli(address: str | None, ray_namespace: str, start: bool) -> None:
    """Connect this process to Ray at ``address`` (or the running local cluster); ``start``:
    start a local head when none runs, else ValueError naming the fix."""
    _ray_env()
    from kvshare.actors.deploy import connect

    def start_local() -> None:
        if not start:
            raise ValueError("no running Ray cluster found: pass --address or run `kvshare up`")
        ray_bin = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
        print("no Ray cluster is running: starting a local one (`ray stop` ends it)", file=sys.stderr)
        subprocess.run([ray_bin, "start", "--head", "--disable-usage-stats"], check=True,
                       stdout=subprocess.DEVNULL)

    connect(address, ray_namespace, start_local)
