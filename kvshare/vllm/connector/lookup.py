"""The connector's lookups: run concurrently, and held only while they could still pay.

vLLM asks the connector how many tokens the cluster brings before it schedules a request;
the answer needs the index (an actor call that, on a busy machine, can take seconds). Two
rules keep that from stalling requests:

- **Concurrent**: lookups run on ``threads`` threads (:class:`Lookups`), so one slow answer
  does not hold every request queued behind it.
- **Waits scaled to the step**: answering "ask again" costs the request a whole engine step
  (vLLM asks once a step), so on an engine whose steps are slow (a loaded CPU engine: seconds)
  the scheduler waits for a lookup in flight up to ``STEP_SHARE`` of a step
  (:meth:`Lookups.wait_s`, at most ``MAX_WAIT_S``): a tenth of a step held once, instead of a
  whole step lost by the request. On a fast engine the floor (``lookup_wait_s``) stands.
- **Priced hold**: a request is held for its lookup only while the lookup could still save
  more than the wait costs. The most it can save is the prefill of the tokens it could bring
  beyond vLLM's own hit, at the engine's measured speed (:class:`StepSpeed`, tokens per second
  over the engine's busy steps); once the request has waited that long, even a full hit
  cannot make it start sooner than computing now, so the lookup is *abandoned*: the request
  is scheduled as a miss (never an error), and the late answer only tells which of its blocks
  the cluster already holds (not stored again). Until the speed is measured (the first busy
  steps) a lookup is held up to the index deadline, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

STEP_SHARE = 0.1
"""The share of an engine step the scheduler may wait for a lookup in flight."""
MAX_WAIT_S = 0.25
"""The longest the scheduler waits for one lookup in flight, however slow the steps."""


class StepSpeed:
    """The engine's tokens per second over consecutive busy steps (an exponential average).

    :meth:`step` is called once per scheduler step with the requests scheduled in it and their
    tokens. The interval between two steps counts only when a request scheduled in the first
    is scheduled again in the second (the engine worked through it without going idle), so an
    idle gap between bursts never reads as a slow engine.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.tokens_per_s = 0.0  # 0: not measured yet
        self.step_s = 0.0  # seconds a busy step takes (0: not measured yet)
        self._last: tuple[float, int, frozenset[str]] | None = None

    def step(self, scheduled: dict[str, int], now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, (now, sum(scheduled.values()), frozenset(scheduled))
        if last is None or not scheduled or not last[1] or last[2].isdisjoint(scheduled):
            return
        dt = now - last[0]
        if dt <= 0:
            return
        sample = last[1] / dt
        old = self.tokens_per_s
        self.tokens_per_s = sample if old == 0 else (1 - self.alpha) * old + self.alpha * sample
        self.step_s = dt if self.step_s == 0 else (1 - self.alpha) * self.step_s + self.alpha * dt

    def seconds_for(self, tokens: int) -> float | None:
        """Seconds to compute ``tokens`` at the measured speed; None while unmeasured."""
        return tokens / self.tokens_per_s if self.tokens_per_s > 0 else None


class Lookups:
    """Lookups on a pool of ``threads`` threads, and the priced hold (module docstring)."""

    def __init__(self, threads: int = 4, *, priced: bool = True,
                 speed: StepSpeed | None = None) -> None:
        if threads < 1:
            raise ValueError(f"lookup threads must be >= 1, got {threads}")
        self.priced = priced
        self.speed = speed or StepSpeed()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvshare-lookup")

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._pool.submit(fn, *args)

    def worth_waiting(self, held_s: float, could_bring: int) -> bool:
        """Whether a request held ``held_s`` for a lookup that could bring at most
        ``could_bring`` tokens should wait on: its prefill at the measured speed is longer
        than the wait so far (always, unpriced or unmeasured)."""
        if not self.priced:
            return True
        saving = self.speed.seconds_for(could_bring)
        return saving is None or held_s < saving

    def wait_s(self, floor_s: float) -> float:
        """How long the scheduler waits for a lookup in flight before answering "ask again":
        ``STEP_SHARE`` of the engine's measured step, at least ``floor_s``, at most
        ``MAX_WAIT_S`` (module docstring)."""
        return max(floor_s, min(MAX_WAIT_S, STEP_SHARE * self.speed.step_s))

    def step(self, scheduled: dict[str, int]) -> None:
        self.speed.step(scheduled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
