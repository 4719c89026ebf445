"""Emulated hosts (kvshare.testing.hosts): separate on the network, in /dev/shm and by name.

Every byte stays on the private bridge (10.231.<slot>.0/24); nothing is sent anywhere else:
"no way out" is checked on the routing table, not by sending.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paths import ROOT

from kvshare.testing.hosts import EmulatedHosts, Host, requires_root

pytestmark = [pytest.mark.hosts, requires_root()]

# A receiver: accepts up to COUNT connections on IP:PORT for SECONDS, prints "<bytes>
# <seconds>" for each (seconds from its first byte to EOF), then exits.
RECEIVER = """
import socket, sys, time
ip, port, seconds, count = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((ip, port)); srv.listen(16); print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end and count > 0:
    count -= 1
    srv.settimeout(max(0.05, end - time.monotonic()))
    try:
        c, _ = srv.accept()
    except OSError:
        break
    c.settimeout(max(0.05, end - time.monotonic()))
    n, t0 = 0, None
    try:
        while chunk := c.recv(1 << 20):
            t0 = t0 or time.monotonic()
            n += len(chunk)
    except OSError:
        pass
    print(n, time.monotonic() - (t0 or time.monotonic()), flush=True)
    c.close()
"""

# A sender: sends BYTES to IP:PORT (connect timeout 1 s), prints "ok" or the error.
SENDER = """
import socket, sys
ip, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    s = socket.create_connection((ip, port), timeout=1.0)
    s.settimeout(20)
    buf, left = b"x" * (1 << 20), nbytes
    while left > 0:
        left -= s.send(buf[: min(left, len(buf))])
    s.close()
    print("ok")
except OSError as e:
    print(type(e).__name__, e)
"""

# A prober: connects to IP:PORT every ~0.1 s (0.25 s connect timeout) for up to SECONDS;
# prints how many tries failed and the monotonic time of the first that worked (or "nan").
PROBE = """
import socket, sys, time
ip, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end, failed, ok = time.monotonic() + seconds, 0, float("nan")
while time.monotonic() < end:
    try:
        socket.create_connection((ip, port), timeout=0.25).close()
        ok = time.monotonic()
        break
    except OSError:
        failed += 1
        time.sleep(0.1)
print(failed, ok)
"""

PORT = 47001


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedHosts]:
    with EmulatedHosts(2, base_dir=tmp_path_factory.mktemp("hosts")) as hs:
        yield hs


def receive(hs: EmulatedHosts, host: Host, seconds: float, count: int = 1000
            ) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", RECEIVER, host.ip, str(PORT), str(seconds), str(count)]
    p = hs.popen(host, args, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def send(hs: EmulatedHosts, host: Host, to: Host, nbytes: int) -> str:
    args = [sys.executable, "-c", SENDER, to.ip, str(PORT), str(nbytes)]
    return hs.run(host, args, timeout=30).stdout.strip()


def results(p: subprocess.Popen[str]) -> list[tuple[int, float]]:
    out, _ = p.communicate(timeout=30)
    return [(int(a), float(b)) for a, b in (line.split() for line in out.splitlines())]


def test_hosts_reach_each_other_and_nothing_else(hosts: EmulatedHosts) -> None:
    a, b = hosts[0], hosts[1]
    rx = receive(hosts, b, seconds=10, count=2)
    assert send(hosts, a, b, 1000) == "ok"  # host to host over the bridge
    with socket.create_connection((b.ip, PORT), timeout=2) as s:  # the driver, root namespace
        s.sendall(b"y" * 10)
    assert [n for n, _ in results(rx)] == [1000, 10]
    for h in (a, b):
        routes = hosts.run(h, ["ip", "route"]).stdout
        assert "default" not in routes and routes.count("\n") == 1, routes  # the /24 only
        # A route lookup sends nothing; a connect anywhere off the /24 would fail the same way.
        out = hosts.run(h, ["ip", "route", "get", "198.51.100.7"], check=False)
        assert out.returncode != 0 and "unreachable" in out.stderr, out.stderr


def test_shm_and_hostname_are_per_host(hosts: EmulatedHosts) -> None:
    a, b = hosts[0], hosts[1]
    name = f"kvs-probe-{os.getpid()}"
    hosts.run(a, ["sh", "-c", f"echo a > /dev/shm/{name}"])
    try:
        assert hosts.run(a, ["cat", f"/dev/shm/{name}"]).stdout == "a\n"
        assert hosts.run(b, ["ls", "/dev/shm"]).stdout.split() == []
        assert not Path(f"/dev/shm/{name}").exists()  # nor in the root namespace's
    finally:
        hosts.run(a, ["rm", "-f", f"/dev/shm/{name}"])
    names = [hosts.run(h, ["hostname"]).stdout.strip() for h in (a, b)]
    assert names == ["kvs-h0", "kvs-h1"] and socket.gethostname() not in names
    # Each host resolves the others by name (its own /etc/hosts).
    assert hosts.run(a, ["getent", "hosts", "kvs-h1"]).stdout.split()[0] == b.ip


def test_tbf_limits_a_stream_between_two_hosts(hosts: EmulatedHosts) -> None:
    a, b = hosts[0], hosts[1]
    rx = receive(hosts, b, seconds=25, count=2)
    assert send(hosts, a, b, 32 << 20) == "ok"  # unshaped
    hosts.shape(b, "50mbit")  # far below what the unshaped link gives on a loaded machine
    try:
        assert send(hosts, a, b, 6 << 20) == "ok"  # ~1 s at 50 Mbit/s
    finally:
        hosts.shape(b, None)
    (n_free, t_free), (n_shaped, t_shaped) = results(rx)
    free_mbit, shaped_mbit = n_free * 8 / t_free / 1e6, n_shaped * 8 / t_shaped / 1e6
    print(f"unshaped {free_mbit:.0f} Mbit/s, tbf 50mbit {shaped_mbit:.0f} Mbit/s")
    assert n_free == 32 << 20 and n_shaped == 6 << 20
    assert 35 <= shaped_mbit <= 65  # measured 52-56 (and 102 at 100mbit, 387 at 400mbit)
    assert free_mbit > 3 * shaped_mbit  # unshaped: 0.4-6.8 Gbit/s at load 13-22


def test_partition_cuts_the_link_and_it_comes_back(hosts: EmulatedHosts) -> None:
    a, b = hosts[0], hosts[1]
    rx = receive(hosts, b, seconds=15)
    assert send(hosts, a, b, 10) == "ok"
    t0 = time.monotonic()
    hosts.partition(b, 2.0)
    args = [sys.executable, "-c", PROBE, b.ip, str(PORT), "8"]
    failed, back = hosts.run(a, args, timeout=20).stdout.split()
    rx.kill()
    rx.wait(timeout=10)
    back_s = float(back) - t0  # CLOCK_MONOTONIC is one clock for every namespace here
    print(f"partition of 2.0 s: {failed} connects failed, the first worked {back_s:.2f} s "
          "after the cut")
    assert int(failed) >= 1 and 1.9 <= back_s < 3.5


def test_teardown_and_a_killed_run_leave_nothing(tmp_path: Path) -> None:
    # A harness in a process killed outright: its hosts die with it (PR_SET_PDEATHSIG) ...
    code = ("import time; from kvshare.testing.hosts import EmulatedHosts\n"
            f"h = EmulatedHosts(1, base_dir={str(tmp_path)!r}).__enter__()\n"
            "print(h.slot, h[0].anchor, flush=True); time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    slot, anchor = map(int, p.stdout.readline().split())
    assert slot_names(slot)  # its namespace and links exist
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert wait_gone(anchor, 5.0), f"host init {anchor} outlived its killed harness"
    assert slot_names(slot)  # ... but its namespace and links stay behind,
    with EmulatedHosts(1, base_dir=tmp_path) as hs:  # until the next harness takes the slot.
        assert hs.slot == slot and slot_names(slot) == {f"kvs-s{slot}h0", f"kvs-br{slot}"}
        mine = hs[0].anchor
    assert slot_names(slot) == set() and wait_gone(mine, 5.0)


def slot_names(slot: int) -> set[str]:
    """Namespaces and links of one slot."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in ns.splitlines() if line}
    names |= {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
    return {n for n in names if n.startswith((f"kvs-s{slot}h", f"kvs-br{slot}"))}


def wait_gone(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedHosts]:
    """Two hosts with a Ray node each, the head in the root namespace, this process joined."""
    import ray

    t0 = time.monotonic()
    # a Ray system config (set on the head only; the nodes read it from the GCS): here a more
    # patient node-death threshold than Ray's 5, for a starved CI machine
    with EmulatedHosts(2, ray=True, base_dir=tmp_path_factory.mktemp("rayhosts"),
                       system_config={"health_check_failure_threshold": 10}) as hs:
        print(f"2-host Ray cluster up in {time.monotonic() - t0:.1f} s")
        hs.connect_ray("kvs-test-hosts")
        try:
            yield hs
        finally:
            ray.shutdown()


def test_ray_nodes_on_two_hosts(ray_hosts: EmulatedHosts) -> None:
    import numpy as np
    import ray

    hs = ray_hosts
    probe = _probe()  # defined here: pickled by value, the hosts need not import tests
    a = probe.options(resources={"kvs-h0": 0.01}).remote()
    b = probe.options(resources={"kvs-h1": 0.01}).remote()
    (name_a, ip_a, shm_a), (name_b, ip_b, shm_b) = ray.get(
        [a.where.remote(), b.where.remote()], timeout=60)
    assert (name_a, ip_a) == ("kvs-h0", hs[0].ip)
    assert (name_b, ip_b) == ("kvs-h1", hs[1].ip)
    assert shm_a != shm_b  # each raylet's object store is in its own /dev/shm
    ref = a.make.remote(8 << 20)
    expect = int(np.arange(8 << 20, dtype=np.uint8).sum())
    assert ray.get(b.digest.remote(ref), timeout=60) == expect
    for actor in (a, b):
        ray.kill(actor)


def test_listeners_on_a_host_bind_and_advertise_its_address(
        ray_hosts: EmulatedHosts, tmp_path: Path) -> None:
    import httpx
    import ray

    from kvshare.engines.hf import EngineConfig
    from kvshare.engines.service import WorkerService
    from kvshare.vllm.server.launch import VllmSpec

    b = ray_hosts[1]
    on_b = {"resources": {b.name: 0.01}, "num_cpus": 0}

    @ray.remote(**on_b)  # type: ignore[call-overload]
    def resolve(model: str) -> tuple[str, int, str, bool]:
        spec = VllmSpec(model=model).on_this_node()  # what a vLLM worker on B would serve
        return spec.host, spec.port, spec.events_dir, os.path.isdir(spec.events_dir)

    host, port, events_dir, made = ray.get(resolve.remote(str(tmp_path)), timeout=60)
    assert host == b.ip and port > 0 and made and events_dir.startswith("/tmp/kvshare-vllm-ev-")
    os.rmdir(events_dir)  # (made on B; /tmp is one disk under every emulated host)

    # The reference worker on B serves on B's address, and the driver reaches it there.
    cfg = EngineConfig(overrides={"num_hidden_layers": 1})
    svc = ray.remote(**on_b)(WorkerService).remote("ns", cfg, worker_id="wb", connect=False)
    try:
        info = ray.get(svc.ready.remote(), timeout=120)
        assert info["endpoint"].startswith(f"http://{b.ip}:")
        health = httpx.get(f"{info['endpoint']}/health", timeout=5).json()
        assert health == {"ok": True, "worker_id": "wb"}
    finally:
        ray.get(svc.stop.remote(), timeout=30)
        ray.kill(svc)


def test_workers_on_two_hosts_register_their_address_and_share_kv_by_network(
        ray_hosts: EmulatedHosts) -> None:
    import ray

    from kvshare.actors.deploy import deploy, shutdown
    from kvshare.actors.index.client import IndexClient
    from kvshare.engines.hf import EngineConfig, model_keys
    from kvshare.engines.service import WorkerService

    cfg = EngineConfig(overrides={"num_hidden_layers": 1})
    layout = model_keys(cfg).layout
    deploy(namespace="h", layout=layout, host_gb=8 * layout.bytes_per_block / 2**30)
    worker = ray.remote(num_cpus=0)(WorkerService)
    on = {h.name: worker.options(resources={h.name: 0.01}).remote("h", cfg, worker_id=h.name)
          for h in ray_hosts.hosts}
    try:
        infos = ray.get([w.ready.remote() for w in on.values()], timeout=180)
        listed = {w.worker_id: w.endpoint for w in IndexClient.connect().workers()}
        for h, info in zip(ray_hosts.hosts, infos, strict=True):
            assert listed[h.name] == info["endpoint"]
            assert info["endpoint"].startswith(f"http://{h.ip}:")  # its host's, not 127.0.0.1
        # Host A computes and stores two blocks; host B reuses them over the network.
        tokens = [(7 * i) % 500 + 3 for i in range(2 * layout.block_tokens + 5)]
        host_a, host_b = (h.name for h in ray_hosts.hosts)
        a = ray.get(on[host_a].generate.remote(tokens, 2), timeout=120)
        b = ray.get(on[host_b].generate.remote(tokens, 2), timeout=120)
        print(f"host B reused {b['reused_tokens']} tokens: {b['bytes_by_transport']}; "
              f"its pool's probe (bytes/s): {infos[1]['bandwidths_bytes_per_s']}")
        assert b["tokens"] == a["tokens"] and b["reused_tokens"] == 2 * layout.block_tokens
        assert not b["bytes_by_transport"].get("shm")  # shared memory stays within a host
        assert sum(b["bytes_by_transport"].values()) == 2 * layout.bytes_per_block
    finally:
        ray.get([w.stop.remote() for w in on.values()], timeout=30)
        for w in on.values():
            ray.kill(w)
        shutdown()


def _probe() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class _Probe:
        def where(self) -> tuple[str, str, str]:
            st = os.stat("/dev/shm")
            return socket.gethostname(), ray.util.get_node_ip_address(), f"{st.st_dev}"

        def make(self, n: int) -> Any:
            import numpy as np

            return np.arange(n, dtype=np.uint8)

        def digest(self, x: Any) -> int:
            return int(x.sum())

    return _Probe

