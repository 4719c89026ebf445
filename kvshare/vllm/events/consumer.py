"""KV-events consumer: vLLM's prefix cache, re-hashed into share blocks, as the worker's gpu tier.

::

    consumer = KVEventsConsumer(EventsConfig(endpoint="ipc:///run/w0/ev.sock", ...), sink)
    consumer.start()        # a thread: ZMQ SUB -> share blocks -> index (location worker:<id>)
    ...
    consumer.stop()

One thread owns the ZMQ sockets: it receives ``[topic, seq, payload]`` frames from vLLM's
publisher (:mod:`kvshare.vllm.events.wire`), turns page events into share-block changes
(:class:`~kvshare.vllm.events.share_blocks.ShareBlocks`, per KV-cache group:
:class:`~kvshare.vllm.events.groups.GroupedShareBlocks`) and publishes them in Arrow batches to the
index under the worker's current generation (:class:`~kvshare.vllm.server.presence.Presence`).

Rules:

- **Gaps** in ``seq`` are filled from the replay socket (a DEALER request ``["", start_seq]``;
  the publisher streams buffered batches and ends with seq -1). A gap that cannot be filled
  (no replay endpoint, replay timed out, batches already gone) is resynced to empty: the
  consumer forgets every page and fences a new generation, so the index never keeps an entry
  that vLLM might have evicted meanwhile; new events rebuild it.
- **Fencing**: a publisher that goes away (ZMQ monitor: disconnected), a new publisher, or a
  ``seq`` that goes back (an engine restarted on the same endpoint starts again at 0) ends
  the incarnation: its entries are dropped from the index at once (new generation) before any
  event of the next one is applied. A lost lease does the same (the presence re-registers).
- **Bad input**: a payload that does not decode is counted (``malformed``) and skipped; event
  types this consumer does not know are counted (``unknown_events``) and ignored. Neither stops
  the thread. An index that cannot be reached is counted and resynced once it answers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvshare.events import BlockStored, EventKind, event_schema, events_to_arrow
from kvshare.hasher import Hasher
from kvshare.types import Location
from kvshare.vllm.events.groups import GroupedShareBlocks
from kvshare.vllm.events.share_blocks import Change
from kvshare.vllm.events.wire import (
    AllPagesCleared,
    MalformedEvents,
    PageEvent,
    PagesRemoved,
    PagesStored,
    decode_batch,
    decode_seq,
)
from kvshare.vllm.server.presence import Presence
from kvshare.workers import epoch_base

log = logging.getLogger(__name__)

END_SEQ = -1
_REMOVED, _STORED = int(EventKind.REMOVED), int(EventKind.STORED)


@dataclass(frozen=True)
class EventsConfig:
    """Where vLLM publishes and how its pages become share blocks.

    ``endpoint`` / ``replay_endpoint``: vLLM's ``--kv-events-config`` endpoints (the consumer
    connects; vLLM must bind: ``ipc://`` or ``tcp://*:PORT``). ``page_tokens``: vLLM's
    ``--block-size``; ``block_tokens``: the namespace's share block (a multiple of it).
    ``batch_window_s``: how long the thread gathers frames before one index publish.
    """

    endpoint: str
    namespace: str
    block_tokens: int
    page_tokens: int
    replay_endpoint: str | None = None
    topic: str = ""
    batch_window_s: float = 0.005
    replay_timeout_s: float = 2.0
    hash_size: int = 32

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"endpoint {self.endpoint!r} must be an ipc://, tcp:// or inproc:// URL")
        if self.endpoint.startswith("tcp://") and "*" in self.endpoint:
            raise ValueError("endpoint is what the consumer connects to: give the host, not '*'")
        if self.page_tokens <= 0 or self.block_tokens % self.page_tokens:
            raise ValueError(
                f"block_tokens {self.block_tokens} must be a multiple of vLLM's block size "
                f"{self.page_tokens}"
            )
        if self.batch_window_s < 0 or self.replay_timeout_s <= 0:
            raise ValueError("batch_window_s must be >= 0 and replay_timeout_s > 0 seconds")


class KVEventsConsumer:
    """Subscribe to one vLLM engine's KV events; keep its gpu tier in the index."""

    def __init__(self, config: EventsConfig, presence: Presence,
                 hasher: Hasher,
                 context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self.presence = presence
        if hasher.block_tokens != config.block_tokens:
            raise ValueError(f"the hasher cuts {hasher.block_tokens}-token blocks, the namespace "
                             f"{config.block_tokens}: build both from the same layout")
        self.blocks = GroupedShareBlocks(hasher, config.page_tokens)
        self._ctx = context or zmq.Context.instance()
        self._sub: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._expected: int | None = None  # next vLLM seq; None: take whatever comes
        self._gen = 0  # generation our published events carry
        self._epoch_base = epoch_base()  # (cache_epoch: this consumer's start)
        self._seq = 0  # our last published seq under _gen
        self._pending: list[tuple[int, str, bytes]] = []  # (kind, tier, hash) to publish
        self._dirty = True  # the index must get our whole inventory (start, resync, errors)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.last_applied_ts = 0.0
        self.counters = dict.fromkeys(
            ("frames", "events", "page_hashes", "malformed", "unknown_events", "gaps",
             "replayed", "replay_failures", "resyncs", "fences", "disconnects",
             "published", "publish_errors", "inventories", "clears"), 0)

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Connect the SUB socket (and its monitor); :meth:`start` calls it."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.LINGER, 0)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.config.endpoint)
        self._sub = sub

    def start(self) -> KVEventsConsumer:
        self.open()
        self._thread = threading.Thread(target=self._run, name="kvshare-vllm-events", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.close()

    def close(self) -> None:
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(0.05)
            except Exception:  # one bad round must not stop the consumer
                log.exception("KV events round failed; continuing")
                self._stop.wait(0.05)

    # ------------------------------------------------------------------ one round
    def poll(self, timeout_s: float) -> int:
        """Receive for up to ``timeout_s`` (then ``batch_window_s`` more once frames flow),
        apply, publish. Returns the number of frames handled. Runs on the consumer thread (or
        the caller's, when not started)."""
        assert self._sub is not None and self._monitor is not None, "call open() or start() first"
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        gen = self.presence.generation
        if gen != self._gen:
            self._adopt(gen)
        n = 0
        deadline = None
        wait_ms = int(timeout_s * 1000)
        while True:
            ready = dict(poller.poll(wait_ms))
            if self._monitor in ready:
                self._on_monitor()
            if self._sub in ready:
                while n < 4096:
                    try:
                        frames = self._sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
                    n += 1
            if not ready:
                break
            if deadline is None:
                deadline = time.monotonic() + self.config.batch_window_s
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if wait_ms == 0 or n >= 4096:
                break
        self.flush()
        return n

    def _on_monitor(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                msg = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                self.counters["disconnects"] += 1
                self.fence("publisher disconnected")
            elif msg["event"] == zmq.EVENT_CONNECTED and self._expected is not None:
                self.fence("a new publisher connected")

    def _on_frames(self, frames: list[bytes]) -> None:
        self.counters["frames"] += 1
        if len(frames) != 3:
            self.counters["malformed"] += 1
            return
        try:
            seq = decode_seq(frames[1])
        except MalformedEvents:
            self.counters["malformed"] += 1
            return
        if self._expected is not None and seq < self._expected:
            self.fence(f"seq went back from {self._expected - 1} to {seq} (engine restarted)")
        if self._expected is None and seq > 0 or (self._expected is not None and seq > self._expected):
            self._fill_gap(self._expected or 0, seq)
        self._apply_payload(frames[2])
        self._expected = seq + 1

    def _apply_payload(self, payload: bytes) -> None:
        try:
            ts, events = decode_batch(payload)
        except MalformedEvents as exc:
            self.counters["malformed"] += 1
            log.debug("malformed KV event payload: %s", exc)
            return
        for ev in events:
            self._apply(ev)
        self.last_applied_ts = ts

    def _apply(self, ev: PageEvent | None) -> None:
        self.counters["events"] += 1
        if isinstance(ev, PagesStored):
            self.counters["page_hashes"] += len(ev.block_hashes)
            self._emit(self.blocks.stored(ev))
        elif isinstance(ev, PagesRemoved):
            self.counters["page_hashes"] += len(ev.block_hashes)
            self._emit(self.blocks.removed(ev))
        elif isinstance(ev, AllPagesCleared):
            self.counters["clears"] += 1
            self._emit(self.blocks.cleared())
        else:
            self.counters["unknown_events"] += 1

    # ------------------------------------------------------------------ gaps
    def _fill_gap(self, start: int, upto: int) -> None:
        """Apply the batches ``start .. upto-1`` from the replay socket, or resync to empty."""
        self.counters["gaps"] += 1
        got = self._replay(start, upto) if self.config.replay_endpoint else None
        if got is None or [s for s, _ in got] != list(range(start, upto)):
            self.counters["replay_failures" if self.config.replay_endpoint else "resyncs"] += 1
            self.fence(f"events {start}..{upto - 1} are lost")
            return
        for _, payload in got:
            self._apply_payload(payload)
        self.counters["replayed"] += len(got)

    def _replay(self, start: int, upto: int) -> list[tuple[int, bytes]] | None:
        assert self.config.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.config.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + self.config.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000)):
                    break
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = decode_seq(frames[2])
                if seq == END_SEQ:
                    return out
                if start <= seq < upto:
                    out.append((seq, frames[3]))
            return None
        except (zmq.ZMQError, MalformedEvents) as exc:
            log.warning("KV events replay from %s failed: %s", self.config.replay_endpoint, exc)
            return None
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------------ fencing
    def fence(self, reason: str) -> None:
        """End the current incarnation: forget its pages, drop its entries (new generation)."""
        self.counters["fences"] += 1
        log.info("KV events for %s: %s; dropping its entries", self.presence.worker_id, reason)
        self.blocks.cleared()
        self._pending.clear()
        self._expected = None
        self._adopt(self.presence.new_incarnation())

    def _adopt(self, gen: int) -> None:
        """Publish under ``gen`` from now on (the index dropped everything older)."""
        self._gen, self._seq = gen, 0
        self._pending.clear()
        self._dirty = True

    # ------------------------------------------------------------------ publishing
    def _emit(self, changes: list[Change]) -> None:
        """Queue index events for ``changes`` (a tier change is Removed(old) + Stored(new)).
        A :class:`~kvshare.types.Tier` is its own name (a StrEnum): no ``.value`` per row."""
        pend, removed, stored = self._pending, _REMOVED, _STORED
        for h, old, new in changes:
            if old is not None:
                pend.append((removed, old, h))
            if new is not None:
                pend.append((stored, new, h))

    @property
    def cache_epoch(self) -> int:
        """This consumer's start value (:func:`~kvshare.workers.epoch_base`) plus how many
        times the engine's own cache was emptied as far as its events tell since: a
        prefix-cache reset (``AllBlocksCleared``) or a fence (a restarted engine, lost events).
        Reported in the worker's load (:attr:`~kvshare.workers.WorkerLoad.cache_epoch`)."""
        return self._epoch_base + int(self.counters["clears"] + self.counters["fences"])

    @property
    def location(self) -> Location:
        return self.presence.location

    def flush(self) -> None:
        """Send what is pending (or the whole inventory when the index must resync)."""
        if self._gen <= 0:
            return  # not registered yet: nothing can be published
        sink = self.presence.index
        try:
            if self._dirty:
                self._send_inventory()
            elif self._pending:
                ack = sink.publish(self._batch(self._pending))
                self.counters["published"] += len(self._pending)
                self._pending.clear()
                if ack.resync:
                    self._send_inventory()
        except Exception as exc:  # index unreachable: resync once it answers
            self.counters["publish_errors"] += 1
            self._dirty = True
            self._pending.clear()
            log.warning("publishing KV events of %s failed (%s); will resync",
                        self.presence.worker_id, exc)

    def _batch(self, rows: list[tuple[int, str, bytes]]) -> pa.RecordBatch:
        """``rows`` (kind, tier, hash) as one Arrow event batch with the next seqs (the
        columns of :func:`kvshare.events.events_to_arrow`, built without event objects)."""
        n = len(rows)
        kinds, tiers, hashes = zip(*rows, strict=True) if rows else ((), (), ())
        first, self._seq = self._seq + 1, self._seq + n
        return pa.RecordBatch.from_arrays([
            pa.array(kinds, pa.int8()),
            pa.array([self.config.namespace] * n, pa.string()),
            pa.array([self.location] * n, pa.string()),
            pa.array(tiers, pa.string()),
            pa.array(hashes, pa.binary(self.config.hash_size)),
            pa.array([self._gen] * n, pa.int64()),
            pa.array(range(first, first + n), pa.int64()),
        ], schema=event_schema(self.config.hash_size))

    def _send_inventory(self) -> None:
        inv = self.blocks.inventory()
        ns, loc, gen, seq = self.config.namespace, self.location, self._gen, self._seq
        rows = [BlockStored(ns, loc, t, h, gen, seq) for h, t in inv.items()]
        self.presence.index.replace_inventory(loc, gen, events_to_arrow(rows, self.config.hash_size),
                                              seq, namespace=ns)
        self._pending.clear()
        self._dirty = False
        self.counters["inventories"] += 1

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **{f"blocks_{k}": v for k, v in self.blocks.counters.items()},
                "share_blocks": len(self.blocks), "pages": self.blocks.num_pages(),
                "generation": self._gen}
