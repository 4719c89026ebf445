"""The prefill work an engine has queued, counted exactly by the connector's scheduler side.

vLLM exports no count of prompt tokens still to compute; from its gauges and histograms a load
report can only guess (each request in prefill at the *mean* tokens of the finished ones: three
cold prompts of 6.4k tokens in all read as about 1k). The scheduler side sees every request the
scheduler looks at (``get_num_new_matched_tokens``: its tokens, what vLLM's cache and the
cluster bring), every step's scheduled tokens and every finish, so it keeps, per request, the
tokens it still has to compute before its first token:

- set when the scheduler asks about a request (:meth:`PrefillBacklog.seen`): its tokens less
  those computed and those the connector brings (all but the computed ones while its lookup
  runs);
- less each step's scheduled tokens (:meth:`PrefillBacklog.step`: vLLM's stats leave at the
  end of that step, when they are computed); gone at 0, at its finish or abort, and at a
  preemption (it is recomputed when the scheduler takes it up again and asks about it anew).

So the counts vLLM's stats carry at the end of a step hold every request the engine had when
that step was scheduled (``backlog_as_of_seconds``, wall clock), and none that arrived during
it (vLLM adds them after the step): on a CPU a step of ``max_num_batched_tokens`` lasts
seconds, so a router counts its own requests sent after that time on top
(:class:`kvshare.router.core.workers_view.InFlight`, :attr:`kvshare.workers.WorkerLoad.as_of`), not only
those sent after the scrape.

How fast the backlog drains is counted the same way, exactly: the backlog tokens each step
scheduled (``backlog_drained_tokens``) and the step's seconds (``backlog_drain_seconds``), for
every step that scheduled backlog tokens and one of whose requests was still there when the
next step was scheduled (not finished, aborted or preempted in between): the engine then went
straight on to that step, so the time to it is this step's run (its decode tokens included:
what a queued prompt really waits behind). A step all of whose requests ended is left out,
tokens and time (an idle gap may follow it), as is one that scheduled no backlog tokens
(decode only, or waiting on loads). A load report divides the backlog by that rate
(:class:`kvshare.vllm.server.load.DrainSpeed`) instead of guessing a speed from when requests
finished.

vLLM's stats path carries counters (deltas summed over steps), so each count leaves as two
cumulative counters, added and removed (``backlog_tokens_added`` / ``_removed``,
``backlog_waiting_added`` / ``_removed``: requests seen and not yet scheduled a token; the
count is ``added - removed``), and the time as a counter whose value is the time
(``backlog_as_of_seconds``: each step adds the seconds since the last). A request the scheduler
has not reached yet (a step's token budget ran out before it) is not counted: the load report
prices the rest of vLLM's waiting requests (``num_requests_waiting`` less the seen ones).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

COUNTERS = ("backlog_tokens_added", "backlog_tokens_removed",
            "backlog_waiting_added", "backlog_waiting_removed", "backlog_as_of_seconds",
            "backlog_drained_tokens", "backlog_drain_seconds")


class PrefillBacklog:
    """Per request: tokens still to compute before its first token, and whether it has been
    scheduled yet; kept as the cumulative counters :data:`COUNTERS` (:attr:`counters`).

    Called from vLLM's scheduler thread only; :attr:`counters` may be read from another."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._left: dict[str, int] = {}
        self._waiting: set[str] = set()
        self._lock = threading.Lock()
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        # the last step, if it scheduled backlog tokens: its time, those tokens, and its
        # requests not gone since (module docstring)
        self._draining: tuple[float, int, set[str]] | None = None

    @property
    def tokens(self) -> int:
        """Tokens the seen requests still have to compute."""
        return sum(self._left.values())

    @property
    def waiting(self) -> int:
        """Seen requests not yet scheduled a token."""
        return len(self._waiting)

    def seen(self, rid: str, left: int) -> None:
        """The scheduler asked about ``rid``: it has ``left`` tokens to compute (replacing what
        was counted for it: asked again, its lookup has answered since)."""
        with self._lock:
            self._set(rid, max(0, left))
            if rid in self._left and rid not in self._waiting:
                self._waiting.add(rid)
                self.counters["backlog_waiting_added"] += 1

    def step(self, scheduled: dict[str, int]) -> None:
        """A step scheduled ``scheduled[rid]`` tokens per request: off the backlog (they are
        computed by the time vLLM's stats for the step leave); the step's time is the count's
        ``backlog_as_of_seconds``, and it ends the last step's run (module docstring)."""
        with self._lock:
            now = self._clock()
            last, self._draining = self._draining, None
            if last is not None and last[2]:  # the last step ran until now (module docstring)
                self.counters["backlog_drain_seconds"] += max(0.0, now - last[0])
                self.counters["backlog_drained_tokens"] += last[1]
            drained = 0
            for rid, n in scheduled.items():
                left = self._left.get(rid)
                if left is not None:
                    self._unwait(rid)
                    drained += min(left, max(0, int(n)))
                    self._set(rid, left - int(n))
            if drained:
                self._draining = (now, drained, set(scheduled))
            self.counters["backlog_as_of_seconds"] = max(
                self.counters["backlog_as_of_seconds"], now)

    def gone(self, rid: str) -> None:
        """``rid`` finished, was aborted or preempted: nothing of it is counted any more."""
        if self._draining is not None:
            self._draining[2].discard(rid)
        if rid in self._left:
            with self._lock:
                self._set(rid, 0)

    def _unwait(self, rid: str) -> None:
        if rid in self._waiting:
            self._waiting.discard(rid)
            self.counters["backlog_waiting_removed"] += 1

    def _set(self, rid: str, left: int) -> None:
        old = self._left.get(rid, 0)
        if left > 0:
            self._left[rid] = left
        else:
            left = 0
            self._left.pop(rid, None)
            self._unwait(rid)  # (a request with nothing to compute waits on nothing)
        if left > old:
            self.counters["backlog_tokens_added"] += left - old
        elif old > left:
            self.counters["backlog_tokens_removed"] += old - left
