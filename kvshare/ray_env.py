"""Environment defaults for Ray on one machine: the demo, benchmarks, tests and the CLI.

Ray reads these when it starts its processes (``ray.init``, ``ray.cluster_utils.Cluster``),
and Ray's workers inherit the driver's environment, so a script calls
:func:`use_local_ray_defaults` before it starts or joins Ray. A variable the operator has
already set is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

LOCAL_RAY_DEFAULTS: Mapping[str, str] = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage reports from machines without internet
    "RAY_AUTH_MODE": "disabled",  # local clusters only; kvshare's own auth guards workers
    "NIXL_LOG_LEVEL": "WARN",
    "TOKENIZERS_PARALLELISM": "false",  # tokenizers forks with Ray's workers otherwise warn
}


def use_local_ray_defaults(extra: Mapping[str, str] | None = None) -> None:
    """Set every variable of :data:`LOCAL_RAY_DEFAULTS` (and ``extra``) not already set."""
    for key, value in {**LOCAL_RAY_DEFAULTS, **(extra or {})}.items():
        os.environ.setdefault(key, value)


def stop_error_listener(timeout_s: float = 1.0) -> bool:
    """Stop this driver's thread that prints other Ray workers' errors (``ray.init`` starts
    it in every driver); returns whether it ended within ``timeout_s``.

    For a process that joins Ray only to call kvshare's actors (a vLLM engine's connector):
    nobody reads what that thread prints, and in vLLM's engine and worker processes its poll
    of the GCS returns at once, over and over, keeping the GCS and every vLLM worker process
    busy (the figures are on the results page). ``ray.shutdown`` still works
    afterwards (it closes the same subscriber again and joins the ended thread).
    """
    from ray._private import worker as ray_worker

    w: Any = ray_worker.global_worker  # (its subscriber and thread are set by ray.init)
    thread = getattr(w, "listener_thread", None)
    if thread is None or not thread.is_alive():
        return True
    w.threads_stopped.set()  # the listener checks it before every poll
    w.gcs_error_subscriber.close()  # and a poll in progress returns (as ray.shutdown does)
    thread.join(timeout_s)
    w.threads_stopped.clear()  # (also read by the log printer, off in these processes)
    return not thread.is_alive()
