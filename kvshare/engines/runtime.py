"""The worker runtime: what every host of a reference worker does around the engine.

The HTTP server (:mod:`kvshare.engines.server`) and the Ray Serve deployment
(:mod:`kvshare.router.serve.app`) differ only in how requests arrive; both hand them to one
:class:`WorkerRuntime`, which

- admits a request (:meth:`WorkerRuntime.admit`): the prompt plus ``max_tokens`` fit the
  model's context, and forwarded block hashes are this worker's own hashes of those tokens
  (a mismatch means the router and the worker disagree on the model, layout or tenant salt:
  a 400, never a wrong answer);
- runs it (:meth:`WorkerRuntime.run`) one at a time, tracking the load it reports: prompt
  tokens admitted but not yet prefilled, requests in flight, prefill speed; it turns tokens
  into text (:class:`~kvshare.engines.text_out.TextOut`), ends at a ``stop`` string, at the
  request's deadline or when the host says the client went away;
- names its end (:meth:`WorkerRuntime.finish_reason`) and its text (:meth:`WorkerRuntime.text`);
- answers only after the request's blocks are stored (write-through completion ordering,
  bounded by ``store_wait_s``): with the pool publishing on commit, a client's next turn sent
  the moment this answer arrives finds this turn's blocks, on this node and on any other.

:class:`LoadReporter` registers the worker with the index and reports that load every
``interval_s`` (re-registering when the index forgot it); :func:`choose_cut` picks the cut
policy (``cost``: the cost model fitted to this engine; ``local``: this node's blocks only).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

from kvshare.client.sdk import CutPolicy, load_everything
from kvshare.cost import Source
from kvshare.cost_cut import CostCut
from kvshare.engines.hf import HFEngine
from kvshare.engines.openai_api import BadRequest, ParsedRequest
from kvshare.engines.text_out import TextOut
from kvshare.engines.worker import Completion, ReferenceWorker, RequestStats
from kvshare.types import WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad, WorkerRegistrar, epoch_base

log = logging.getLogger(__name__)

CUT_POLICIES = ("cost", "local", "all")


class LoadTracker:
    """Prompt tokens admitted but not yet prefilled, requests in flight, prefill speed, and
    the ``cache_epoch`` of this worker's start (:func:`~kvshare.workers.epoch_base`: a
    reference worker keeps no cache of its own to reset, so only a restart changes it).

    Prefills that computed fewer than ``min_speed_sample_tokens`` tokens do not move the
    speed (a router turns queued tokens into seconds with it; a 10-token prefill measures
    fixed costs, not speed).
    """

    def __init__(self, min_speed_sample_tokens: int = 0) -> None:
        self._lock = threading.Lock()
        self.min_speed_sample_tokens = min_speed_sample_tokens
        self.queued_prefill_tokens = 0
        self.running = 0
        self.prefill_tokens_per_s = 0.0
        self.cache_epoch = epoch_base()

    def admit(self, tokens: int) -> None:
        with self._lock:
            self.queued_prefill_tokens += tokens
            self.running += 1

    def prefilled(self, tokens: int, computed: int, seconds: float) -> None:
        with self._lock:
            self.queued_prefill_tokens -= tokens
            if computed > 0 and seconds > 0 and computed >= self.min_speed_sample_tokens:
                speed = computed / seconds
                old = self.prefill_tokens_per_s
                self.prefill_tokens_per_s = speed if old == 0 else 0.8 * old + 0.2 * speed

    def done(self) -> None:
        with self._lock:
            self.running -= 1

    def snapshot(self, worker_id: str) -> WorkerLoad:
        with self._lock:
            # one request runs at a time: the others in flight wait
            return WorkerLoad(WorkerId(worker_id), max(0, self.queued_prefill_tokens),
                              self.running, self.prefill_tokens_per_s, time.time(),
                              max(0, self.running - 1), cache_epoch=self.cache_epoch)

    def as_dict(self) -> dict[str, float]:
        """The current load as JSON-ready numbers."""
        with self._lock:
            return {"queued_prefill_tokens": max(0, self.queued_prefill_tokens),
                    "running": self.running, "prefill_tokens_per_s": self.prefill_tokens_per_s}


class WorkerRuntime:
    """Admission, execution and load tracking of one :class:`ReferenceWorker`.

    ``peer`` names who forwards hashes (``gateway``, ``ingress``) in the mismatch message.
    ``store_wait_s``: how long :meth:`run` waits for the request's stores before returning
    anyway (a slow pool delays the answer at most that long; the store goes on).
    Not re-entrant: hosts run :meth:`run` on one thread (the engine runs one request at a time).
    """

    def __init__(self, worker: ReferenceWorker, *, load: LoadTracker | None = None,
                 peer: str = "gateway", store_wait_s: float = 2.0) -> None:
        if store_wait_s < 0:
            raise ValueError(f"store_wait_s must be >= 0 seconds, got {store_wait_s}")
        self.store_wait_s = store_wait_s
        self.worker = worker
        self.engine = worker.engine
        self.load = load or LoadTracker()
        self.peer = peer
        self.eos = getattr(self.engine.tokenizer, "eos_id", -1)

    def admit(self, req: ParsedRequest) -> ParsedRequest:
        """BadRequest/ValueError naming the fix if ``req`` cannot run here; else it is counted
        as queued load and returned (a default ``max_tokens`` lowered to fit the context)."""
        context = self.engine.max_positions
        room = context - len(req.tokens)
        if req.max_tokens > room:
            if req.max_tokens_given or room < 1:
                raise BadRequest(
                    f"this model's context is {context} tokens: the prompt has "
                    f"{len(req.tokens)} and max_tokens asks for {req.max_tokens} more; send "
                    f"max_tokens <= {max(room, 0)}" + (" and a shorter prompt" if room < 1 else ""))
            req = dataclasses.replace(req, max_tokens=room)
        if req.hashes is not None:
            mine = self.engine.hashes(req.tokens, req.salt)
            if len(req.hashes) > len(mine) or list(req.hashes) != mine[: len(req.hashes)]:
                raise BadRequest(
                    f"kvshare.hashes_hex do not match this worker's hashes of token_ids: the "
                    f"{self.peer} and the worker disagree on the model, layout or tenant salt"
                )
        self.engine.check_tokens(req.tokens)
        self.load.admit(len(req.tokens))
        return req

    def run(self, req: ParsedRequest, on_delta: Callable[[str], None] | None = None,
            cancelled: Callable[[], bool] | None = None) -> Completion:
        """Generate for an admitted request; the load is settled however it ends.

        ``on_delta`` sees the text as it becomes safe to send (the last piece after generation
        ends); ``cancelled`` says the client went away. Generation ends at EOS, ``max_tokens``,
        a ``stop`` string (:attr:`Completion.ended` ``stop``), the request's deadline
        (``deadline``) or a cancel (``cancelled``). It returns once the request's stores are in
        the node's pool (at most ``store_wait_s`` later)."""
        prefilled = [False]
        out = TextOut(self.engine.tokenizer, req.stop, skip=(self.eos,))

        def on_prefill(s: RequestStats) -> None:
            prefilled[0] = True
            self.load.prefilled(len(req.tokens), s.computed_tokens, s.prefill_s)

        def on_token(t: int) -> None:
            delta = out.push(t)
            if delta and on_delta is not None:
                on_delta(delta)

        def should_stop() -> str:
            if out.stopped:
                return "stop"
            if req.deadline is not None and time.monotonic() >= req.deadline:
                return "deadline"
            return "cancelled" if cancelled is not None and cancelled() else ""

        try:
            stops = (self.eos,) if req.stop_eos and self.eos >= 0 else ()
            c = self.worker.generate(req.tokens, req.max_tokens, hashes=req.hashes,
                                     salt=req.salt, stop_ids=stops, on_token=on_token,
                                     on_prefill=on_prefill, should_stop=should_stop)
        finally:
            if not prefilled[0]:
                self.load.prefilled(len(req.tokens), 0, 0.0)
            self.load.done()
        rest = out.flush()
        if rest and on_delta is not None:
            on_delta(rest)
        c.text = out.text
        self._settle(c)
        return c

    def _settle(self, c: Completion) -> None:
        """Wait (up to ``store_wait_s`` in all) for ``c``'s stores to be in the node's pool."""
        t0 = time.perf_counter()
        deadline = t0 + self.store_wait_s
        for fut in c.stores:
            try:
                fut.result(timeout=max(0.0, deadline - time.perf_counter()))
            except FutureTimeout:
                self.worker.counters.add("store_wait_timeouts")
                break
            except Exception:  # noqa: BLE001 - a failed store is counted by the worker
                continue
        c.stats.store_wait_s = time.perf_counter() - t0

    def finish_reason(self, c: Completion, req: ParsedRequest) -> str:
        """``stop`` when generation ended on a stop string or on EOS (and the request stops
        there), else ``length`` (``max_tokens``, the context, or the request's deadline)."""
        if c.ended == "stop":
            return "stop"
        return "stop" if c.tokens and c.tokens[-1] == self.eos and req.stop_eos else "length"

    def text(self, c: Completion) -> str:
        """The completion's text, without EOS and without a stop string or what followed it."""
        if c.text is not None:
            return c.text
        return str(self.engine.tokenizer.decode([t for t in c.tokens if t != self.eos]))

    def client_counters(self) -> dict[str, float]:
        """The SDK's counters ({} without a client)."""
        counters = getattr(self.worker.client, "counters", None)
        return dict(counters) if isinstance(counters, dict) else {}


class LoadReporter:
    """Registers ``info`` with ``registrar`` and reports ``load`` every ``interval_s``
    (``registrar=None``: standalone, nothing to report to).

    A report answered False (the index restarted or let the lease expire) registers again;
    a failed call is counted in :attr:`errors`, logged and retried next tick: an index that
    is down never stops the worker. :meth:`stop` unregisters (best effort).
    """

    def __init__(self, registrar: WorkerRegistrar | None, info: WorkerInfo, load: LoadTracker,
                 interval_s: float = 0.1) -> None:
        if interval_s > 0.1:
            raise ValueError("report_interval_s must be <= 0.1 s (the worker lease renews on it)")
        self.registrar = registrar
        self.info = info
        self.load = load
        self.interval_s = interval_s
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvshare-load", daemon=True)

    @property
    def running(self) -> bool:
        """Whether the report thread runs (never without a registrar)."""
        return self._thread.is_alive()

    def start(self) -> None:
        if self.registrar is not None:  # standalone: no thread spinning on nothing
            self._thread.start()

    def _loop(self) -> None:
        registered = False
        while not self._stop.wait(self.interval_s if registered else 0.0):
            assert self.registrar is not None
            try:
                if not registered:
                    self.registrar.register_worker(self.info)
                    registered = True
                if self.registrar.report_load(self.load.snapshot(str(self.info.worker_id))) is False:
                    registered = False  # the index forgot us (restart, expiry): register again
            except Exception as exc:  # the index is advisory: keep serving, retry
                self.errors += 1
                registered = False
                log.debug("load report failed: %s", exc)
                self._stop.wait(self.interval_s)

    def stop(self, unregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if unregister and self.registrar is not None:
            try:
                self.registrar.unregister_worker(self.info.worker_id)
            except Exception as exc:
                log.debug("unregister failed: %s", exc)


def local_only(prompt_tokens: int, sources: Sequence[Source], holders: Sequence[str] = ()) -> int:
    """A cut policy reusing only this node's blocks (a replica's own node cache)."""
    n = 0
    for s in sources:
        if s.remote:
            break
        n += 1
    return n


def choose_cut(engine: HFEngine, policy: CutPolicy | str) -> CutPolicy:
    """The cut policy a worker runs: ``cost`` (the router's cost model fitted to ``engine``'s
    own prefill timings), ``local`` (this node's blocks only), ``all`` (every cached block)
    or a callable."""
    if callable(policy):
        return policy
    if policy == "cost":
        return CostCut(engine.layout, samples=calibrate(engine))
    if policy == "local":
        return local_only
    if policy == "all":
        return load_everything
    raise ValueError(f"cut_policy must be one of {CUT_POLICIES} or a callable, got {policy!r}")


def calibrate(engine: HFEngine, sizes: Sequence[int] = (128, 512, 1024)) -> list[tuple[float, float, float]]:
    """Prefill timings ``(new, cached, seconds)`` of a few cold prompts on ``engine``."""
    out = []
    for n in sizes:
        tokens = [(7 * i) % 256 for i in range(n)]
        pre = engine.prefill(tokens)
        out.append((float(pre.computed_tokens), 0.0, pre.seconds))
    return out
