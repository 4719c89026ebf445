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
