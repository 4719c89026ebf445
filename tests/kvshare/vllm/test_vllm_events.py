"""vLLM's own prefix cache in the index: a real vLLM-CPU engine's KV events, through the
consumer, into a real index actor as the worker's gpu tier (events, eviction, reset, kill and
restart on the same endpoint), plus bad payloads, late start and gaps from real ZMQ
publishers (vLLM's own ``ZmqEventPublisher``)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

pytest.importorskip("vllm")

from vllm_helpers import (  # noqa: E402
    BLOCK,
    HASHER,
    NS,
    PAGE,
    prompt_tokens,
    share_hashes,
    tiny_model,
    wait_for,
)

from kvshare.engines.server import free_port  # noqa: E402
from kvshare.types import NodeId, Tier, WorkerId  # noqa: E402
from kvshare.vllm.events.consumer import EventsConfig, KVEventsConsumer  # noqa: E402
from kvshare.vllm.server.launch import VllmProcess, VllmSpec, reset_prefix_cache  # noqa: E402
from kvshare.vllm.server.load import MetricsLoad  # noqa: E402
from kvshare.vllm.server.presence import Presence  # noqa: E402
from kvshare.workers import WorkerInfo  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def index() -> Iterator[Any]:
    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient

    tmp = tempfile.mkdtemp(prefix="kvs-ray-", dir="/tmp")
    ray.init(num_cpus=1, object_store_memory=100 * 2**20, include_dashboard=False,
             _temp_dir=tmp, namespace="kvshare-vllm-events", log_to_driver=False)
    actor = GlobalIndexActor.remote(IndexConfig(worker_ttl_s=3.0, namespaces=((NS, 32, ""),)))
    client = IndexClient([actor])
    ray.get(actor.ready.remote())
    try:
        yield client
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("model")))


class Worker:
    """One vLLM server + its presence + its events consumer, as a launcher would wire them."""

    def __init__(self, model: str, index: Any, wid: str, events_dir: str) -> None:
        # 40 pages of 32 tokens: a few 512-token prompts fill it, so vLLM evicts
        self.spec = VllmSpec(model=model, port=free_port(), events_dir=events_dir,
                             num_blocks=40, max_model_len=1024).on_this_node()
        self.index = index
        self.info = WorkerInfo(WorkerId(wid), NodeId("node-a"), (NS,), self.spec.endpoint)
        self.proc = VllmProcess(self.spec).start()
        self.proc.wait_ready()
        self.load = MetricsLoad(self.info.worker_id, self.spec.endpoint)
        self.presence = Presence(self.info, index, self.load.load).start()
        cfg = EventsConfig(self.spec.events_endpoint, NS, BLOCK, PAGE,
                           replay_endpoint=self.spec.replay_endpoint)
        self.consumer = KVEventsConsumer(cfg, self.presence, HASHER).start()

    def complete(self, tokens: list[int], salt: str = "") -> None:
        body: dict[str, Any] = {"model": self.spec.model, "prompt": tokens, "max_tokens": 1}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(f"{self.spec.endpoint}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    def held(self, tokens: list[int], salt: str = "") -> int:
        """Leading share blocks of ``tokens`` the index has at this worker's gpu tier."""
        n = 0
        for holders in self.index.lookup(NS, share_hashes(tokens, salt)):
            if holders.get(self.presence.location) != Tier.GPU:
                break
            n += 1
        return n

    def entries(self) -> int:
        return int(self.index.stats()[0]["locations"].get(self.presence.location, 0))

    def close(self) -> None:
        self.consumer.stop()
        self.presence.stop()
        self.load.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def worker(model: str, index: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(model, index, "vllm-0", str(tmp_path_factory.mktemp("ev")))
    try:
        yield w
    finally:
        w.close()


def test_prefill_reaches_the_index_as_the_workers_gpu_tier(worker: Worker) -> None:
    tokens = prompt_tokens(1, 4 * BLOCK + 40)  # 4 full share blocks and a partial one
    worker.complete(tokens, salt="acme")
    _, waited = wait_for(lambda: worker.held(tokens, "acme") == 4)
    print(f"events reached the index {waited * 1000:.0f} ms after the response")
    assert worker.held(tokens) == 0  # another tenant's root: nothing
    load = worker.presence.last_load
    assert load is not None and load.worker_id == worker.info.worker_id
    assert worker.index.loads()[worker.info.worker_id].ts > 0  # the lease is renewed


def test_evicted_pages_take_their_share_blocks_out_of_the_index(worker: Worker) -> None:
    first = prompt_tokens(2, 4 * BLOCK)
    worker.complete(first)
    wait_for(lambda: worker.held(first) == 4)
    for seed in (3, 4, 5):  # 3 x 16 new pages > 40: vLLM evicts the oldest (first's)
        worker.complete(prompt_tokens(seed, 4 * BLOCK))
    wait_for(lambda: worker.held(first) == 0)
    assert worker.consumer.blocks.counters["pages_removed"] > 0
    last = prompt_tokens(5, 4 * BLOCK)
    assert worker.held(last) == 4


def test_reset_prefix_cache_clears_the_workers_entries(worker: Worker) -> None:
    before = prompt_tokens(6, 2 * BLOCK)
    worker.complete(before)
    wait_for(lambda: worker.held(before) == 2)
    epoch = worker.consumer.cache_epoch
    assert reset_prefix_cache(worker.spec.endpoint)  # refused while a save holds pages: retried
    after = prompt_tokens(7, 2 * BLOCK)
    worker.complete(after)  # vLLM publishes the clear with its next step
    wait_for(lambda: worker.held(after) == 2)
    assert worker.held(before) == 0
    assert worker.entries() == 2
    assert worker.consumer.cache_epoch == epoch + 1  # one clear: the load report says so


def test_killed_engine_is_fenced_and_its_restart_publishes_afresh(worker: Worker) -> None:
    old = prompt_tokens(8, 3 * BLOCK)
    worker.complete(old)
    wait_for(lambda: worker.held(old) == 3)
    fences, epoch = worker.consumer.counters["fences"], worker.consumer.cache_epoch
    worker.proc.kill()
    _, gone_s = wait_for(lambda: worker.entries() == 0)
    print(f"stale entries gone {gone_s * 1000:.0f} ms after the kill")
    assert worker.consumer.counters["fences"] > fences
    assert worker.consumer.cache_epoch > epoch  # the load report says its cache is gone
    worker.proc = VllmProcess(worker.spec).start()  # same endpoint, seq starts again at 0
    worker.proc.wait_ready()
    new = prompt_tokens(9, 2 * BLOCK)
    worker.complete(new)
    wait_for(lambda: worker.held(new) == 2)
    assert worker.held(old) == 0
    assert worker.entries() == 2
    assert worker.consumer.counters["malformed"] == 0


# ---------------------------------------------------------------------- real ZMQ publishers
def _encode(events: list[Any]) -> bytes:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=PAGE, lora_id=None, medium="GPU", lora_name=None)


class _Sink:
    """A second worker id on the same index, fed by a test publisher."""

    def __init__(self, index: Any, wid: str, endpoint: str, replay: str | None) -> None:
        self.index = index
        info = WorkerInfo(WorkerId(wid), NodeId("node-b"), (NS,))
        self.presence = Presence(info, index).start()
        cfg = EventsConfig(endpoint, NS, BLOCK, PAGE, replay_endpoint=replay)
        self.consumer = KVEventsConsumer(cfg, self.presence, HASHER)

    def held(self, tokens: list[int]) -> int:
        loc = self.presence.location
        return sum(1 for h in self.index.lookup(NS, share_hashes(tokens)) if loc in h)

    def close(self) -> None:
        self.consumer.stop()
        self.presence.stop()


def test_bad_payloads_and_a_vanished_publisher_are_counted_without_dying(index: Any) -> None:
    d = tempfile.mkdtemp(prefix="kvs-ev-", dir="/tmp")
    endpoint = f"ipc://{os.path.join(d, 'ev.sock')}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    sink = _Sink(index, "fake-0", endpoint, None)
    sink.consumer.start()
    try:
        time.sleep(0.5)  # PUB/SUB: frames sent before the subscription lands are dropped
        tokens = prompt_tokens(10, BLOCK)
        seq = iter(range(100))

        def send(payload: bytes, frames: int = 3) -> None:
            parts = [b"kv", next(seq).to_bytes(8, "big"), payload][:frames]
            pub.send_multipart(parts)

        send(b"\xc1not msgpack")
        send(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]))
        send(msgspec.msgpack.encode([1.0, [{"type": "SomethingNewer", "x": 1}]]))
        send(b"", frames=2)
        send(_encode([_stored([1, 2, 3, 4], None, tokens)]))
        wait_for(lambda: sink.held(tokens) == 1)
        c = sink.consumer.counters
        assert c["malformed"] == 3 and c["unknown_events"] == 1
        pub.close(linger=0)  # the publisher vanishes: its entries go, the consumer lives on
        wait_for(lambda: sink.held(tokens) == 0)
        assert c["disconnects"] >= 1 and sink.consumer._thread is not None
        assert sink.consumer._thread.is_alive()
    finally:
        sink.close()


def test_a_late_consumer_fills_the_gap_from_vllms_replay_socket(index: Any) -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    d = tempfile.mkdtemp(prefix="kvs-ev-", dir="/tmp")
    endpoint, replay = (f"ipc://{os.path.join(d, n)}" for n in ("ev.sock", "replay.sock"))
    pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="kv")
    from vllm.distributed.kv_events import KVEventBatch

    tokens = prompt_tokens(11, 2 * BLOCK)
    pages = [2**64 - 1 - i for i in range(8)]
    try:
        # batches 0 and 1 go out before anyone listens
        pub.publish(KVEventBatch(ts=1.0, events=[_stored(pages[:3], None, tokens[:3 * PAGE])]))
        pub.publish(KVEventBatch(ts=2.0, events=[_stored(pages[3:6], pages[2],
                                                         tokens[3 * PAGE:6 * PAGE])]))
        time.sleep(0.3)
        sink = _Sink(index, "fake-1", endpoint, replay)
        sink.consumer.start()
        try:
            time.sleep(0.5)
            pub.publish(KVEventBatch(ts=3.0, events=[_stored(pages[6:], pages[5],
                                                             tokens[6 * PAGE:])]))
            wait_for(lambda: sink.held(tokens) == 2)
            c = sink.consumer.counters
            assert c["gaps"] == 1 and c["replayed"] == 2 and c["fences"] == 0
        finally:
            sink.close()
    finally:
        pub.shutdown()
