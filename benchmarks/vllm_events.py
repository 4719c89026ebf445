"""vLLM KV events -> kvshare index: ingest speed of the consumer, against decoding alone.

Workload: vLLM's own event classes (``vllm.distributed.kv_events``: ``KVEventBatch``,
``BlockStored``, ``BlockRemoved``) encoded with vLLM's msgpack encoder, as an engine's
scheduler emits them: 64 multi-turn conversations, each turn a ``BlockStored`` of 16 pages
(512 tokens, block size 32) continuing the conversation's chain, one engine step's events per
batch (4 stores); once the (emulated) cache is full every step also evicts the 64 oldest pages
in ``BlockRemoved`` events of 16. The payloads are sent as ``[topic, seq, payload]`` frames
on a real ZMQ PUB socket (ipc, from a thread of this process); the consumer
(:class:`kvshare.vllm.events.consumer.KVEventsConsumer`, its own thread) re-hashes the pages into
256-token share blocks and publishes them to a real index actor (one ``GlobalIndexActor`` on a
local Ray) as the worker's gpu tier.

Baseline (same payloads, same run): decoding alone with vLLM's typed msgspec decoder
(``Decoder(KVEventBatch)``), the least any consumer in Python must spend.

Last line: JSON with ``events_per_s`` (vLLM block hashes, stored + removed, applied per second,
from the first frame sent until the index has acknowledged the last change), ``decode_per_s``
(baseline), ``ratio`` (events_per_s / decode_per_s), ``share_blocks`` in the index at the end
and the ``inprocess_events_per_s`` of the same consumer logic without ZMQ and Ray (one
thread; publishing every 64 batches to an index that accepts everything).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from kvshare.ray_env import use_local_ray_defaults

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvshare.hasher import Hasher
from kvshare.types import NodeId, WorkerId
from kvshare.vllm.events.consumer import EventsConfig, KVEventsConsumer
from kvshare.vllm.server.presence import Presence
from kvshare.workers import WorkerInfo

PAGE = 32
BLOCK = 256
CONVERSATIONS = 64
TURN_PAGES = 16
STORES_PER_STEP = 4
CACHE_PAGES = 20_000
STEPS = 1_600
NS = "bench-vllm"


def make_payloads(seed: int = 0) -> tuple[list[bytes], int]:
    """vLLM-encoded batches and the number of page hashes in them."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    rng = np.random.default_rng(seed)
    enc = msgspec.msgpack.Encoder()
    heads: list[int | None] = [None] * CONVERSATIONS
    live: list[int] = []  # pages in the cache, oldest first
    next_hash = 2**63  # vLLM's u64 hashes: half of them above 2**63
    payloads, pages = [], 0
    for step in range(STEPS):
        events: list[Any] = []
        for _ in range(STORES_PER_STEP):
            c = int(rng.integers(CONVERSATIONS))
            hashes = [(next_hash + i) % 2**64 for i in range(TURN_PAGES)]
            next_hash += TURN_PAGES * 7919
            tokens = rng.integers(0, 32_000, TURN_PAGES * PAGE).tolist()
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=heads[c],
                                      token_ids=tokens, block_size=PAGE, lora_id=None,
                                      medium="GPU", lora_name=None, group_idx=0))
            heads[c] = hashes[-1]
            live.extend(hashes)
            pages += TURN_PAGES
        while len(live) > CACHE_PAGES:
            gone, live = live[:TURN_PAGES], live[TURN_PAGES:]
            events.append(BlockRemoved(block_hashes=gone, medium="GPU", group_idx=0))
            pages += len(gone)
        payloads.append(enc.encode(KVEventBatch(ts=float(step), events=events)))
    return payloads, pages


def decode_rate(payloads: list[bytes], pages: int) -> float:
    from vllm.distributed.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(KVEventBatch)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for p in payloads:
            dec.decode(p)
        best = max(best, pages / (time.perf_counter() - t0))
    return best


class _NullIndex:
    """Accepts everything (the in-process figure: consumer logic without Ray)."""

    class _Ack:
        resync: tuple[()] = ()

    def register_worker(self, info: Any) -> int:
        return 1

    def report_load(self, load: Any) -> bool:
        return True

    def unregister_worker(self, wid: Any) -> int:
        return 0

    def publish(self, batch: Any) -> Any:
        return self._Ack()

    def replace_inventory(self, *a: Any, **k: Any) -> bool:
        return True


HASHER = Hasher("bench-model", "bench-layout", BLOCK)


def inprocess_rate(payloads: list[bytes], pages: int) -> float:
    presence = Presence(WorkerInfo(WorkerId("w-mem"), NodeId("n"), (NS,)), _NullIndex())
    presence.new_incarnation()
    cfg = EventsConfig("ipc:///tmp/unused", NS, BLOCK, PAGE)
    consumer = KVEventsConsumer(cfg, presence, HASHER)
    consumer._gen = presence.generation
    t0 = time.perf_counter()
    for i, p in enumerate(payloads):
        consumer._apply_payload(p)
        if i % 64 == 63:  # the threaded consumer publishes every batch_window_s, not per frame
            consumer.flush()
    consumer.flush()
    return pages / (time.perf_counter() - t0)


def zmq_ray_rate(payloads: list[bytes], pages: int) -> tuple[float, int]:
    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient

    tmp = tempfile.mkdtemp(prefix="kvs-bench-", dir="/tmp")
    ray.init(num_cpus=1, object_store_memory=200 * 2**20, include_dashboard=False,
             _temp_dir=tmp, log_to_driver=False)
    try:
        actor = GlobalIndexActor.remote(IndexConfig(namespaces=((NS, 32, ""),)))
        ray.get(actor.ready.remote())
        index = IndexClient([actor])
        presence = Presence(WorkerInfo(WorkerId("w-bench"), NodeId("n"), (NS,)), index)
        presence.new_incarnation()
        endpoint = f"ipc://{tmp}/ev.sock"
        pub = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(endpoint)
        consumer = KVEventsConsumer(EventsConfig(endpoint, NS, BLOCK, PAGE), presence, HASHER)
        consumer.start()
        time.sleep(1.0)  # the subscription must land before the first frame
        consumer.counters["page_hashes"] = 0
        frames = [(b"", i.to_bytes(8, "big"), p) for i, p in enumerate(payloads)]

        def send() -> None:
            for f in frames:
                pub.send_multipart(f)

        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 600
        while consumer.counters["page_hashes"] < pages or consumer._pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consumer stalled: {consumer.stats()}")
            time.sleep(0.001)
        elapsed = time.perf_counter() - t0
        sender.join()
        consumer.stop()
        blocks = int(index.stats()[0]["locations"].get(str(presence.location), 0))
        if consumer.counters["fences"] or consumer.counters["malformed"]:
            raise RuntimeError(f"unexpected fences or malformed payloads: {consumer.stats()}")
        if blocks != len(consumer.blocks):
            raise RuntimeError(f"index holds {blocks} blocks, the consumer {len(consumer.blocks)}")
        pub.close(linger=0)
        return pages / elapsed, blocks
    finally:
        ray.shutdown()


def main() -> None:
    payloads, pages = make_payloads()
    print(f"{len(payloads)} vLLM batches, {pages} page hashes, "
          f"{sum(map(len, payloads)) / 2**20:.1f} MiB of msgpack", flush=True)
    dec = decode_rate(payloads, pages)
    print(f"decode only (vLLM's typed msgspec decoder): {dec:,.0f} page hashes/s", flush=True)
    mem = inprocess_rate(payloads, pages)
    print(f"consumer logic in process (no ZMQ, no Ray): {mem:,.0f} page hashes/s", flush=True)
    rate, blocks = zmq_ray_rate(payloads, pages)
    print(f"ZMQ -> consumer -> index actor: {rate:,.0f} page hashes/s "
          f"({rate / dec:.2f}x decode only); {blocks} share blocks in the index", flush=True)
    print(json.dumps({"events_per_s": round(rate), "decode_per_s": round(dec),
                      "ratio": round(rate / dec, 3), "inprocess_events_per_s": round(mem),
                      "page_hashes": pages, "share_blocks": blocks, "page_tokens": PAGE,
                      "block_tokens": BLOCK}))


if __name__ == "__main__":
    use_local_ray_defaults()
    main()
