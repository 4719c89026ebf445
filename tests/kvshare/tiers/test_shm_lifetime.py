"""Shared-memory slabs outlive a killed owner only until the next pool start cleans them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvshare.tiers.host import SHM_DIR, HostSlab, remove_orphan_segments, remove_stale_segments

_CHILD = """
import sys, time
from kvshare.tiers.host import HostSlab
slab = HostSlab(4096, 4, sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def _spawn_owner(name: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, name], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_killed_owners_slab_is_removed_and_a_live_one_is_kept() -> None:
    pid = os.getpid()
    dead, live, mine = (f"kvshare-lifetime-t{pid}-{i}" for i in range(3))
    alive = _spawn_owner(live)
    slab = HostSlab(4096, 4, mine)
    # the dead owner last, checked at once: any pool starting on this machine removes orphans
    # older than 2 s (another process's Python start-up must not fall between kill and check)
    owner = _spawn_owner(dead)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    with open(os.path.join(SHM_DIR, dead + ".epochs"), "wb") as f:
        f.write(b"\0" * 64)
    try:
        assert os.path.exists(os.path.join(SHM_DIR, dead))  # SIGKILL left it behind
        assert dead not in remove_orphan_segments(min_age_s=60)  # too young to judge
        removed = remove_orphan_segments(min_age_s=0)
        assert dead in removed and dead + ".epochs" in removed
        assert not os.path.exists(os.path.join(SHM_DIR, dead))
        assert os.path.exists(os.path.join(SHM_DIR, live))  # its owner still runs
        assert os.path.exists(os.path.join(SHM_DIR, mine))
        slab.array[0, :4] = 7  # still mapped and usable
        assert HostSlab.attach(mine, 4096, 4).array[0, 3] == 7
    finally:
        slab.close()
        alive.kill()
        alive.wait()
    assert not os.path.exists(os.path.join(SHM_DIR, mine))  # the owner unlinks on close
    time.sleep(0.01)
    remove_orphan_segments(min_age_s=0)
    assert not os.path.exists(os.path.join(SHM_DIR, live))


def test_remove_stale_segments_keeps_the_current_generation() -> None:
    pid = os.getpid()
    ns, node = f"stale{pid}", "n1"
    old, cur = HostSlab(4096, 2, f"kvshare-{ns}-{node}-1"), HostSlab(4096, 2, f"kvshare-{ns}-{node}-2")
    try:
        removed = remove_stale_segments(ns, node, keep=f"kvshare-{ns}-{node}-2")
        assert f"kvshare-{ns}-{node}-1" in removed
        assert f"kvshare-{ns}-{node}-2" not in removed
        assert os.path.exists(os.path.join(SHM_DIR, f"kvshare-{ns}-{node}-2"))
    finally:
        old.close()
        cur.close()
