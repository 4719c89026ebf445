"""Fast tier: KVShareConnector's scheduler side driven by vLLM's real Scheduler (no model).

As upstream's connector unit tests do: a real ``vllm.v1.core.sched.scheduler.Scheduler`` on
CPU, fake model-runner outputs. The connector is the real KVShareConnector with one change:
its SDK client is the in-process :class:`~kvshare.client.local.LocalKVClient` over a
TieredBlockPool (no Ray), so lookup -> async load -> recompute-on-failure -> save ->
delay-free runs in seconds.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshare.client.local import LocalKVClient
from kvshare.kv_convert import new_contiguous
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama
from kvshare.tiers.host import HostSlab
from kvshare.types import BlockHash, Tier
from kvshare.vllm.connector.kv_connector import KVShareConnector

BLOCK = 64
PAGE = 32
SPEC = TinyModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                     intermediate_size=256, vocab_size=512, max_position_embeddings=2048,
                     dtype="float32")
CLIENT: dict[str, LocalKVClient] = {}


class LocalPoolConnector(KVShareConnector):
    """KVShareConnector whose SDK client is an in-process pool (the test's only stand-in)."""

    def _make_client(self) -> Any:
        if "c" not in CLIENT:
            lay = self.keys.layout
            cfg = PoolConfig("t", lay, (TierSpec(Tier.HOST, 64 * lay.bytes_per_block),))
            pool = TieredBlockPool(cfg, {Tier.HOST: HostSlab(lay.bytes_per_block, 64)})
            CLIENT["c"] = LocalKVClient(pool, BlockHash(self.keys.root(None)))
        return CLIENT["c"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVShareLocalTest" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVShareLocalTest", __name__, "LocalPoolConnector")
    yield build_tiny_llama(str(tmp_path_factory.mktemp("m") / "tiny"), SPEC)
    CLIENT.clear()


def make_scheduler(model: str, block_tokens: int = BLOCK, extra: dict[str, Any] | None = None,
                   budget: int = 1024, **overrides: Any) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=model, dtype="float32", seed=0, hf_overrides=overrides)
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVShareLocalTest", kv_role="kv_both",
            kv_connector_extra_config={"namespace": "t", "block_tokens": block_tokens,
                                       **(extra or {})}),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = 200
    kcc = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)],
                         FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32,
                                           dtype=torch.float32))])
    return Scheduler(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc), block_size=PAGE)


def request(rid: str, tokens: list[int], max_tokens: int = 2,
            kv_transfer_params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, extra_args=(
        {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None))
    sp.update_from_generation_config({}, 1)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(PAGE, sha256))


def output(reqs: list[Any], **kv: Any) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[5] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=None, kv_connector_output=KVConnectorOutput(**kv) if kv else None)


def tokens(seed: int, n: int = 4 * BLOCK + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(n)]


def seed_pool(sched: Any, toks: list[int]) -> None:
    """Store the prompt's full blocks in the in-process pool (what another engine did)."""
    conn = sched.connector
    client = CLIENT["c"]
    kv = new_contiguous(conn.keys.layout, (len(toks) // BLOCK) * BLOCK)
    kv.normal_()
    client.store(toks, kv).result()


ASYNC = {"sync_local_mib": 0}  # every load asynchronous (as loads from other nodes always are)


def test_hit_loads_async_then_only_the_suffix_is_computed(model: str) -> None:
    sched = make_scheduler(model, extra=ASYNC)
    toks = tokens(1)
    seed_pool(sched, toks)
    req = request("r1", toks)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {}  # waiting for its KV, nothing computed
    (load,) = out.kv_connector_metadata.loads
    assert load.req_id == "r1" and load.keep_tokens == 0 and len(load.plan["blocks"]) == 4
    assert len(load.page_ids) >= 4 * BLOCK // PAGE
    sched.update_from_output(out, output([], finished_recving={"r1"}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r1": len(toks) - 4 * BLOCK}
    assert out.kv_connector_metadata.saves == []  # the cluster already holds these blocks
    assert sched.connector.counters["load_tokens"] == 4 * BLOCK


def test_failed_pages_are_recomputed_stored_again_and_never_reloaded(model: str) -> None:
    sched = make_scheduler(model, extra=ASYNC)
    toks = tokens(2)
    seed_pool(sched, toks)
    sched.add_request(request("r2", toks))
    out = sched.schedule()
    (load,) = out.kv_connector_metadata.loads
    bad = set(load.page_ids[BLOCK // PAGE:4 * BLOCK // PAGE])  # block 1 onwards failed
    sched.update_from_output(out, output([], finished_recving={"r2"}, invalid_block_ids=bad))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r2": len(toks) - BLOCK}  # from the first bad page
    assert out.kv_connector_metadata.loads == []
    assert sched.connector.counters["failed_loads"] == 1
    (save,) = out.kv_connector_metadata.saves  # the recomputed blocks are stored again
    assert (save.start_block, len(save.hashes)) == (1, 4)


def test_a_local_hit_loads_inside_the_step_that_computes_the_suffix(model: str) -> None:
    """This node's pool (no network): vLLM schedules the suffix in the same step and the load
    runs before that step's forward pass; nothing waits for a ``finished_recving``."""
    sched = make_scheduler(model)
    toks = tokens(4)
    seed_pool(sched, toks)
    req = request("r4", toks, max_tokens=3)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r4": len(toks) - 4 * BLOCK}
    assert out.has_sync_kv_loads  # vLLM starts the load before the forward pass
    (load,) = out.kv_connector_metadata.loads
    assert load.sync and len(load.plan["blocks"]) == 4
    sched.update_from_output(out, output([req]))
    assert len(req.output_token_ids) == 1 and sched.connector.counters["sync_loads"] == 1
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r4": 1}  # decoding


def test_a_failed_local_load_is_recomputed_in_the_next_step_and_stored_again(model: str) -> None:
    """The synchronous load's failed pages come back in the step it ran: vLLM drops that step's
    token and recomputes from the first failed page; the recomputed blocks are saved again."""
    sched = make_scheduler(model)
    toks = tokens(5)
    seed_pool(sched, toks)
    req = request("r5", toks)
    sched.add_request(req)
    out = sched.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert load.sync
    bad = set(load.page_ids[2 * BLOCK // PAGE:4 * BLOCK // PAGE])  # blocks 2 and 3 failed
    sched.update_from_output(out, output([req], invalid_block_ids=bad))
    assert list(req.output_token_ids) == []  # the token computed over the failed KV is dropped
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r5": len(toks) - 2 * BLOCK}
    assert out.kv_connector_metadata.loads == []
    assert sched.connector.counters["failed_loads"] == 1
    (save,) = out.kv_connector_metadata.saves
    assert (save.start_block, len(save.hashes)) == (2, 4)


def test_new_blocks_are_saved_and_pages_kept_until_the_save_is_done(model: str) -> None:
    sched = make_scheduler(model)
    toks = tokens(3, 3 * BLOCK + 10)
    req = request("r3", toks, max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r3": len(toks)}
    (save,) = out.kv_connector_metadata.saves
    assert (save.start_block, len(save.hashes)) == (0, 3)
    assert len(save.page_ids) == 3 * BLOCK // PAGE
    sched.update_from_output(out, output([req]))  # max_tokens=1: finished
    assert "r3" in sched.requests  # pages held: the save is in flight
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    out = sched.schedule()
    sched.update_from_output(out, output([], finished_sending={"r3"}))
    assert "r3" not in sched.requests
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() > free_before


class GatedStores:
    """The test's client, except that stores wait for ``open`` (a busy pool) on one thread."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.open = threading.Event()
        self._thread = ThreadPoolExecutor(1)

    def store(self, *args: Any) -> Any:
        def run() -> Any:
            self.open.wait(30)
            return self.client.store(*args).result()
        return self._thread.submit(run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def worker_side(sched: Any, client: Any) -> Any:
    """The connector's worker half over the test's client and CPU_ATTN pages (what vLLM's
    worker process runs: the scheduler's metadata goes in as vLLM would send it)."""
    from kvshare.vllm.connector.worker_side import WorkerSide

    lay = sched.connector.keys.layout
    worker = WorkerSide(client, sched.connector.keys, PAGE)
    worker.register({f"model.layers.{i}.self_attn.attn":
                     torch.zeros(200, lay.num_kv_heads, PAGE, 2 * lay.head_dim)
                     for i in range(lay.num_layers)})
    return worker


def test_only_a_finishing_request_waits_for_its_saves(model: str) -> None:
    """Read-after-write without a stall per step: the prefill step's saves are handed to the
    store thread and the step goes on (its first token does not wait for a slow store); the
    step that finishes the request holds its output until the saves ended (a lookup right
    after finds every block); a store slower than the limit is counted late; an aborted
    request is not held."""
    from vllm.v1.request import RequestStatus

    from kvshare.vllm.connector.save_marks import SYNC_SAVE_WAIT_S

    sched = make_scheduler(model)
    client = GatedStores(CLIENT["c"])
    worker = worker_side(sched, client)
    side = sched.connector._sched
    toks = tokens(61, 3 * BLOCK + 10)
    req = request("w1", toks, max_tokens=2)
    sched.add_request(req)
    out = sched.schedule()
    (save,) = out.kv_connector_metadata.saves
    assert save.seq > 0 and out.kv_connector_metadata.marks == side.marks.path
    t0 = time.perf_counter()
    worker.submit_saves(out.kv_connector_metadata)  # vLLM's wait_for_save
    sched.update_from_output(out, output([req]))  # the first token: not finished
    assert time.perf_counter() - t0 < 0.2, "the prefill step waited for its store"
    assert side.marks.attached and not side.marks.done(save.seq)
    out = sched.schedule()
    worker.submit_saves(out.kv_connector_metadata)
    threading.Timer(0.3, client.open.set).start()
    t0 = time.perf_counter()
    sched.update_from_output(out, output([req]))  # max_tokens=2: finished, held for its save
    held = time.perf_counter() - t0
    assert 0.25 <= held < SYNC_SAVE_WAIT_S, held
    assert CLIENT["c"].lookup(toks).available_blocks == 3  # already in the pool
    counters = side.counters
    assert counters["sync_saves"] == 1 and not counters.get("sync_saves_late")
    assert counters["sync_save_s"] >= 0.25

    client.open.clear()  # a store slower than the limit: held that long, counted late
    late = request("w2", tokens(62, 3 * BLOCK + 10), max_tokens=1)
    sched.add_request(late)
    out = sched.schedule()
    worker.submit_saves(out.kv_connector_metadata)
    t0 = time.perf_counter()
    sched.update_from_output(out, output([late]))
    assert SYNC_SAVE_WAIT_S <= time.perf_counter() - t0 < SYNC_SAVE_WAIT_S + 0.5
    assert side.counters["sync_saves_late"] == 1

    gone = request("w3", tokens(63, 3 * BLOCK + 10), max_tokens=4)  # its client went away
    sched.add_request(gone)
    out = sched.schedule()
    worker.submit_saves(out.kv_connector_metadata)
    sched.update_from_output(out, output([gone]))
    t0 = time.perf_counter()
    sched.finish_requests("w3", RequestStatus.FINISHED_ABORTED)
    assert time.perf_counter() - t0 < 0.2
    assert side.counters["sync_saves"] == 2
    client.open.set()
    worker.close()


def test_a_request_with_stop_strings_waits_for_its_saves_in_the_step(model: str) -> None:
    """vLLM's frontend, not the engine, finds stop strings: the engine never sees that answer
    end, so the step that computes such a request's blocks waits for their store (and the
    request is not held again when the frontend aborts it)."""
    sched = make_scheduler(model)
    client = GatedStores(CLIENT["c"])
    worker = worker_side(sched, client)
    req = request("s1", tokens(64, 3 * BLOCK + 10), max_tokens=8)
    req.sampling_params.stop = ["</answer>"]
    sched.add_request(req)
    out = sched.schedule()
    (save,) = out.kv_connector_metadata.saves
    assert save.sync
    threading.Timer(0.3, client.open.set).start()
    t0 = time.perf_counter()
    worker.submit_saves(out.kv_connector_metadata)
    assert time.perf_counter() - t0 >= 0.25
    assert sched.connector._sched.marks.wait([save.seq], 1.0)  # (its callback may trail)
    assert worker.counters["sync_saves"] == 1
    worker.close()


def test_lookup_waits_reach_vllms_scheduler_stats_once_per_lookup(model: str) -> None:
    """What the connector adds to a request vLLM's own cache may serve: the time it was held
    for its lookup goes out with vLLM's scheduler stats (to ``/metrics``), once per lookup;
    a prompt too short for a block is never looked up."""
    sched = make_scheduler(model)
    toks = tokens(6, 2 * BLOCK + 3)
    short = request("r6s", toks[:BLOCK - 1], max_tokens=1)
    sched.add_request(request("r6", toks, max_tokens=1))
    sched.add_request(short)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r6", "r6s"}
    eco = sched.update_from_output(out, output([sched.requests["r6"], short]))
    stats = next(iter(eco.values())).scheduler_stats.kv_connector_stats
    assert stats["lookups_answered"] == 1 and 0 <= stats["lookup_wait_seconds"] < 60
    out = sched.schedule()
    eco = sched.update_from_output(out, output([]))
    later = [e.scheduler_stats for e in eco.values() if e.scheduler_stats is not None]
    assert all(not (s.kv_connector_stats or {}).get("lookups_answered") for s in later)


def test_the_prefill_backlog_counts_exactly_the_tokens_left_to_compute(model: str) -> None:
    """The load report's prefill work: every request the scheduler looked at owes its tokens
    less what vLLM's cache and the cluster bring, less what steps scheduled; a request the
    budget has not reached yet is not counted (the report prices it); a finished or
    preempted request owes nothing. The counts leave with vLLM's scheduler stats."""
    sched = make_scheduler(model, budget=256)
    side = sched.connector._sched
    sent: dict[str, float] = {}

    def step(done: list[Any]) -> None:
        """One step; ``done``: the requests whose prefill it ends (they sample a token)."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        firsts = {r.request_id for r in done}
        eco = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] if r in firsts else [] for r in ids], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None))
        for e in eco.values():
            if e.scheduler_stats is not None:
                for k, v in (e.scheduler_stats.kv_connector_stats or {}).items():
                    sent[k] = sent.get(k, 0) + v

    def reported() -> tuple[float, float]:
        return (sent.get("backlog_tokens_added", 0) - sent.get("backlog_tokens_removed", 0),
                sent.get("backlog_waiting_added", 0) - sent.get("backlog_waiting_removed", 0))

    hit_toks = tokens(40)  # 4 blocks + 5 tokens, the 4 blocks in this node's pool
    seed_pool(sched, hit_toks)
    hit = request("hit", hit_toks, max_tokens=1)
    cold = request("cold", tokens(41, 600), max_tokens=1)
    late = request("late", tokens(42, 300), max_tokens=1)
    for r in (hit, cold, late):
        sched.add_request(r)
    step([hit])  # hit: its 5 new tokens (done: finished); cold: 251 of 600; late: not reached
    assert (side.backlog.tokens, side.backlog.waiting) == (349, 0)
    assert reported() == (349, 0)
    step([])  # cold: 256 more
    assert reported() == (93, 0)
    step([cold])  # cold's last 93, late's first 163 (seen in this step)
    assert reported() == (300 - 163, 0)
    step([late])
    assert reported() == (0, 0) and side.backlog.tokens == 0
    assert not sched.requests or all(r.is_finished() for r in sched.requests.values())
    assert 0 < time.time() - sent["backlog_as_of_seconds"] < 60

    # a request aborted while it waits owes nothing any more
    sched.add_request(request("gone", tokens(43, 200), max_tokens=1))
    side.backlog.seen("gone", 200)  # (as the scheduler asks before it can place it)
    assert side.backlog.waiting == 1
    from vllm.v1.request import RequestStatus

    sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    assert (side.backlog.tokens, side.backlog.waiting) == (0, 0)


def test_a_turn_vllm_holds_but_part_of_a_block_waits_on_no_lookup(model: str) -> None:
    """The next turn of a conversation this engine served: vLLM's own cache holds all but
    part of one block of it, so the cluster could add less than a block and the request is
    scheduled at once, without a lookup (the blocks vLLM holds are not saved again); a turn
    that adds more than a block still looks the rest up."""
    sched = make_scheduler(model)
    first = tokens(7, BLOCK + 40)  # vLLM caches its 3 full pages (96 tokens)
    req = request("t0", first, max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, output([req]))
    out = sched.schedule()
    sched.update_from_output(out, output([], finished_sending={"t0"}))
    lookups = sched.connector.counters.get("lookups", 0)
    nxt = request("t1", first + tokens(8, 40))  # 2 full blocks: at most 32 more tokens
    sched.add_request(nxt)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"t1": len(first) + 40 - 3 * PAGE}  # vLLM's hit
    counters = sched.connector.counters
    assert counters.get("lookups", 0) == lookups and counters["lookups_skipped"] == 1
    assert [s.start_block for s in out.kv_connector_metadata.saves] == [1]  # block 0: vLLM's
    sched.update_from_output(out, output([nxt]))
    longer = request("t2", first + tokens(9, 2 * BLOCK))  # 4 blocks: 160 tokens beyond vLLM's
    sched.add_request(longer)
    sched.schedule()
    assert sched.connector.counters["lookups"] == lookups + 1


def test_a_router_hint_of_nothing_more_skips_the_lookup(model: str) -> None:
    """A prompt its router found nothing of in the cluster is scheduled at once, with no
    second index query, and all its blocks are saved; a hint that the cluster holds more than
    vLLM's own hit, a malformed hint, or none, and the request is looked up (and loads)."""
    from kvshare.vllm.router_hint import encode

    sched = make_scheduler(model)
    cold = request("h0", tokens(20), max_tokens=1, kv_transfer_params=encode(0))
    sched.add_request(cold)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"h0": len(cold.prompt_token_ids)}
    counters = sched.connector.counters
    assert counters["lookups_skipped_router"] == 1 and not counters.get("lookups")
    (save,) = out.kv_connector_metadata.saves
    assert (save.start_block, len(save.hashes)) == (0, 4)
    sched.update_from_output(out, output([cold]))
    for i, params in enumerate([encode(4 * BLOCK), {"kvshare": {"held_tokens": -1}}, None]):
        toks = tokens(21 + i)
        seed_pool(sched, toks)
        req = request(f"h{i + 1}", toks, max_tokens=1, kv_transfer_params=params)
        sched.add_request(req)
        out = schedule_until(sched, lambda o, r=req: r.request_id in o.num_scheduled_tokens)
        # the pool's 4 blocks came in (a synchronous load from this node's pool): the suffix only
        assert out.num_scheduled_tokens[req.request_id] == len(toks) - 4 * BLOCK
        sched.update_from_output(out, output([req]))
    counters = sched.connector.counters
    assert counters["lookups"] == 3 and counters["lookups_skipped_router"] == 1
    assert counters["router_hints_malformed"] == 1
    off = make_scheduler(model, extra={"router_hints": False})
    off.add_request(request("h9", tokens(29), max_tokens=1, kv_transfer_params=encode(0)))
    off.schedule()
    assert off.connector.counters["lookups"] == 1 and "lookups_skipped_router" not in off.connector.counters



def test_a_router_hint_older_than_its_max_age_is_not_trusted(model: str) -> None:
    """A request that queued at the engine longer than ``router_hint_max_age_s`` is looked up
    although its hint said the cluster held nothing: the blocks stored while it waited (here,
    the whole prompt) are loaded, not recomputed; a fresh hint of the same kind skips the lookup."""
    from kvshare.vllm.router_hint import encode

    sched = make_scheduler(model, extra={"router_hint_max_age_s": 0.5})
    sched.connector._sched.lookup_wait_s = 30.0  # the lookup answers within the wait
    toks = tokens(41)
    seed_pool(sched, toks)  # stored after the router's query: its hint says 0
    late = request("a0", toks, max_tokens=1, kv_transfer_params=encode(0))
    late.arrival_time -= 2.0  # it has waited 2 s in the engine's queue
    sched.add_request(late)
    out = schedule_until(sched, lambda o: "a0" in o.num_scheduled_tokens)
    assert out.num_scheduled_tokens["a0"] == len(toks) - 4 * BLOCK  # loaded from the pool
    counters = sched.connector.counters
    assert counters["router_hints_expired"] == 1 and counters["lookups"] == 1
    assert "lookups_skipped_router" not in counters
    sched.update_from_output(out, output([late]))
    fresh = request("a1", tokens(42), max_tokens=1, kv_transfer_params=encode(0))
    sched.add_request(fresh)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a1": len(fresh.prompt_token_ids)}
    counters = sched.connector.counters
    assert counters["lookups_skipped_router"] == 1 and counters["router_hints_expired"] == 1


def test_an_expired_hint_answers_when_the_lookup_is_not_back_at_once(model: str) -> None:
    """A request that queued past ``router_hint_max_age_s`` is looked up, but when the index
    does not answer within the scheduler's wait the expired hint answers after all, in the
    same step: its pools are loaded (the request is not held a step for the late lookup), and
    a hint of nothing is computed in full at once; both counted."""
    from kvshare.vllm.router_hint import encode

    sched = make_scheduler(model, extra={"router_hint_max_age_s": 0.5})
    index = gate(sched)
    toks, cold = tokens(61), tokens(62)
    seed_pool(sched, toks)
    index.gated.update({tuple(toks), tuple(cold)})
    try:
        hint = encode(4 * BLOCK, [[4, [["node:local", 1]]]], CLIENT["c"].hashes(toks))
        req = request("e0", toks, max_tokens=1, kv_transfer_params=hint)
        req.arrival_time -= 2.0
        sched.add_request(req)
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"e0": len(toks) - 4 * BLOCK}  # loaded, no hold
        sched.update_from_output(out, output([req]))
        nothing = request("e1", cold, max_tokens=1, kv_transfer_params=encode(0))
        nothing.arrival_time -= 2.0
        sched.add_request(nothing)
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"e1": len(cold)}
        counters = sched.connector.counters
        assert counters["router_hints_expired"] == 2 and counters["lookups"] == 2
        assert counters["router_hints_expired_used"] == 2
    finally:
        index.open.set()


def test_a_router_hint_with_the_pools_answer_plans_the_load_with_no_lookup(model: str) -> None:
    """A hint that carries the router's index answer for the pools is planned from at once:
    the request is scheduled in the step it arrives with the pool's blocks loaded, although
    the connector's own index query would not answer for 30 s; a hint whose block hashes are
    not the connector's (another hashing) or whose pools are malformed is ignored (counted)
    and the request is looked up."""
    from kvshare.vllm.router_hint import encode

    sched = make_scheduler(model)
    index = gate(sched)
    toks = tokens(51)
    seed_pool(sched, toks)
    hashes = CLIENT["c"].hashes(toks)
    index.gated.add(tuple(toks))
    try:
        hint = encode(4 * BLOCK, [[4, [["node:local", 1]]]], hashes)
        req = request("p0", toks, max_tokens=1, kv_transfer_params=hint)
        sched.add_request(req)
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"p0": len(toks) - 4 * BLOCK}  # 4 blocks loaded
        (load,) = out.kv_connector_metadata.loads
        assert len(load.plan["blocks"]) == 4
        counters = sched.connector.counters
        assert counters["lookups_from_router"] == 1 and not counters.get("lookups")
        sched.update_from_output(out, output([req]))
    finally:
        index.open.set()
    bad = [encode(4 * BLOCK, [[4, [["node:local", 1]]]], CLIENT["c"].hashes(tokens(53))),
           {"kvshare": {"held_tokens": 4 * BLOCK, "pools": [[0, []]], "tip": ""}}]
    for i, params in enumerate(bad):
        other = tokens(54 + i)
        seed_pool(sched, other)
        req = request(f"p{i + 1}", other, max_tokens=1, kv_transfer_params=params)
        sched.add_request(req)
        out = schedule_until(sched, lambda o, r=req: r.request_id in o.num_scheduled_tokens)
        assert out.num_scheduled_tokens[req.request_id] == len(other) - 4 * BLOCK  # looked up
        sched.update_from_output(out, output([req]))
    counters = sched.connector.counters
    assert counters["router_hints_mismatched"] == 1 and counters["router_hints_malformed"] == 1
    assert counters["lookups"] == 2 and counters["lookups_from_router"] == 1


def test_a_negative_router_hint_max_age_is_refused_by_name() -> None:
    from kvshare.vllm.connector.config import ConnectorSettings

    with pytest.raises(ValueError, match="router_hint_max_age_s"):
        ConnectorSettings.from_extra({"namespace": "t", "router_hint_max_age_s": -1})
    assert ConnectorSettings.from_extra({"namespace": "t"}).router_hint_max_age_s == 1.0


def test_a_request_that_opts_out_is_neither_looked_up_nor_loaded_nor_saved(model: str) -> None:
    """``{"kvshare": {"share": false}}``: the pool holds the prompt, yet the request computes
    all of it and saves nothing (vLLM's own cache only); the same prompt without the flag
    loads from the pool; a malformed flag is counted and the request shared as always."""
    from kvshare.vllm.connector.opt_out import encode

    sched = make_scheduler(model)
    toks = tokens(51)
    seed_pool(sched, toks)
    out_req = request("o0", toks, max_tokens=1, kv_transfer_params=encode(False))
    sched.add_request(out_req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"o0": len(toks)}
    assert not out.kv_connector_metadata.saves and not out.kv_connector_metadata.loads
    sched.update_from_output(out, output([out_req]))
    counters = sched.connector.counters
    assert counters["skipped_opt_out"] == 1 and not counters.get("lookups")
    other = tokens(52)
    seed_pool(sched, other)
    for rid, params in (("o1", encode(True)), ("o2", {"kvshare": {"share": "no"}})):
        req = request(rid, other, max_tokens=1, kv_transfer_params=params)
        sched.add_request(req)
        out = schedule_until(sched, lambda o, r=rid: r in o.num_scheduled_tokens)
        assert out.num_scheduled_tokens[rid] == len(other) - 4 * BLOCK  # loaded from the pool
        sched.update_from_output(out, output([req]))
        other = tokens(53)
        seed_pool(sched, other)
    counters = sched.connector.counters
    assert counters["share_flags_malformed"] == 1 and counters["skipped_opt_out"] == 1

class GatedIndex:
    """The test's client, except that lookups of the prompts in ``gated`` wait for ``open``
    (an index that answers late); everything else goes to the client."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.gated: set[tuple[int, ...]] = set()
        self.open = threading.Event()

    def lookup(self, tokens: Any, hashes: Any = None) -> Any:
        if tuple(tokens) in self.gated:
            self.open.wait(30)
        return self.client.lookup(tokens, hashes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def gate(sched: Any) -> GatedIndex:
    side = sched.connector._sched
    side.client = GatedIndex(side.client)
    return side.client  # type: ignore[no-any-return]


def schedule_until(sched: Any, cond: Callable[[Any], bool], steps: int = 200) -> Any:
    """Schedule (empty model outputs) until ``cond(scheduler_output)``; bounded."""
    for _ in range(steps):
        out = sched.schedule()
        if cond(out):
            return out
        sched.update_from_output(out, output([]))
        time.sleep(0.01)
    raise AssertionError(f"not scheduled within {steps} steps")


def test_a_slow_lookup_does_not_hold_the_lookups_behind_it(model: str) -> None:
    """Lookups run concurrently: a request whose index answer is late waits alone, the next
    cold request is looked up, loaded and scheduled meanwhile."""
    sched = make_scheduler(model, extra={"price_lookups": False})
    index = gate(sched)
    slow, fast = tokens(10), tokens(11)
    seed_pool(sched, fast)
    index.gated.add(tuple(slow))
    try:
        sched.add_request(request("slow", slow))
        sched.add_request(request("fast", fast))
        out = schedule_until(sched, lambda o: "fast" in o.num_scheduled_tokens)
        assert out.num_scheduled_tokens == {"fast": len(fast) - 4 * BLOCK}  # loaded, not computed
        assert "slow" not in out.num_scheduled_tokens  # unpriced: still held for its lookup
    finally:
        index.open.set()
    out = schedule_until(sched, lambda o: "slow" in o.num_scheduled_tokens)
    assert sched.connector.counters.get("lookups_abandoned", 0) == 0


def test_on_slow_steps_a_lookup_in_flight_is_waited_for_within_the_step(model: str) -> None:
    """Answering "ask again" costs a request a whole step: where steps take seconds (a loaded
    CPU engine), the scheduler waits for a lookup that answers in 0.1 s and schedules the
    request, loaded, in the step it arrived; on fast steps it does not wait that long."""
    from kvshare.vllm.connector.lookup import MAX_WAIT_S, Lookups

    sched = make_scheduler(model, extra={"price_lookups": False})
    sched.connector._sched.lookups.speed.step_s = 2.0  # what StepSpeed measured: 2 s steps
    index = gate(sched)
    toks = tokens(12)
    seed_pool(sched, toks)
    index.gated.add(tuple(toks))
    threading.Timer(0.1, index.open.set).start()
    sched.add_request(request("s", toks))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"s": len(toks) - 4 * BLOCK}  # loaded, first step

    lookups = Lookups(1)
    assert lookups.wait_s(0.02) == 0.02  # unmeasured: the floor
    lookups.speed.step_s = 0.03
    assert lookups.wait_s(0.02) == 0.02  # fast steps: the floor
    lookups.speed.step_s = 60.0
    assert lookups.wait_s(0.02) == MAX_WAIT_S
    lookups.close()


def test_a_lookup_held_longer_than_it_could_save_becomes_a_miss(model: str) -> None:
    """Once the engine's speed is measured, a request is held for its lookup no longer than
    the prefill the lookup could save: then it is computed as a miss (no error), and the late
    answer still spares the cluster the blocks it held (not stored again)."""
    sched = make_scheduler(model, budget=256)
    index = gate(sched)
    warm = request("w", tokens(12, BLOCK - 1), max_tokens=3)  # busy steps: speed measured
    sched.add_request(warm)
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, output([warm]))
    assert sched.connector._sched.lookups.speed.tokens_per_s > 0
    toks = tokens(13, 8 * BLOCK + 5)
    seed_pool(sched, toks)  # the cluster holds its 8 blocks, but answers late
    index.gated.add(tuple(toks))
    try:
        sched.add_request(request("late", toks))
        out = schedule_until(sched, lambda o: "late" in o.num_scheduled_tokens)
        assert out.num_scheduled_tokens["late"] == 256  # computing from token 0: a miss
        counters = sched.connector.counters
        assert counters["lookups_abandoned"] == 1 and not counters.get("lookup_errors")
        assert [s.start_block for s in out.kv_connector_metadata.saves] == [0]
    finally:
        index.open.set()
    side = sched.connector._sched
    st = side._reqs["late"]
    deadline = time.monotonic() + 30
    while st.late is not None and not st.late.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    saves = []
    for _ in range(3):  # the rest of the prompt (chunks of 256 tokens)
        req = sched.requests["late"]
        sched.update_from_output(out, output([req] if out.num_scheduled_tokens else []))
        out = sched.schedule()
        saves += out.kv_connector_metadata.saves
    assert saves == []  # blocks 4-7 were in the cluster: the late answer said so
    assert side.counters["lookups"] == 1  # abandoned for good: never looked up again


def test_bad_config_fails_at_start_up_naming_the_fix(model: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not a multiple of vLLM's --block-size 32.*e\.g\. 32"):
        make_scheduler(model, block_tokens=48)
    with pytest.raises(ValueError, match="chunked local attention.*remove the KVShareConnector"):
        make_scheduler(model, attention_chunk_size=128)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        from kvshare.vllm.connector.config import ConnectorSettings

        ConnectorSettings.from_extra({"namespace": "t", "blocktokens": 64})
    with pytest.raises(ValueError, match='"sync_save_mib" must be >= 0'):
        ConnectorSettings.from_extra({"namespace": "t", "sync_save_mib": -1})


def test_step_speed_counts_busy_steps_only() -> None:
    """Tokens per second over steps that continue a request; an idle gap between bursts (no
    request in common) is not read as a slow engine."""
    from kvshare.vllm.connector.lookup import StepSpeed

    speed = StepSpeed(alpha=1.0)
    assert speed.seconds_for(100) is None  # unmeasured
    speed.step({"a": 500}, now=0.0)
    speed.step({"a": 1}, now=0.5)  # a's 500 tokens took 0.5 s
    assert speed.tokens_per_s == 1000
    speed.step({"b": 300}, now=60.0)  # idle for a minute, then a new request
    assert speed.tokens_per_s == 1000 and speed.seconds_for(250) == 0.25
    assert speed.step_s == 0.5  # the busy step's length; the idle gap is not one


class RecordingLookups:
    """The test's client, recording whether each lookup asked to load every held block."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.load_all: list[bool] = []

    def lookup(self, tokens: Any, hashes: Any = None, *, load_all: bool = False) -> Any:
        self.load_all.append(load_all)
        return self.client.lookup(tokens, hashes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_requests_cut_flag_reaches_its_lookup_and_a_malformed_one_is_counted(model: str) -> None:
    """``{"kvshare": {"cut": "all"}}`` asks the client to load every held block; ``cost``, no
    flag and a malformed one (counted) keep the connector's cut."""
    from kvshare.vllm.connector.cut_flag import encode

    sched = make_scheduler(model)
    side = sched.connector._sched
    side.client = rec = RecordingLookups(side.client)
    for i, params in enumerate((encode("all"), encode("cost"), None, {"kvshare": {"cut": 3}})):
        toks = tokens(60 + i)
        seed_pool(sched, toks)
        req = request(f"c{i}", toks, max_tokens=1, kv_transfer_params=params)
        sched.add_request(req)
        out = schedule_until(sched, lambda o, r=f"c{i}": r in o.num_scheduled_tokens)
        sched.update_from_output(out, output([req]))
    assert rec.load_all == [True, False, False, False]
    assert sched.connector.counters["cut_flags_malformed"] == 1
    with pytest.raises(ValueError, match="cut must be one of"):
        encode("most")
