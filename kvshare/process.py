"""Processes of this host, by PID."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
