"""What each tier is worth, read off a status snapshot: one reading for every view.

:func:`value_rows` prices each node pool's value ledger (:mod:`kvshare.pool.value`, the
``value`` of every namespace in :func:`kvshare.actors.deploy.status`) at the prefill speed the
namespace's workers measured (the status's ``prefill_tokens_per_s``, the median of their
reports as the router's cost model takes it). ``kvshare status`` prints :func:`value_lines`,
the Prometheus collector exports the rows and the live page shows them, so all three say
the same. The gpu tier (each worker's own engine cache, as its engine reports it) comes from
the index (:mod:`kvshare.actors.index.engine_value`): its ``hit_share`` is over the prompt
tokens the node's engines admitted, the pool tiers' over the blocks looked up in the pool. A
tier that moved no bytes and served nothing since it started is left out (a pool's remote
pulls, before any).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvshare.layout import format_bytes
from kvshare.pool.value import SPANS, namespace_verdicts, namespace_worth


def value_rows(st: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per node, namespace and tier: ``window`` and ``total`` (:meth:`TierWorth.as_dict`),
    ``verdict`` ("" when the tier pays over the window), the window's span ``window_s``, and
    ``prefill_tokens_per_s`` (0: no worker of the namespace reported a speed yet)."""
    speeds = st.get("prefill_tokens_per_s") or {}
    engines: dict[tuple[str, str], Mapping[str, Any]] = {}  # the index's gpu tier figures
    for shard in st.get("index", []):
        for node, per_ns in (shard.get("engine_value") or {}).items():
            for ns, value in per_ns.items():
                engines[(str(node), ns)] = value
    out = []
    for node in st.get("nodes", []):
        nid = str(node["node_id"])
        pools = ((node.get("pool") or {}).get("namespaces") or {})
        for ns in sorted(set(pools) | {ns for n, ns in engines if n == nid}):
            speed = float(speeds.get(ns, 0.0))
            ledgers = []
            if (nid, ns) in engines:  # counted in tokens: one "block" is one token
                ledgers.append((engines[(nid, ns)], 1))
            if pools.get(ns, {}).get("value"):
                ledgers.append((pools[ns]["value"], int(pools[ns].get("block_tokens", 0))))
            for value, block_tokens in ledgers:
                worth = namespace_worth(value, block_tokens, speed)
                verdicts = namespace_verdicts(worth)
                for tier, spans in worth.items():
                    if not spans["total"].active:
                        continue
                    out.append({"node": nid, "namespace": ns, "tier": tier,
                                "prefill_tokens_per_s": speed,
                                "window_s": float(value.get("window_s", 0.0)),
                                **{span: spans[span].as_dict() for span in SPANS},
                                "verdict": verdicts[tier]})
    return out


def _span(w: Mapping[str, Any]) -> str:
    saved = "? s saved" if w["saved_s"] is None else f"{w['saved_s']:.3g} s saved"
    net = "" if w["net_s"] is None else f", net {w['net_s']:+.3g} s"
    return (f"{w['tokens']:,} tok ({w['hit_share']:.1%} of lookups), {saved}, "
            f"{w['write_s'] + w['read_s']:.3g} s spent "
            f"({format_bytes(w['bytes_in'])} in, {format_bytes(w['bytes_out'])} out){net}")


def value_lines(st: Mapping[str, Any]) -> list[str]:
    """``kvshare status``'s tier value lines: per node, namespace and tier the window and
    since-start figures, then one ``! reason: fix`` line per tier that does not pay."""
    out = []
    for r in value_rows(st):
        speed = (f"at {r['prefill_tokens_per_s']:,.0f} tok/s" if r["prefill_tokens_per_s"]
                 else "no prefill speed reported yet")
        out.append(f"value {r['node'][:12]} {r['namespace']}/{r['tier']} ({speed}): "
                   f"last {r['window_s']:.0f} s {_span(r['window'])}; since start "
                   f"{_span(r['total'])}")
        if r["verdict"]:
            out.append(f"  ! {r['verdict']}")
    return out
