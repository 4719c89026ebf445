"""Emulated hosts: N machines on one Linux box, separate on the network (root only).

Each :class:`Host` has its own network namespace with one address on a private bridge, its
own mount namespace (a private tmpfs on ``/dev/shm``, its own ``/etc/hosts``), its own UTS
namespace (hostname), IPC and PID namespaces. A small init process (the host's *anchor*, PID 1
of its PID namespace) holds them; everything started on the host joins them with ``nsenter``,
so killing the anchor kills every process of the host (the kernel does it).

    root namespace (the driver: pytest, a benchmark, the demo; Ray's head)
      kvs-br<slot> 10.231.<slot>.1/24   no uplink, no NAT; the namespaces have no default route
        kvs-s<slot>h0 <-veth-> eth0 10.231.<slot>.10   hostname kvs-h0
        kvs-s<slot>h1 <-veth-> eth0 10.231.<slot>.11   hostname kvs-h1

Ray's head runs in the root namespace on the bridge address: a driver needs a raylet with
its own IP, and the driver stays in the root namespace, so the head is its node (``num_cpus``
0: no work lands there). One Ray node per host joins it over the bridge with
``--node-ip-address`` the host's address and custom resources ``{host.name: 1,
HOST_RESOURCE: 1}``. The head
has its own PID namespace too (an anchor without a network namespace), so teardown is "kill
the anchors" for every Ray process the harness started and for nothing else.

Teardown runs on ``__exit__``, at interpreter exit and on SIGTERM; if the test process is
killed outright, every anchor dies with it (``PR_SET_PDEATHSIG``), and the next harness that
takes the same slot deletes the namespaces and links left behind. A slot (bridge, /24, name
prefix) is held with an ``flock`` for the harness's lifetime, so concurrent harnesses (other
worktrees, other sessions) take different slots and never clean each other's.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TextIO

from kvshare.process import pid_alive

STATE_DIR = Path("/run/kvshare-hosts")
MAX_SLOTS = 16
TOOLS = ("ip", "tc", "unshare", "nsenter")
_PR_SET_PDEATHSIG = 1
HOST_AGENT_PORTS = (52011, 52012, 52013, 52014)
NODE_START_TRIES = 3
HOST_RESOURCE = "kvs-host"
"""A custom resource every host's Ray node has one of: ``{HOST_RESOURCE: 1}`` places one of
something (a Serve replica) per host, never on the head."""
# Ray's temp dir inside every host: short, as Ray's unix sockets live under it (AF_UNIX paths
# are at most 107 bytes; a pytest tmp path plus Ray's session name is ~150). Each host
# bind-mounts its own ``run_dir/h<i>/ray`` there, so the logs stay readable from outside.
HOST_RAY_DIR = "/tmp/ray"

# PID 1 of an emulated host: it reaps orphans (Ray daemonises) and nothing else.
_INIT = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)



def root_missing_reason() -> str | None:
    """Why emulated hosts cannot run here, or ``None`` when they can."""
    if sys.platform != "linux":
        return "emulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, bridges, tc); CI runs as root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    return None


def requires_root() -> Any:
    """A ``pytest.mark.skipif`` that skips, and says why, where emulated hosts cannot run."""
    import pytest

    reason = root_missing_reason()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


@dataclass(frozen=True)
class Host:
    """One emulated machine: ``name`` is also its hostname and its Ray resource."""

    index: int
    name: str
    ip: str
    netns: str
    veth: str  # the root side of its link (the bridge port); its own side is ``eth0``
    anchor: int  # PID (root namespace) of the host's init process
    run_dir: Path  # its Ray temp dir and logs, on the shared disk but used only by it


def _die_with_parent() -> None:
    """``preexec_fn``: SIGKILL this child when the process that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _sh(*argv: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=timeout)



def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


class EmulatedHosts:
    """``with EmulatedHosts(2) as hosts:`` N emulated hosts; ``ray=True`` also starts Ray.

    ``hosts[i]`` is a :class:`Host`; :meth:`popen`/:meth:`run` start processes on a host;
    :meth:`shape`, :meth:`down`, :meth:`up` and :meth:`partition` act on its link;
    :meth:`connect_ray` joins this process to the hosts' Ray cluster (``ray=True``), where
    ``resources={host.name: 0.01}`` pins a task or actor to a host.
    """

    def __init__(
        self,
        n: int = 2,
        *,
        ray: bool = False,
        base_dir: str | os.PathLike[str] | None = None,
        object_store_mb: int = 200,
        num_cpus: int = 1,
        shm_mb: int = 512,
        system_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 180.0,
    ) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n={n}: emulated hosts take 1..200 hosts (one /24)")
        if object_store_mb * 2**20 > shm_mb * 2**20 * 0.9:
            raise ValueError(f"object_store_mb={object_store_mb} must fit in shm_mb={shm_mb}")
        self.n = n
        self.with_ray = ray
        self.object_store_mb = object_store_mb
        self.num_cpus = num_cpus
        self.shm_mb = shm_mb
        self.system_config = dict(system_config or {})
        self.start_timeout_s = start_timeout_s
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self._extra_env = dict(env or {})
        self.hosts: list[Host] = []
        self.slot = -1
        self.bridge = ""
        self.bridge_ip = ""
        self.run_dir = Path()
        self.ray_address = ""
        self.head_anchor = 0
        self._lock: TextIO | None = None
        self._procs: list[subprocess.Popen[bytes]] = []  # anchors and their nsenter children
        self._timers: list[threading.Timer] = []
        self._closed = False
        self._old_sigterm: Any = None
        self._head: subprocess.Popen[bytes] | None = None  # ray start --head
        self._nodes: dict[str, subprocess.Popen[bytes]] = {}  # each host's ray start, by IP
        self._common: Sequence[str] = ()  # the flags every ray start takes
        self._head_argv: list[str] = []

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> EmulatedHosts:
        reason = root_missing_reason()
        if reason is not None:
            raise RuntimeError(reason)
        try:
            self._claim_slot()
            self._install_guards()
            self._make_network()
            for i in range(self.n):
                self._add_host(i)
            if self.with_ray:
                self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        """Kill every process the harness started, delete its namespaces, links and bridge."""
        if self._closed:
            return
        self._closed = True
        for t in self._timers:
            t.cancel()
        for p in reversed(self._procs):  # nsenter children first, anchors (PID 1s) last
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.slot >= 0:
            _clean_slot(self.slot)
            (STATE_DIR / f"slot{self.slot}.json").unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
        atexit.unregister(self.close)

    def _install_guards(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.getsignal(signal.SIGTERM)

            def on_term(signum: int, frame: FrameType | None) -> None:
                self.close()
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, on_term)

    def _claim_slot(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        for slot in range(MAX_SLOTS):
            lock = open(STATE_DIR / f"slot{slot}.lock", "w")  # noqa: SIM115 (held until close)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            # The slot's last holder is gone (the lock dies with its process): clean its leftovers.
            _clean_slot(slot)
            for old in Path("/tmp").glob(f"kvs{slot}-head-*"):  # the last head's temp dir
                shutil.rmtree(old, ignore_errors=True)
            self._lock, self.slot = lock, slot
            self.bridge = f"kvs-br{slot}"
            self.bridge_ip = f"10.231.{slot}.1"
            parent = self._base_dir or Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"kvs{slot}-", dir=parent))
            self._write_state()
            return
        raise RuntimeError(f"all {MAX_SLOTS} emulated-host slots are in use ({STATE_DIR})")

    def _write_state(self) -> None:
        state = {"owner": os.getpid(), "run_dir": str(self.run_dir),
                 "anchors": [h.anchor for h in self.hosts] + [self.head_anchor]}
        (STATE_DIR / f"slot{self.slot}.json").write_text(json.dumps(state))

    # ---------------------------------------------------------------- network
    def _make_network(self) -> None:
        br = self.bridge
        _sh("ip", "link", "add", br, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", br)
        _sh("ip", "link", "set", br, "up")

    def _add_host(self, i: int) -> None:
        name = f"kvs-h{i}"
        netns = f"kvs-s{self.slot}h{i}"
        veth = f"kvs-s{self.slot}h{i}"
        ip = f"10.231.{self.slot}.{10 + i}"
        _sh("ip", "netns", "add", netns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        _sh("ip", "link", "set", f"{veth}p", "netns", netns)
        _sh("ip", "-n", netns, "link", "set", f"{veth}p", "name", "eth0")
        _sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _sh("ip", "-n", netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", netns, "link", "set", "lo", "up")
        _sh("ip", "link", "set", veth, "master", self.bridge)
        _sh("ip", "link", "set", veth, "up")
        run_dir = self.run_dir / f"h{i}"
        run_dir.mkdir()
        hosts_file = run_dir / "etc-hosts"
        lines = ["127.0.0.1 localhost", f"{self.bridge_ip} kvs-root"]
        lines += [f"10.231.{self.slot}.{10 + j} kvs-h{j}" for j in range(self.n)]
        hosts_file.write_text("\n".join(lines) + "\n")
        (run_dir / "ray").mkdir()
        Path(HOST_RAY_DIR).mkdir(exist_ok=True)  # (an empty mount point in the root's /tmp)
        setup = (
            f"mount -t tmpfs -o size={self.shm_mb}m kvs-shm /dev/shm && "
            f"mount --bind {run_dir / 'ray'} {HOST_RAY_DIR} && "
            f"mount --bind {hosts_file} /etc/hosts && hostname {name} && echo ready && "
            f'exec {sys.executable} -c "$KVS_INIT"'
        )
        argv = ["ip", "netns", "exec", netns, *self._unshare(), "sh", "-c", setup]
        anchor = self._start_anchor(argv, name)
        self.hosts.append(Host(i, name, ip, netns, veth, anchor, run_dir))
        self._write_state()

    @staticmethod
    def _unshare() -> list[str]:
        return ["unshare", "--mount", "--uts", "--ipc", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--propagation", "private"]

    def _start_anchor(self, argv: list[str], what: str) -> int:
        """Start ``argv`` (an ``unshare`` that forks the host's PID 1), return PID 1's pid."""
        env = {**os.environ, "KVS_INIT": _INIT}
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             preexec_fn=_die_with_parent)  # noqa: PLW1509 (only prctl)
        self._procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()  # the setup prints "ready" or exits
        if line.strip() != b"ready":
            err = p.stderr.read().decode() if p.stderr and p.poll() is not None else ""
            raise RuntimeError(f"{what}: the namespace setup failed: {err.strip()}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            if children:
                return int(children[0])
            time.sleep(0.01)
        raise RuntimeError(f"{what}: no init process under unshare {p.pid}")

    def shape(self, host: Host, rate: str | None, burst: str | None = None) -> None:
        """Limit ``host``'s link to ``rate`` (tc syntax: ``"100mbit"``) both ways, with tbf;
        ``None`` removes the limit. Latency cannot be added: netem is not in this kernel."""
        for dev, ns in ((host.veth, None), ("eth0", host.netns)):
            pre = ["tc"] + (["-n", ns] if ns else [])
            _sh(*pre, "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                b = burst or _default_burst(rate)
                _sh(*pre, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", b, "latency", "50ms")

    def down(self, host: Host) -> None:
        """Cut ``host``'s link (its bridge port goes down; its eth0 loses carrier)."""
        _sh("ip", "link", "set", host.veth, "down")

    def up(self, host: Host) -> None:
        _sh("ip", "link", "set", host.veth, "up")

    def partition(self, host: Host, seconds: float) -> threading.Timer:
        """Cut ``host``'s link now and bring it back after ``seconds`` (returns the timer)."""
        self.down(host)
        t = threading.Timer(seconds, lambda: None if self._closed else self.up(host))
        t.daemon = True
        self._timers.append(t)
        t.start()
        return t

    # ---------------------------------------------------------------- processes
    def _nsenter(self, anchor: int, net: bool = True) -> list[str]:
        ns = ["--mount", "--uts", "--ipc", "--pid"] + (["--net"] if net else [])
        return ["nsenter", "--target", str(anchor), *ns, f"--wd={os.getcwd()}"]

    def env(self) -> dict[str, str]:
        """The environment processes on the hosts get: this one's, Ray's local defaults, and
        ``PYTHONPATH`` led by the directory this ``kvshare`` is imported from."""
        from kvshare.ray_env import LOCAL_RAY_DEFAULTS

        here = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, **LOCAL_RAY_DEFAULTS, "PYTHONPATH": path,
                # a multi-node cluster: Ray refuses to join one without it
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                # every emulated host's memory monitor reads the whole machine's memory, and
                # would kill this harness's workers for what other programs on it use
                "RAY_memory_monitor_refresh_ms": "0", **self._extra_env}

    def popen(self, host: Host, argv: Sequence[str], **kw: Any) -> subprocess.Popen[bytes]:
        """Start a long-lived process on ``host``; it dies with the host at teardown."""
        kw.setdefault("env", self.env())
        p = subprocess.Popen([*self._nsenter(host.anchor), *argv], **kw)
        self._procs.append(p)
        return p

    def run(self, host: Host, argv: Sequence[str], timeout: float = 30.0,
            check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a short command on ``host`` and wait for it (bounded by ``timeout``)."""
        return subprocess.run([*self._nsenter(host.anchor), *argv], env=self.env(), text=True,
                              capture_output=True, timeout=timeout, check=check, input=input)

    # ---------------------------------------------------------------- Ray
    def connect_ray(self, namespace: str, **kw: Any) -> None:
        """``ray.init`` this process (in the root namespace) to the hosts' cluster, on the
        head's raylet: other clusters' raylets on this machine must not be picked."""
        import ray

        if not self.ray_address:
            raise ValueError("start the hosts with ray=True to join their Ray cluster")
        kw.setdefault("log_to_driver", False)
        ray.init(address=self.ray_address, _node_ip_address=self.bridge_ip, namespace=namespace,
                 **kw)

    def _ray(self) -> str:
        exe = Path(sys.executable).parent / "ray"
        return str(exe) if exe.exists() else "ray"

    def _start_ray(self) -> None:
        port = _free_port(self.bridge_ip)
        self.ray_address = f"{self.bridge_ip}:{port}"
        head_dir = self.run_dir / "head"
        head_dir.mkdir()
        # The driver reads the head's sockets in the root namespace: a short real path,
        # linked from the run dir; removed when the slot is next claimed.
        head_ray = Path(tempfile.mkdtemp(prefix=f"kvs{self.slot}-head-", dir="/tmp"))
        (head_dir / "ray").symlink_to(head_ray)
        setup = f'echo ready && exec {sys.executable} -c "$KVS_INIT"'
        argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                "--propagation", "private", "sh", "-c", setup]
        self.head_anchor = self._start_anchor(argv, "ray head")
        self._write_state()
        common = ["--block", "--disable-usage-stats",
                  f"--object-store-memory={self.object_store_mb * 2**20}"]
        # Ray takes system config on the head only (the nodes get it from the GCS)
        config = [f"--system-config={json.dumps(self.system_config)}"] if self.system_config else []
        head = [self._ray(), "start", "--head", f"--node-ip-address={self.bridge_ip}",
                *_agent_ports([_free_port(self.bridge_ip) for _ in range(4)]),
                f"--port={port}", f"--dashboard-port={_free_port(self.bridge_ip)}",
                "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={head_ray}", *common,
                *config]
        self._head_argv = [*self._nsenter(self.head_anchor, net=False), *head]
        self._head = self._start_head()
        self._common = common
        self._nodes = {h.ip: self._start_node(h, common) for h in self.hosts}
        self._wait_ray_nodes()

    def _start_head(self) -> subprocess.Popen[bytes]:
        """``ray start --head`` (its log appended to ``head/ray-start.log``)."""
        with open(self.run_dir / "head" / "ray-start.log", "ab") as log:
            p = subprocess.Popen(self._head_argv, env=self.env(), stdout=log,
                                 stderr=subprocess.STDOUT)
        self._procs.append(p)
        return p

    def restart_ray_node(self, host: Host) -> None:
        """Reboot ``host``: end every process on it (its PID namespace: Ray, and what its
        actors started, e.g. vLLM servers in their own sessions), then start its Ray node
        again and wait until it is alive (a new node id). What a host whose node Ray declared
        dead needs (a partition longer than the node-death timeout ends its raylet when the
        link returns, and leaves its actors' servers behind)."""
        if self._head is None:
            raise ValueError("start the hosts with ray=True to restart a host's Ray node")
        _kill_namespace(host.anchor)
        self._nodes[host.ip].wait(timeout=30)
        self._nodes[host.ip] = self._start_node(host, self._common)
        self._wait_ray_nodes()

    def _start_node(self, h: Host, common: Sequence[str]) -> subprocess.Popen[bytes]:
        """``ray start`` on ``h``, joining the head (its log appended to ``ray-start.log``)."""
        node = [self._ray(), "start", f"--address={self.ray_address}",
                f"--node-ip-address={h.ip}", f"--num-cpus={self.num_cpus}",
                *_agent_ports(HOST_AGENT_PORTS),  # the host's own network: always free
                f"--resources={json.dumps({h.name: 1, HOST_RESOURCE: 1})}",
                f"--temp-dir={HOST_RAY_DIR}", *common]
        with open(h.run_dir / "ray-start.log", "ab") as hlog:
            return self.popen(h, node, stdout=hlog, stderr=subprocess.STDOUT)

    def _wait_ray_nodes(self) -> None:
        """Block until the head and every host's node are alive in the GCS. A ``ray start``
        that gives up before its node joined (Ray waits 30 s for it, which a loaded machine
        can exceed) is started again, at most :data:`NODE_START_TRIES` times each."""
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        deadline = time.monotonic() + self.start_timeout_s
        want = {self.bridge_ip, *(h.ip for h in self.hosts)}
        seen: set[str] = set()
        tries = dict.fromkeys(want, 1)
        gcs: Any = None
        while time.monotonic() < deadline:
            procs = {self.bridge_ip: self._head, **self._nodes}
            for ip, proc in procs.items():
                if proc is None or proc.poll() is None or ip in seen:
                    continue
                if tries[ip] >= NODE_START_TRIES:
                    raise RuntimeError(f"the Ray node on {ip} exited {tries[ip]} times while "
                                       f"starting; logs in {self.run_dir}")
                tries[ip] += 1
                if ip == self.bridge_ip:  # what the failed start left (its GCS holds the port)
                    _kill_namespace(self.head_anchor)
                    self._head, gcs = self._start_head(), None
                else:
                    host = next(h for h in self.hosts if h.ip == ip)
                    _kill_namespace(host.anchor)
                    self._nodes[ip] = self._start_node(host, self._common)
            if gcs is None and _accepts(self.ray_address):
                gcs = GcsClient(address=self.ray_address)
            if gcs is not None:
                try:
                    infos = gcs.get_all_node_info(timeout=5).values()
                except Exception:  # (a GCS still starting, or overloaded: asked again)
                    infos = []
                seen = {i.node_manager_address for i in infos if i.state == 0}  # 0: ALIVE
                if want <= seen:
                    return
            time.sleep(0.25)
        raise RuntimeError(f"Ray nodes {sorted(want - seen)} did not join within "
                           f"{self.start_timeout_s} s; logs in {self.run_dir}")


def _agent_ports(ports: Sequence[int]) -> list[str]:
    """Fixed ports for a node's agents: with port 0 the raylet waits for each agent to write
    the port it took, and gives up after 30 s (a loaded 2-core machine has hit that)."""
    flags = ("--metrics-export-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
    return [f"{f}={p}" for f, p in zip(flags, ports, strict=True)]


def _accepts(address: str) -> bool:
    ip, port = address.rsplit(":", 1)
    try:
        socket.create_connection((ip, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def _default_burst(rate: str) -> str:
    """10 ms of ``rate`` and at least 32 KiB (tbf needs burst >= rate / HZ)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, mult in units.items():
        if rate.endswith(suffix):
            bps = float(rate[: -len(suffix)]) * mult
            return f"{max(32 * 1024, int(bps / 8 / 100))}b"
    raise ValueError(f"rate {rate!r}: write it as tc does, e.g. '100mbit' or '1gbit'")


def _clean_slot(slot: int) -> None:
    """Delete slot ``slot``'s namespaces, links and bridge, and kill its anchors (a crashed
    run's leftovers, or this run's at teardown). Touches only ``kvs-s<slot>h*``/``kvs-br<slot>``.
    """
    state_file = STATE_DIR / f"slot{slot}.json"
    if state_file.exists():
        try:
            state = json.loads(state_file.read_text())
        except ValueError:
            state = {}
        for pid in state.get("anchors", []):
            if pid and pid_alive(pid) and _is_anchor(pid):
                os.kill(pid, signal.SIGKILL)
    prefix = f"kvs-s{slot}h"
    for ns in _sh("ip", "netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(prefix):
            _sh("ip", "netns", "del", name, check=False)  # its eth0 and the veth pair go too
    for link in _sh("ip", "-o", "link", "show", check=False).stdout.split("\n"):
        parts = link.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix) or name == f"kvs-br{slot}":
                _sh("ip", "link", "del", name, check=False)


def _kill_namespace(anchor: int) -> None:
    """SIGKILL every process in the PID namespace whose init is ``anchor`` (not ``anchor``):
    the harness's own namespaces, so only processes it started there."""
    try:
        ns = os.readlink(f"/proc/{anchor}/ns/pid")
    except OSError:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == anchor:
            continue
        try:
            if os.readlink(entry / "ns" / "pid") == ns:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # (gone meanwhile)
            continue


def _is_anchor(pid: int) -> bool:
    """Whether ``pid`` is an emulated host's init (so a reused PID is never killed)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return b"KVS_INIT=" in environ
