"""Where a listener on this node binds: the node's address, a port on it, a directory on it.

Every component that listens (engine servers, vLLM servers) binds and advertises the address
of the node it runs on, with ports and directories chosen *on that node*: a port free on the
driver's machine says nothing about another host, and a directory made there does not exist
on it. So these are called inside the process that will listen (a Ray actor on its node), never
on the driver that asks for it.

:func:`node_ip` is ``$KVSHARE_NODE_IP`` when set (a node whose Ray address is not the one its
peers should use), else Ray's node IP when this process is part of a Ray cluster, else
``127.0.0.1``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

NODE_IP_ENV = "KVSHARE_NODE_IP"
LOOPBACK = "127.0.0.1"


def node_ip() -> str:
    """This node's address for listeners (see the module's docstring for the order)."""
    if override := os.environ.get(NODE_IP_ENV, "").strip():
        return override
    ray = sys.modules.get("ray")  # only a process that already uses Ray is in a cluster
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return LOOPBACK


NODE = "node"
"""A listener's ``--host`` value meaning "this node's address and loopback" (:func:`listen_hosts`)."""


def listen_hosts(host: str) -> list[str]:
    """The addresses a ``--host`` value binds: :data:`NODE` is :func:`node_ip` (this node's
    cluster address, so the other nodes and clients on the cluster network reach it) and
    ``127.0.0.1`` (so ``localhost`` works on the machine), and no other interface; anything
    else (``127.0.0.1``, ``0.0.0.0``, one address) as given. Call it where the listener runs,
    once connected to Ray."""
    host = host.strip()
    if not host:
        raise ValueError(f"--host must be an address or {NODE!r}, got an empty string")
    if host != NODE:
        return [host]
    ip = node_ip()
    return [ip] if ip == LOOPBACK else [ip, LOOPBACK]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind) is reachable from this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def bind_listeners(hosts: list[str], port: int) -> list[socket.socket]:
    """Listening TCP sockets on each of ``hosts`` at ``port`` (0: one free port, the same on
    every address). OSError naming the address that could not be bound."""
    socks: list[socket.socket] = []
    try:
        for h in hosts:
            family = socket.AF_INET6 if ":" in h else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((h, port))
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {h}:{port}: {exc.strerror}") from exc
            s.listen(2048)
            port = port or int(s.getsockname()[1])
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def port_on(ip: str) -> int:
    """A TCP port free on ``ip`` now (the caller binds it soon; another process may take it
    in between: bind port 0 and read it back where the server allows that)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def dir_on_node(prefix: str) -> str:
    """A new private directory on this node's disk, under ``/tmp``: short, as unix sockets
    made in it take paths of at most 107 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")
