"""Listeners bind their own node's address, with ports and directories chosen on that node
(kvshare.addresses; vLLM specs resolve there). The cross-host check is in test_hosts.py."""

from __future__ import annotations

import os
import socket
import sys
import types
from pathlib import Path

import pytest

from kvshare.addresses import (
    NODE_IP_ENV,
    bind_listeners,
    dir_on_node,
    is_loopback,
    listen_hosts,
    node_ip,
    port_on,
)
from kvshare.vllm.server.launch import VllmSpec


def fake_ray(ip: str, initialized: bool = True) -> types.ModuleType:
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: initialized  # type: ignore[attr-defined]
    ray.util = types.SimpleNamespace(get_node_ip_address=lambda: ip)  # type: ignore[attr-defined]
    return ray


def test_node_ip_is_the_override_then_rays_then_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_IP_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "ray", fake_ray("10.231.0.11"))
    assert node_ip() == "10.231.0.11"  # in a Ray cluster: the node's address
    monkeypatch.setenv(NODE_IP_ENV, "10.0.0.5")
    assert node_ip() == "10.0.0.5"  # the operator's word wins
    monkeypatch.delenv(NODE_IP_ENV)
    monkeypatch.setitem(sys.modules, "ray", fake_ray("10.231.0.11", initialized=False))
    assert node_ip() == "127.0.0.1"  # not in a cluster: this machine only


def test_port_on_is_free_on_that_address_and_dir_on_node_is_new() -> None:
    port = port_on("127.0.0.2")  # (all of 127/8 is this machine's)
    with socket.socket() as s:
        s.bind(("127.0.0.2", port))
    a, b = dir_on_node("kvs-test-"), dir_on_node("kvs-test-")
    try:
        assert a != b and os.path.isdir(a) and os.listdir(a) == [] and len(a) < 40
    finally:
        os.rmdir(a)
        os.rmdir(b)


def test_a_vllm_spec_leaves_address_port_and_events_dir_to_its_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_IP_ENV, "127.0.0.3")
    open_spec = VllmSpec(model=str(tmp_path))
    assert (open_spec.host, open_spec.port, open_spec.events_dir) == ("", 0, "")
    with pytest.raises(AssertionError, match="on_this_node"):
        _ = open_spec.endpoint  # an unresolved spec has no endpoint to register
    spec = open_spec.on_this_node()
    assert spec.host == "127.0.0.3" and spec.port > 0 and os.path.isdir(spec.events_dir)
    assert spec.endpoint == f"http://127.0.0.3:{spec.port}"
    assert spec.argv()[spec.argv().index("--host") + 1] == "127.0.0.3"
    assert spec.on_this_node() == spec  # resolving twice changes nothing
    fixed = VllmSpec(model=str(tmp_path), port=18125, events_dir=str(tmp_path), host="10.0.0.9")
    assert fixed.on_this_node() == fixed  # what the caller chose is kept
    os.rmdir(spec.events_dir)


def test_listen_host_node_is_the_nodes_address_and_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's default (``--host node``): the cluster address, so other machines reach
    it, plus loopback, so ``curl localhost`` works; no other interface."""
    monkeypatch.delenv(NODE_IP_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "ray", fake_ray("10.231.0.11"))
    assert listen_hosts("node") == ["10.231.0.11", "127.0.0.1"]
    monkeypatch.setitem(sys.modules, "ray", fake_ray("10.231.0.11", initialized=False))
    assert listen_hosts("node") == ["127.0.0.1"]  # no cluster: this machine only
    assert listen_hosts(" 0.0.0.0 ") == ["0.0.0.0"] and listen_hosts("::1") == ["::1"]
    with pytest.raises(ValueError, match="--host must be an address or 'node'"):
        listen_hosts(" ")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    assert not is_loopback("10.231.0.11")


def test_listeners_bind_every_address_on_one_port() -> None:
    socks = bind_listeners(["127.0.0.1", "127.0.0.2"], 0)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(socks) == 2 and len(ports) == 1  # port 0: one free port, on both
        for ip in ("127.0.0.1", "127.0.0.2"):
            socket.create_connection((ip, socks[0].getsockname()[1]), timeout=2).close()
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1:"):
            bind_listeners(["127.0.0.1"], socks[0].getsockname()[1])  # taken
    finally:
        for s in socks:
            s.close()
