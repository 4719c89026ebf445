"""The gateway's part of a request's TTFT breakdown, and how it joins the worker's answer.

The gateway times its own stages (``parse``, and the router's ``tokenize``/``hash``/``index``/
``score`` in :attr:`~kvshare.router.core.embed.Routed.timings`) and the upstream call; the worker's reply
carries its stages and ``worker_s``, its own time for the request. ``network`` is the
difference. The joined breakdown (:mod:`kvshare.breakdown`) replaces ``kvshare.breakdown`` in
the reply: in the JSON body, or in the last server-sent event that carries ``kvshare``.
A reply without a ``kvshare`` object (a vLLM server) gets one with the gateway's stages and
``upstream`` (the worker's whole time, network included) when it is JSON. Every streamed answer
carries the gateway's stages in the header ``x-kvshare-breakdown`` (:func:`header`), with
``upstream`` = the wait for the worker's first chunk; a vLLM stream's usage event (asked for
with ``stream_options.include_usage``: the one event with ``"choices":[]``) gets the same
in a ``kvshare`` object (:func:`usage_events`); otherwise a vLLM stream is passed on unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvshare.breakdown import STAGES

UPSTREAM = "upstream"
"""The stage of a worker that reports none of its own (vLLM): the gateway's wait for it."""
_USAGE_EVENT = b'"choices":[]'  # vLLM's usage event (pydantic's compact JSON)


def joined(gateway: Mapping[str, float], upstream_s: float, kv: Any) -> dict[str, Any]:
    """The gateway's stages, ``network`` (when the worker said how long it took) and the
    worker's stages, in :data:`~kvshare.breakdown.STAGES` order."""
    parts: dict[str, Any] = dict(gateway)
    worker = kv.get("breakdown") if isinstance(kv, Mapping) else None
    worker_s = kv.get("worker_s") if isinstance(kv, Mapping) else None
    if isinstance(worker_s, int | float):
        parts["network"] = max(0.0, upstream_s - float(worker_s))
    else:
        parts[UPSTREAM] = upstream_s  # not a kvshare worker: its time is all one stage
    if isinstance(worker, Mapping):
        parts.update({k: v for k, v in worker.items() if k not in parts})
    order = {s: i for i, s in enumerate(STAGES)}
    return dict(sorted(parts.items(), key=lambda kv_: order.get(kv_[0], len(order))))


def observe(histogram: Any, breakdown: Mapping[str, Any]) -> None:
    """One observation per stage (and ``upstream``) into a Prometheus histogram labelled by
    ``stage``."""
    for stage in (*STAGES, UPSTREAM):
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


def stream_stages(gateway: Mapping[str, float], first_s: float) -> dict[str, float]:
    """A stream's breakdown as the gateway knows it when the worker's first chunk arrives:
    its own stages and ``upstream`` (``first_s``: from sending to that chunk)."""
    return {**gateway, UPSTREAM: first_s}


def header(stages: Mapping[str, float]) -> str:
    """``stages`` as the ``x-kvshare-breakdown`` header: compact JSON, seconds."""
    return json.dumps({k: round(v, 6) for k, v in stages.items()}, separators=(",", ":"))


def usage_events(events: bytes, stages: Mapping[str, float]) -> bytes:
    """Complete server-sent ``events`` with ``kvshare.breakdown`` = ``stages`` added to a
    vLLM usage event (``"choices":[]``) among them; anything else passes unchanged."""
    if _USAGE_EVENT not in events:
        return events
    out = events.split(b"\n\n")
    for i, event in enumerate(out):
        line = event.strip()
        if not (line.startswith(b"data: {") and _USAGE_EVENT in line):
            continue
        try:
            data = json.loads(line[6:])
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("choices") == [] and "kvshare" not in data:
            data["kvshare"] = {"breakdown": dict(stages)}
            out[i] = b"data: " + json.dumps(data).encode()
    return b"\n\n".join(out)
