"""``stop_error_listener``: a process that joins Ray only to call actors (a vLLM engine's
connector) stops the driver thread that polls the GCS for other workers' errors; Ray goes on
working in that process, and ``ray.shutdown`` still ends cleanly. Runs in its own driver
process on its own one-node Ray, so the test session's Ray state is not touched."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster

DRIVER = """
import ray
from kvshare.ray_env import stop_error_listener, use_local_ray_defaults
use_local_ray_defaults()
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
from ray._private import worker as rw
thread = rw.global_worker.listener_thread
assert thread.is_alive(), "ray.init starts the error listener in a driver"
assert stop_error_listener() is True
assert not thread.is_alive()
assert stop_error_listener() is True  # a second call: nothing left to stop

@ray.remote
class Echo:
    def echo(self, x):
        return x

assert ray.get(Echo.remote().echo.remote(41), timeout=60) == 41
assert ray.get(ray.put(b"kv"), timeout=60) == b"kv"
ray.shutdown()
print("OK")
"""


def test_the_listener_stops_and_ray_keeps_working_then_shuts_down() -> None:
    run = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]
