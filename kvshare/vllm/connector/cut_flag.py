"""A request that overrides the connector's cut: ``kv_transfer_params`` ``{"kvshare": {"cut":
"all"}}``.

``all`` loads every block the cluster holds for the prompt, as a cache without a cost model
does; ``cost`` (or no ``cut``) keeps the connector's own cut (``ConnectorSettings.cut``). A
benchmark uses it to measure both choices on one engine (``benchmarks/link_sweep.py``); a
client may use it for a prompt it knows is worth loading whatever the model says. The other
keys of the ``kvshare`` entry (:mod:`kvshare.vllm.connector.opt_out`,
:mod:`kvshare.vllm.router_hint`) are independent of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvshare.vllm.router_hint import KEY

CUT = "cut"
CUTS = ("cost", "all")


def encode(cut: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` entry that asks for cut ``cut`` (``cost`` or ``all``)."""
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {CUTS}, got {cut!r}")
    return {KEY: {CUT: cut}}


def loads_all(kv_transfer_params: Any) -> bool:
    """Whether the request asks to load every held block. Raises ValueError on a malformed
    entry (``cut`` not one of :data:`CUTS`)."""
    if not isinstance(kv_transfer_params, Mapping):
        return False
    entry = kv_transfer_params.get(KEY)
    if not isinstance(entry, Mapping) or CUT not in entry:
        return False
    value = entry[CUT]
    if value not in CUTS:
        raise ValueError(f"kv_transfer_params.{KEY}.{CUT} must be one of {CUTS}, got {value!r}")
    return bool(value == "all")
