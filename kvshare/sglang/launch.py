"""Start and stop one SGLang server with HiCache and kvshare as its storage tier (L3).

``python -m sglang.launch_server`` with ``--enable-hierarchical-cache``, the host pool in
``layer_first`` layout (what :class:`~kvshare.sglang.backend.KVShareStorage` reads and
writes), ``--hicache-storage-backend dynamic`` loading the kvshare backend (or one of SGLang's
own backends, e.g. ``file``, for comparisons; or none), its radix-cache KV events published on
an ``ipc://`` socket (the same wire format as vLLM's, read by
:class:`~kvshare.vllm.events.consumer.KVEventsConsumer`) and its Prometheus ``/metrics``.
The process is run and stopped like a vLLM server
(:class:`~kvshare.vllm.server.launch.VllmProcess`: its own process group, ``/health`` to
wait for).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvshare.vllm.server.launch import VllmProcess

BACKEND = {"backend_name": "kvshare", "module_path": "kvshare.sglang.backend",
           "class_name": "KVShareStorage", "interface_v1": 1}
"""SGLang's keys of ``--hicache-storage-backend-extra-config`` that load the kvshare backend."""
STORAGES = ("kvshare", "file", "")


@dataclass(frozen=True)
class SglangSpec:
    """One SGLang server. ``host``/``port``/``events_dir`` as :class:`VllmSpec`'s: ``""``/``0``/
    ``""`` are chosen on the node that runs it. ``page_size``: SGLang's ``--page-size``, which
    must equal the kvshare namespace's ``--block-tokens``; ``max_total_tokens``: SGLang's
    device KV pool in tokens (on a CPU it otherwise takes most of the memory);
    ``hicache_ratio``: the host pool's size against the device pool's. ``storage``: the L3
    tier: ``"kvshare"`` (``storage_settings`` are the backend's keys,
    :class:`~kvshare.sglang.settings.StorageSettings`), ``"file"`` (SGLang's own, in
    ``$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``) or ``""`` (no HiCache at all). ``cpu``: serve
    on the CPU (``--device cpu``, the torch attention backend, HiCache's ``direct`` I/O, an
    idle scheduler that sleeps);
    ``extra_args``/``env``: more of SGLang's flags and environment; ``cpus``: cores to pin to."""

    model: str
    port: int = 0
    events_dir: str = ""
    host: str = ""
    page_size: int = 16
    max_total_tokens: int = 8192
    hicache_ratio: float = 2.0
    storage: str = "kvshare"
    storage_settings: Mapping[str, Any] = field(default_factory=dict)
    served_name: str | None = None
    cpu: bool = False
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {self.storage!r}")
        if self.page_size <= 0 or self.max_total_tokens < self.page_size:
            raise ValueError(f"page_size {self.page_size} and max_total_tokens "
                             f"{self.max_total_tokens} must be positive, a page at least")
        if self.storage == "kvshare" and "namespace" not in self.storage_settings:
            raise ValueError("storage 'kvshare' needs storage_settings['namespace'] (the "
                             "namespace deployed with kvshare up --block-tokens PAGE_SIZE)")
        if not os.path.isdir(self.model):
            raise ValueError(f"model {self.model!r} is not a local model directory")

    def on_this_node(self) -> SglangSpec:
        """This spec with what is left to the node filled in (called on that node)."""
        from kvshare.addresses import dir_on_node, node_ip, port_on

        host = self.host or node_ip()
        return replace(self, host=host, port=self.port or port_on(host),
                       events_dir=self.events_dir or dir_on_node("kvshare-sglang-ev-"))

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
        events = {"publisher": "zmq", "endpoint": self.events_endpoint,
                  "replay_endpoint": self.replay_endpoint, "topic": "kv"}
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
                "--host", self.host, "--port", str(self.port),
                "--page-size", str(self.page_size),
                "--max-total-tokens", str(self.max_total_tokens),
                "--enable-metrics", "--enable-cache-report",
                "--kv-events-config", json.dumps(events)]
        if self.served_name:
            args += ["--served-model-name", self.served_name]
        if self.cpu:
            # --sleep-on-idle: an idle scheduler otherwise spins a core (its idle loop runs
            # its sanity checks back to back); on a host of a few cores, servers then starve
            # each other. It sleeps only when no request is in it (a request waiting on a
            # storage prefetch still polls), and wakes on the next request.
            args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
        if self.storage:
            args += ["--enable-hierarchical-cache", "--hicache-ratio", f"{self.hicache_ratio:g}",
                     "--hicache-mem-layout", "layer_first",
                     "--hicache-storage-backend", "dynamic" if self.storage == "kvshare"
                     else self.storage]
            if self.cpu:
                args += ["--hicache-io-backend", "direct"]
            if self.storage == "kvshare":
                args += ["--hicache-storage-backend-extra-config",
                         json.dumps({**BACKEND, **self.storage_settings})]
        return args + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        """The server's environment: this process's, without the ``OMP_NUM_THREADS`` Ray puts
        in its workers (1 for a zero-CPU actor: SGLang's torch would compute on one core; the
        server is not one of Ray's tasks); ``cpus`` sets it to their count, ``env`` to any."""
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        if self.cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if self.cpus:
            env["OMP_NUM_THREADS"] = str(len(self.cpus))
        env.update(self.env)
        return env


def only_models(*modules: str) -> dict[str, str]:
    """SGLang's environment to import only the model modules ``modules`` (e.g. ``"llama"``)
    at start: it imports every one of its ~250 model modules otherwise, which takes minutes on
    a loaded CPU. Empty when SGLang is not installed here."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = os.path.join(list(spec.submodule_search_locations)[0], "srt", "models")
    skip = sorted(name[:-3] for name in os.listdir(folder)
                  if name.endswith(".py") and name[:-3] not in modules)
    return {"SGLANG_DISABLED_MODEL_ARCHS": ",".join(skip)}


class SglangProcess(VllmProcess):
    """A running SGLang server (its own process group: the HTTP server, its scheduler and
    detokenizer processes); it is sent SIGTERM when the process that started it dies (a worker
    actor killed by Ray), and SGLang then ends its own processes."""

    engine = "SGLang"
