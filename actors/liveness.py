"""Is a lease holder still alive? Pools release the leases of holders that died.

Holders name themselves ``pid:<n>`` (a process on the pool's node) or by their Ray actor id
(hex). A holder of any other form is never judged dead here; its leases end at their deadline.
"""

from __future__ import annotations

import os


def pid_alive(holder: str) -> bool | None:
    """Liveness of a ``pid:<n>`` holder on this node; None if the holder is not a pid."""
    if not holder.startswith("pid:") or not holder[4:].isdigit():
        return None
    try:
        os.kill(int(holder[4:]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ray_holder_alive(holder: str) -> bool | None:
    """Liveness of a ``pid:<n>`` or Ray-actor-id holder (Ray's actor table); None: unknown."""
    alive = pid_alive(holder)
    if alive is not None or len(holder) != 32:
        return alive
    try:
        int(holder, 16)
        import ray._private.state as ray_state

        info = ray_state.actors(actor_id=holder)
    except Exception:
        return None
    state = info.get("State") if isinstance(info, dict) else None
    return None if state is None else state != "DEAD"
