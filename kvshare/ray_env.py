"""Environment defaults for Ray on one machine: the demo, benchmarks, tests and the CLI.

Ray reads these when it starts its processes (``ray.init``, ``ray.cluster_utils.Cluster``),
and Ray's workers inherit the driver's environment, so a script calls
:func:`use_local_ray_defaults` before it starts or joins Ray. A variable the operator has
already set is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

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
