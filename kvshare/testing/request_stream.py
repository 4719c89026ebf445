"""A steady stream of completions through a gateway, and what a fault did to it.

Used by the partition test (``tests/kvshare/vllm/test_vllm_hosts.py``) and
``benchmarks/partition.py``: :class:`RequestStream` sends greedy completions from a few client
threads, round-robin over prompts whose recomputed answers are known, and records each
:class:`Outcome`; :class:`Membership` follows which workers the index lists; :func:`decisions`
records every routing decision of a router; :func:`summary` turns them into the counts a
partition is judged by (requests, 5xx, wrong answers, latency against the deadline, decisions
for the cut host's worker while its lease had lapsed, seconds until it served again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Outcome:
    """One request: ``time.monotonic()`` when sent and answered, the status (0: no HTTP
    answer), the answer's text (None unless 200), the worker and tries the gateway named."""

    prompt: int
    start: float
    end: float
    status: int
    text: str | None
    worker: str
    tries: int
    error: str = ""

    @property
    def latency_s(self) -> float:
        return self.end - self.start


class RequestStream:
    """``clients`` threads sending ``POST {url}/v1/completions`` (greedy, ``max_tokens``,
    the gateway's ``deadline_s``) one after another, round-robin over ``prompts``, from
    :meth:`start` until :meth:`stop`; the client waits ``deadline_s`` + ``slack_s`` at most."""

    def __init__(self, url: str, model: str, prompts: Sequence[str], *, clients: int = 2,
                 max_tokens: int = 4, deadline_s: float = 20.0, slack_s: float = 10.0) -> None:
        self.url, self.model, self.prompts = url, model, list(prompts)
        self.clients, self.max_tokens = clients, max_tokens
        self.deadline_s, self.slack_s = deadline_s, slack_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next = 0

    def start(self) -> RequestStream:
        for _ in range(self.clients):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.deadline_s + self.slack_s + 5)
        with self._lock:
            return sorted(self.outcomes, key=lambda o: o.start)

    def add(self, prompts: Sequence[str]) -> None:
        """Send ``prompts`` too from now on (their :attr:`Outcome.prompt` indices follow the
        ones given so far)."""
        with self._lock:
            self.prompts.extend(prompts)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def _pick(self) -> int:
        with self._lock:
            i, self._next = self._next % len(self.prompts), self._next + 1
            return i

    def _run(self) -> None:
        with httpx.Client(timeout=self.deadline_s + self.slack_s) as http:
            while not self._stop.is_set():
                i = self._pick()
                body = {"model": self.model, "prompt": self.prompts[i], "temperature": 0,
                        "max_tokens": self.max_tokens, "deadline_s": self.deadline_s}
                t0 = time.monotonic()
                try:
                    r = http.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    out = Outcome(i, t0, time.monotonic(), 0, None, "", 0, repr(exc))
                else:
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
                    out = Outcome(i, t0, time.monotonic(), r.status_code, text,
                                  r.headers.get("x-kvshare-worker", ""),
                                  int(r.headers.get("x-kvshare-tries", "0") or 0),
                                  "" if r.status_code == 200 else r.text[:300])
                with self._lock:
                    self.outcomes.append(out)


@dataclass
class Membership:
    """Which workers ``list_workers()`` names, polled every ``every_s`` in a thread; the
    changes, as ``(time.monotonic(), frozenset of worker ids)``."""

    list_workers: Callable[[], Sequence[Any]]
    every_s: float = 0.05
    changes: list[tuple[float, frozenset[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Membership:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        last: frozenset[str] | None = None
        while not self._stop.is_set():
            now: frozenset[str] | None
            try:
                now = frozenset(str(w.worker_id) for w in self.list_workers())
            except Exception:  # the index is a hint; a failed poll changes nothing
                now = last
            if now is not None and now != last:
                self.changes.append((time.monotonic(), now))
                last = now
            self._stop.wait(self.every_s)

    def gone_and_back(self, worker: str, after: float) -> tuple[float | None, float | None]:
        """When ``worker`` was first missing after ``after``, and first listed again after that."""
        gone = back = None
        for t, ids in self.changes:
            if t < after:
                continue
            if gone is None and worker not in ids:
                gone = t
            elif gone is not None and worker in ids:
                back = t
                break
        return gone, back


def decisions(router: Any) -> list[tuple[float, str]]:
    """From now on, every decision ``router`` (a ``CacheAwareRouter``) makes is appended to
    the returned list as ``(time.monotonic(), worker)``; retries of the gateway included."""
    log: list[tuple[float, str]] = []
    route = router.route

    async def logged(*args: Any, **kwargs: Any) -> Any:
        routed = await route(*args, **kwargs)
        log.append((time.monotonic(), str(routed.decision.worker)))
        return routed

    router.route = logged
    return log


def summary(outcomes: Sequence[Outcome], expected: Sequence[str], *, deadline_s: float,
            cut_at: float, up_at: float, cut_worker: str, lapsed_at: float | None,
            listed_again_at: float | None, routed: Sequence[tuple[float, str]],
            settle_s: float = 1.0, served_again_by: Collection[str] = ()) -> dict[str, Any]:
    """The counts a partition is judged by. ``routed_to_cut_while_lapsed``: decisions for
    ``cut_worker`` from ``settle_s`` after its lease lapsed (the routers' worker lists refresh
    at their own pace) until it was listed again; ``recover_s``: from the link's return to the
    end of the first answer ``cut_worker`` (or one of ``served_again_by``: its replacement)
    gave to a request sent after that."""
    ok = [o for o in outcomes if o.status == 200]
    wrong = [o for o in ok if o.text != expected[o.prompt]]
    until = listed_again_at if listed_again_at is not None else float("inf")
    bad_routes = ([t for t, w in routed if w == cut_worker and lapsed_at + settle_s <= t < until]
                  if lapsed_at is not None else [])
    back = {cut_worker, *served_again_by}
    served_again = [o.end for o in ok if o.worker in back and o.start >= up_at]
    during = [o for o in outcomes if o.start < up_at and o.end > cut_at]
    return {
        "requests": len(outcomes),
        "status_5xx": sum(1 for o in outcomes if o.status >= 500),
        "failed": sum(1 for o in outcomes if o.status != 200),
        "wrong": len(wrong),
        "max_latency_s": round(max((o.latency_s for o in outcomes), default=0.0), 3),
        "over_deadline": sum(1 for o in outcomes if o.latency_s > deadline_s),
        "during_cut": len(during),
        "retried": sum(1 for o in ok if o.tries > 1),
        "served_by_cut_host": sum(1 for o in ok if o.worker == cut_worker),
        "lease_lapsed_after_s": None if lapsed_at is None else round(lapsed_at - cut_at, 3),
        "listed_again_after_up_s": (None if listed_again_at is None
                                    else round(listed_again_at - up_at, 3)),
        "routed_to_cut_while_lapsed": len(bad_routes),
        "recover_s": round(min(served_again) - up_at, 3) if served_again else None,
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }
