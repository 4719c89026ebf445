"""Where a vLLM request's TTFT went inside the engine, per wave of the demo's requests.

vLLM's responses carry no timings, but its servers keep Prometheus histograms per request:
``vllm:request_queue_time_seconds`` (waiting for a slot in the running batch),
``vllm:request_prefill_time_seconds`` (scheduled to first token: the connector's KV load and the
prompt's computed part) and ``vllm:time_to_first_token_seconds`` (arrival to first token; what
it has beyond the other two is the request's way into the engine core, which takes new requests
only between two steps, so a request that arrives during another's long prefill step waits for
it, and the first token's way out).
:class:`EngineTimes` reads their sums and counts on every server after each wave of requests
(a wave ends only when all its requests have), so a wave's deltas are its requests' own; the
waves whose requests all reused nothing are the cold ones, those whose requests all reused a
prefix the warm ones. What the client measured minus the engine's TTFT is spent outside the
engine: the gateway, vLLM's API server (the request's way in, the first token's way out) and
the network.
"""

from __future__ import annotations

import time
from typing import Any

from kvshare.vllm.server.load import parse_metrics

HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "engine_ttft": "vllm:time_to_first_token_seconds",
}
_SERIES = frozenset(f"{name}_{kind}" for name in HISTOGRAMS.values() for kind in ("sum", "count"))
SETTLE_S = 0.3
"""How long after a wave vLLM's API server is given to record its last requests' stats."""


def read(endpoints: list[str]) -> dict[str, tuple[float, int]]:
    """``{part: (seconds summed, requests)}`` over the servers, for :data:`HISTOGRAMS`."""
    import httpx

    out = {k: (0.0, 0) for k in HISTOGRAMS}
    for url in endpoints:
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text, _SERIES)
        for part, name in HISTOGRAMS.items():
            s, n = out[part]
            out[part] = (s + m.get(f"{name}_sum", 0.0), n + int(m.get(f"{name}_count", 0.0)))
    return out


class EngineTimes:
    """Per-wave engine timings: call :meth:`start` before the first wave and pass
    :meth:`after_wave` to ``demo_common.drive``."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self._last: dict[str, tuple[float, int]] = {}
        self.waves: list[tuple[list[Any], dict[str, tuple[float, int]]]] = []

    def start(self) -> None:
        self._last = read(self.endpoints)

    def after_wave(self, turns: list[Any]) -> None:
        time.sleep(SETTLE_S)
        now = read(self.endpoints)
        delta = {k: (now[k][0] - self._last[k][0], now[k][1] - self._last[k][1]) for k in now}
        self._last = now
        self.waves.append((list(turns), delta))

    def table(self) -> str:
        """Mean milliseconds per request, cold vs warm waves, beside the client's TTFT."""
        groups: dict[str, list[tuple[list[Any], dict[str, tuple[float, int]]]]] = {
            "cold": [w for w in self.waves if all(t.reused_tokens == 0 for t in w[0])],
            "warm": [w for w in self.waves if all(t.reused_tokens > 0 for t in w[0])]}
        rows = [("queue (waiting for the batch)", "queue"),
                ("prefill (KV load + compute)", "prefill"), ("engine TTFT", "engine_ttft")]
        n = {g: sum(len(w[0]) for w in ws) for g, ws in groups.items()}
        lines = [f"inside vLLM (its histograms, mean ms){'':3s}cold ({n['cold']})  warm ({n['warm']})"]
        means: dict[str, dict[str, float]] = {g: {} for g in groups}
        for g, ws in groups.items():
            for _, key in rows:
                s = sum(w[1][key][0] for w in ws)
                c = sum(w[1][key][1] for w in ws)
                means[g][key] = s / c * 1e3 if c else float("nan")
            client = [t.ttft_s for w in ws for t in w[0]]
            means[g]["client"] = sum(client) / len(client) * 1e3 if client else float("nan")
        for g in groups:
            m = means[g]
            m["other"] = m["engine_ttft"] - m["queue"] - m["prefill"]
            m["outside"] = m["client"] - m["engine_ttft"]
        rows[2:2] = [("rest: into the engine core, out", "other")]
        rows += [("client TTFT", "client"), ("outside: gateway, API server, net", "outside")]
        for label, key in rows:
            lines.append(f"  {label:36s}{means['cold'][key]:9.1f}  {means['warm'][key]:9.1f}")
        mixed = len(self.waves) - len(groups["cold"]) - len(groups["warm"])
        if mixed:
            lines.append(f"  ({mixed} wave(s) of cold and warm requests together left out)")
        return "\n".join(lines)
