"""The gateway's part of a request's TTFT breakdown, and how it joins the worker's answer.

The gateway times its own stages (``parse``, and the router's ``tokenize``/``hash``/``index``/
``score`` in :attr:`~router.embed.Routed.timings`) and the upstream call; the worker's reply
carries its stages and ``worker_s``, its own time for the request. ``network`` is the
difference. The joined breakdown (:mod:`kvshare.breakdown`) replaces ``kvshare.breakdown`` in
the reply: in the JSON body, or in the last server-sent event that carries ``kvshare``.
A reply without a ``kvshare`` object (a vLLM server) gets one with the gateway's stages when
it is JSON; a stream without one is passed on unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvshare.breakdown import STAGES


def joined(gateway: Mapping[str, float], upstream_s: float, kv: Any) -> dict[str, Any]:
    """The gateway's stages, ``network`` (when the worker said how long it took) and the
    worker's stages, in :data:`~kvshare.breakdown.STAGES` order."""
    parts: dict[str, Any] = dict(gateway)
    worker = kv.get("breakdown") if isinstance(kv, Mapping) else None
    worker_s = kv.get("worker_s") if isinstance(kv, Mapping) else None
    if isinstance(worker_s, int | float):
        parts["network"] = max(0.0, upstream_s - float(worker_s))
    else:
        parts["upstream"] = upstream_s  # not a kvshare worker: its time is all one stage
    if isinstance(worker, Mapping):
        parts.update({k: v for k, v in worker.items() if k not in parts})
    order = {s: i for i, s in enumerate(STAGES)}
    return dict(sorted(parts.items(), key=lambda kv_: order.get(kv_[0], len(order))))


def observe(histogram: Any, breakdown: Mapping[str, Any]) -> None:
    """One observation per stage into a Prometheus histogram labelled by ``stage``."""
    for stage in STAGES:
        value = breakdown.get(stage)
        if isinstance(value, int | float):
            histogram.labels(stage).observe(float(value))


def json_reply(data: dict[str, Any], gateway: Mapping[str, float],
               upstream_s: float) -> dict[str, Any]:
    """``data`` (a parsed JSON reply) with the joined breakdown in its ``kvshare`` object;
    returns the breakdown."""
    kv = data.get("kvshare")
    if not isinstance(kv, dict):
        kv = data["kvshare"] = {}
    breakdown = joined(gateway, upstream_s, kv)
    kv["breakdown"] = breakdown
    return breakdown


def stream_tail(tail: bytes, gateway: Mapping[str, float],
                upstream_s: float) -> tuple[bytes, dict[str, Any] | None]:
    """The stream's end (from the event carrying ``kvshare`` on) with the joined breakdown
    in that event; unchanged (and None) when no such event parses."""
    events = tail.split(b"\n\n")
    for i in range(len(events) - 1, -1, -1):
        line = events[i].strip()
        if not (line.startswith(b"data: {") and b'"kvshare"' in line):
            continue
        try:
            data = json.loads(line[6:])
        except ValueError:
            return tail, None
        if not isinstance(data, dict) or not isinstance(data.get("kvshare"), dict):
            return tail, None
        breakdown = json_reply(data, gateway, upstream_s)
        events[i] = b"data: " + json.dumps(data).encode()
        return b"\n\n".join(events), breakdown
    return tail, None
