"""Where a request's time to first token went, stage by stage.

A response that went through the gateway carries ``kvshare.breakdown``: seconds per stage,
gateway's first, then the worker's, in request order::

    parse     the gateway reading and checking the JSON body
    tokenize  the gateway's tokenizer (chat template applied)
    hash      chained block hashes of the prompt
    index     the index query (an actor call, or the router's own replica)
    score     the worker list, in-flight load and the policy's ranking of every candidate
    network   HTTP between gateway and worker: the gateway's upstream time minus the
              worker's own time for the request (both ways, body encode/decode included)
    receive   the worker reading the body, checking the hashes and admitting the request
    queue     waiting behind requests the worker runs before it (one at a time)
    lookup    the worker's index match and plan
    transfer  moving the planned blocks, per transport in ``transfer_by_transport``
              (batches run at once, so this is the longest, not the sum)
    copy      copying fetched blocks into the engine's KV memory
    prefill   computing the rest of the prompt
    first_token  the rest until the first token was produced (first decode step, buffers)

Workers that are not kvshare's own (vLLM) report no worker stages; the gateway's are there.
:func:`summary` prints cold vs warm medians (the demo calls it) and :func:`stack` draws them.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

GATEWAY_STAGES = ("parse", "tokenize", "hash", "index", "score", "network")
WORKER_STAGES = ("receive", "queue", "lookup", "transfer", "copy", "prefill", "first_token")
STAGES = GATEWAY_STAGES + WORKER_STAGES
"""Every stage, in request order (the keys of ``kvshare.breakdown``, in seconds)."""

Breakdown = Mapping[str, Any]
"""``{stage: seconds, ..., "transfer_by_transport": {transport: seconds}}``."""


def breakdown_of(stats: Any) -> dict[str, Any]:
    """A worker's part of the breakdown from its
    :class:`~kvshare.engines.worker.RequestStats` (``ttft_s`` runs from the start of the
    engine's work, lookup on, to the first token, so ``first_token`` is what lookup, load and
    prefill leave of it)."""
    by_transport = {k: float(v) for k, v in stats.transfer_s.items()}
    transfer = max(by_transport.values(), default=0.0)
    load_rest = max(0.0, stats.load_s - transfer - stats.copy_s)  # staging, bookkeeping
    first = stats.ttft_s - stats.lookup_s - stats.load_s - stats.prefill_s
    return {"receive": max(0.0, stats.receive_s), "queue": max(0.0, stats.queue_s),
            "lookup": stats.lookup_s, "transfer": transfer, "copy": stats.copy_s + load_rest,
            "prefill": stats.prefill_s, "first_token": max(0.0, first),
            "transfer_by_transport": by_transport}


def total(b: Breakdown) -> float:
    """The stages' sum (about the TTFT the gateway saw, without the client's network)."""
    return float(sum(float(b.get(s, 0.0)) for s in STAGES))


def medians(breakdowns: Sequence[Breakdown]) -> dict[str, float]:
    """Median seconds per stage over ``breakdowns`` (stages nobody reported are left out)."""
    out: dict[str, float] = {}
    for s in STAGES:
        values = [float(b[s]) for b in breakdowns if s in b]
        if values:
            out[s] = statistics.median(values)
    return out


def summary(groups: Mapping[str, Sequence[Breakdown]]) -> str:
    """A table of median milliseconds per stage, one column per group (e.g. cold, warm)."""
    cols = {name: medians(bs) for name, bs in groups.items()}
    head = "TTFT breakdown (median ms)" + "".join(
        f"  {f'{n} ({len(groups[n])})':>14s}" for n in cols)
    lines = [head]
    for s in STAGES:
        if any(s in c for c in cols.values()):
            lines.append(f"  {s:24s}" + "".join(
                f"  {c[s] * 1e3:14.1f}" if s in c else f"  {'-':>14s}" for c in cols.values()))
    lines.append(f"  {'sum of stages':24s}" + "".join(
        f"  {sum(c.values()) * 1e3:14.1f}" for c in cols.values()))
    return "\n".join(lines)


def stack(ax: Any, labels: Sequence[str], breakdowns: Sequence[Breakdown]) -> None:
    """Draw ``breakdowns`` as stacked bars (milliseconds, one colour per stage) on a
    matplotlib ``ax``; ``labels`` name the bars."""
    bottoms = [0.0] * len(breakdowns)
    xs = list(range(len(breakdowns)))
    for s in STAGES:
        heights = [float(b.get(s, 0.0)) * 1e3 for b in breakdowns]
        if any(heights):
            ax.bar(xs, heights, bottom=bottoms, label=s)
            bottoms = [a + h for a, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(xs, list(labels))
    ax.set_ylabel("ms")
    ax.legend(fontsize="small")
