"""Routing decisions per second through CacheAwareRouter (8k-token prompts, 16 workers).

Measures, in one run:
- baseline: ``round_robin`` through the same router (tokenize + hash + no scoring work);
- ``cost`` with the GlobalIndex in-process (``InProcessIndex``);
- ``cost`` through the real index actor (``GlobalIndexActor`` + ``IndexClient.match_async``),
  sequential (latency: p50/p99 per decision) and with 32 decisions in flight (throughput);
- ``cost`` on a router-side replica of that actor index (``IndexReplica``, fed by the
  index's change stream, no actor call per decision): ``replica_decisions_per_s``,
  ``replica_p99_ms`` (targets >= 20,000/s, p99 <= 1 ms), after checking that the replica
  answers every prompt as the actor does.
The index holds 16 nodes' worth of blocks of prompts that share system-prompt prefixes.
A timed decision is what the gateway does per request: ``route`` on the prompt's token ids
(hash its 32 blocks, the index's match, the worker list and loads with this router's
in-flight work, the pending blocks' match, every worker scored by the policy, the pending
blocks and in-flight work recorded at the chosen worker, metrics, the recent-decisions record)
and ``finished`` when done. Every decision gets a new prompt (:class:`Traffic`): a system
prompt the index holds + a tail never seen before, fresh int objects, cold in cache. The
router keeps its verified hash memo (``RouterConfig.hash_memo_blocks``), which can save only
the system prompts' blocks; the replica leg is run again without it (``replica_no_memo_*``).
The replica leg is also run on multi-turn conversations (:class:`Conversations`: each decision
a conversation's next turn, lists of fresh ints, sha256; ``replica_multiturn_*``), the traffic
chat clients and agents send, where the hash memo answers every block but the new message's.
The replica leg is run a third time on the same kind of prompts handed over packed (a numpy
``uint32`` array per prompt, as a gateway that keeps its tokenizer's ids packed would pass them:
``replica_packed_*``): hashed from their bytes, and no int objects for the collector to walk.
The packed leg is run once more with the opt-in xxh3-128 block hash (``replica_xxh3_packed_*``;
non-cryptographic, for single-tenant clusters only: not the default, not the headline).
The replica leg also prints the score stage's parts (``replica_score_parts_us``) and the
garbage collector's share of its timed decisions (``replica_gc_share``,
``replica_gc_us_per_decision``: collections that ran inside them).
Last line: one JSON object with ``decisions_per_s``, ``actor_decisions_per_s``,
``p99_decision_ms`` (targets: >= 5,000/s in-process; p99 <= 5 ms through the actor).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (before any kvshare import: this
# tree's modules, not an editable install's)

import numpy as np

from kvshare.actors.index.global_index import GlobalIndex
from kvshare.events import BlockStored
from kvshare.hashing import HashFn
from kvshare.ray_env import use_local_ray_defaults
from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, RouterConfig, Tenant
from kvshare.router.core.workers_view import StaticWorkers
from kvshare.types import NodeId, Tier, WorkerId, node_location
from kvshare.workers import WorkerInfo, WorkerLoad

NS = "bench"
WORKERS = 16
TOKENS = 8192
BT = 256
N_PROMPTS = 400


def prompts(rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """20 system prompts (2k-6k tokens) and prompts of 8k tokens: a system prompt + a unique tail."""
    systems = [[rng.randrange(32000) for _ in range(rng.choice((2048, 4096, 6144)))] for _ in range(20)]
    out = []
    for _ in range(N_PROMPTS):
        head = rng.choice(systems)
        out.append(head + [rng.randrange(32000) for _ in range(TOKENS - len(head))])
    return systems, out


class Traffic:
    """Decision prompts as a gateway sees them: one of the 20 system prompts (the index holds
    them, from the filled prompts) + a tail of new ids, never seen before, per decision; every
    prompt a fresh list of fresh int objects (as a JSON body or a tokenizer gives them), made
    in batches of 500 (~150 MB, so their ids are cold in cache when routed) outside the timed
    decisions. A hash memo can save only the system prompt's blocks (8-24 of 32)."""

    def __init__(self, seed: int, systems: list[list[int]], packed: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.heads = [np.asarray(h, dtype=np.int64) for h in systems]
        self.packed = packed  # each prompt a numpy uint32 array instead (same ids)

    def batch(self, n: int) -> list[list[int]] | list[np.ndarray]:
        out = []
        for _ in range(n):
            head = self.heads[int(self.rng.integers(len(self.heads)))]
            tail = self.rng.integers(0, 32000, TOKENS - len(head))
            ids = np.concatenate([head, tail])
            out.append(ids.astype(np.uint32) if self.packed else ids.tolist())
        return out


class Conversations(Traffic):
    """Multi-turn traffic, as chat clients and agents send it: ``CONVERSATIONS`` conversations
    at once, each starting from one of the system prompts and growing by a new user message of
    256-767 tokens a turn (a conversation past ``TOKENS`` starts over on another system
    prompt); each decision is a random conversation's next turn, a fresh list of fresh ints
    (a JSON body re-sends the whole conversation). Every block but the new message's repeats
    the conversation's previous turn: what the hash memo is for."""

    def __init__(self, seed: int, systems: list[list[int]]) -> None:
        super().__init__(seed, systems)
        self.convs = [self._start() for _ in range(CONVERSATIONS)]

    def _start(self) -> np.ndarray:
        return self.heads[int(self.rng.integers(len(self.heads)))]

    def batch(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            i = int(self.rng.integers(len(self.convs)))
            turn = np.concatenate([self.convs[i], self.rng.integers(0, 32000, int(
                self.rng.integers(256, 768)))])
            self.convs[i] = turn if len(turn) < TOKENS else self._start()
            out.append(turn.tolist())
        return out


CONVERSATIONS = 64


def make_router(index: object, policy: str, memo: bool = True, ns: str = NS,
                **options: object) -> CacheAwareRouter:
    infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (ns,), f"http://w{i}") for i in range(WORKERS)]
    ws = StaticWorkers(infos)
    for i, info in enumerate(infos):
        ws.report(WorkerLoad(info.worker_id, 1000 * (i % 5), i % 3, 8000.0, time.time()))
    extra = {} if memo or not MEMO_OPTION else {"hash_memo_blocks": 0}
    cfg = RouterConfig(namespace=ns, model_id="bench", block_tokens=BT, policy=policy,
                       index_timeout_s=0.25, **extra, **options)  # type: ignore[arg-type]
    return CacheAwareRouter(index, ws, cfg)  # type: ignore[arg-type]


def fill(apply: object, router: CacheAwareRouter, reqs: list[list[int]], rng: random.Random,
         ns: str = NS) -> int:
    """Store every other prompt's blocks on a random node (as pools would publish them)."""
    n = 0
    seqs: dict[str, int] = {}
    for ids in reqs[::2]:
        node = f"n{rng.randrange(WORKERS)}"
        loc = node_location(node)
        evs = []
        for h in router.hashes(ids, Tenant()):
            seqs[loc] = seqs.get(loc, 0) + 1
            evs.append(BlockStored(ns, loc, Tier.HOST, h, 0, seqs[loc]))
        apply(evs)  # type: ignore[operator]
        n += len(evs)
    return n


MEMO_OPTION = "hash_memo_blocks" in RouterConfig.__dataclass_fields__  # (older code: none)
NS_XXH3 = "bench-xxh3"
BATCH = 500
CPU_RATES: dict[str, float] = {}
STAGES_US: dict[str, dict[str, float]] = {}  # per tag: median microseconds per decision stage


GC_S: dict[str, float] = {}  # per tag: seconds the garbage collector ran in timed decisions


class _GcClock:
    """Seconds spent in the garbage collector while ``on`` (a ``gc.callbacks`` hook)."""

    def __init__(self) -> None:
        self.on = False
        self.total = 0.0
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self.on:
            self.total += time.perf_counter() - self._t


async def sequential(router: CacheAwareRouter, traffic: Traffic, n: int,
                     tag: str = "") -> tuple[float, list[float]]:
    """``n`` decisions one after another on new prompts; decisions/s over the time spent
    deciding (making the prompts is not timed). The collector's time within the timed
    decisions is recorded (``GC_S``): it counts, as it would in a gateway, mostly young
    collections walking every prompt list alive (8k ids each)."""
    lat = []
    stages: dict[str, list[float]] = {}
    wall = cpu = 0.0
    gc_clock = _GcClock()
    gc.callbacks.append(gc_clock)
    for start in range(0, n, BATCH):
        reqs = traffic.batch(min(BATCH, n - start))
        gc_clock.on = True
        t0, c0 = time.perf_counter(), time.process_time()
        for ids in reqs:
            t = time.perf_counter()
            r = await router.route(token_ids=ids)
            router.finished(r.request_id)
            lat.append(time.perf_counter() - t)
            for k, v in r.timings.items():
                stages.setdefault(k, []).append(v)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        gc_clock.on = False
        del reqs
    gc.callbacks.remove(gc_clock)
    if tag:  # decisions per CPU second of this process: what an idle core would give
        CPU_RATES[tag] = n / max(1e-9, cpu)
        STAGES_US[tag] = {k: round(float(np.median(v)) * 1e6, 1) for k, v in stages.items()}
        GC_S[tag] = gc_clock.total
    return n / wall, lat


def parts(router: CacheAwareRouter, traffic: Traffic, n: int) -> dict[str, float]:
    """Median microseconds of the score stage's parts over ``n`` more decisions, each part
    timed by a wrapper (adds ~0.2 us to each): worker list and in-flight load (candidates, of
    which ``inflight_loads``), the pending blocks' match and recording, the policy's ranking
    (``policy_rank``: of which ``select`` and ``source_view``, the candidate loop and its view,
    and ``ready_add``, the ready blocks' record), the in-flight record, metrics and the
    recent-decisions record."""
    import kvshare.router.core.policy as policy_module

    core, times = router.core, dict[str, list[float]]()
    policy = core.policy
    targets = ((core, "candidates", "candidates"), (core.inflight, "loads", "inflight_loads"),
               (core.pending, "match_runs", "pending_match"),
               (core.pending, "add", "pending_add"), (policy_module, "SourceMap", "source_view"),
               (policy, "rank", "policy_rank"), (policy, "_select", "select"),
               (policy, "observe", "ready_add"), (core.inflight, "add", "inflight_add"),
               (router, "_count", "metrics"), (router.recent, "add", "recent"))
    saved = []
    for owner, name, label in targets:
        f = getattr(owner, name)

        def wrapper(*args: object, _f: object = f, _label: str = label, **kw: object) -> object:
            t = time.perf_counter()
            try:
                return _f(*args, **kw)  # type: ignore[operator]
            finally:
                times.setdefault(_label, []).append(time.perf_counter() - t)
        saved.append((owner, name, vars(owner).get(name), name in vars(owner)))
        setattr(owner, name, wrapper)
    try:
        asyncio.run(sequential(router, traffic, n))
    finally:
        for owner, name, original, had in saved:
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
    return {k: round(float(np.median(v)) * 1e6, 1) for k, v in times.items()}


async def concurrent(router: CacheAwareRouter, traffic: Traffic, n: int, inflight: int) -> float:
    sem = asyncio.Semaphore(inflight)
    reqs = traffic.batch(min(n, BATCH))  # (cycled: memory stays ~150 MB)

    async def one(i: int) -> None:
        async with sem:
            r = await router.route(token_ids=reqs[i % len(reqs)])
            router.finished(r.request_id)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


def ms(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000, q))


def main() -> None:
    rng = random.Random(0)
    systems, reqs = prompts(rng)
    traffic = Traffic(2, systems)
    # warm the hash path once so both runs measure the same steady state
    base = make_router(None, "round_robin")
    base_rate, _ = asyncio.run(sequential(base, traffic, 2000, "baseline"))

    index = GlobalIndex()
    index.declare_namespace(NS)
    local = make_router(InProcessIndex(index), "cost")
    blocks = fill(index.apply, local, reqs, random.Random(1))
    local_rate, local_lat = asyncio.run(sequential(local, traffic, 3000, "local"))
    print(f"index: {blocks} blocks on {WORKERS} nodes; prompts {TOKENS} tokens, block {BT}")
    print(f"baseline round_robin (no index):   {base_rate:8.0f} decisions/s")
    print(f"cost, in-process GlobalIndex:      {local_rate:8.0f} decisions/s  "
          f"p50 {ms(local_lat, 50):.3f} ms  p99 {ms(local_lat, 99):.3f} ms  "
          f"({local_rate / base_rate:.2f}x of baseline)")

    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             namespace="kvshare-bench-router", object_store_memory=200 * 2**20)
    try:
        actor = GlobalIndexActor.remote(IndexConfig())
        ray.get(actor.ready.remote(), timeout=300)  # (its start, before the 2 s call deadline)
        client = IndexClient([actor], timeout_s=2.0)
        client.declare_namespace(NS)
        remote = make_router(client, "cost")
        fill(lambda evs: ray.get(actor.apply.remote(evs)), remote, reqs, random.Random(1))
        # the xxh3-128 opt-in (single-tenant clusters): the same blocks under 16-byte hashes
        client.declare_namespace(NS_XXH3, hash_size=16)
        fill(lambda evs: ray.get(actor.apply.remote(evs)),
             make_router(client, "cost", ns=NS_XXH3, hash_fn=HashFn.XXH3_128), reqs,
             random.Random(1), ns=NS_XXH3)
        asyncio.run(sequential(remote, traffic, 200))  # warm-up (connections, first calls)
        seq_rate, lat = asyncio.run(sequential(remote, traffic, 1500))
        actor_rate = asyncio.run(concurrent(remote, traffic, 3000, 32))
        from kvshare.actors.index.replica import IndexReplica

        replica = IndexReplica.follow(client, poll_s=0.01)
        try:
            hashes = [remote.hashes(ids, Tenant()) for ids in reqs]
            want = client.namespaces()[NS]["blocks"]
            want_x = client.namespaces()[NS_XXH3]["blocks"]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                    replica.ready and replica.stats()["blocks"].get(NS, 0) == want
                    and replica.stats()["blocks"].get(NS_XXH3, 0) == want_x):
                time.sleep(0.05)
            agree = sum(replica.match(NS, h) == client.match(NS, h) for h in hashes)
            near = make_router(replica, "cost")
            asyncio.run(sequential(near, traffic, 300))  # warm-up
            rep_rate, rep_lat = asyncio.run(sequential(near, traffic, 3000, "replica"))
            rep_parts = parts(near, traffic, 1500)
            bare = make_router(replica, "cost", memo=False)  # every block hashed
            asyncio.run(sequential(bare, traffic, 300))  # warm-up
            bare_rate, bare_lat = asyncio.run(sequential(bare, traffic, 3000, "replica_no_memo"))
            memo = near.hasher.memo.stats() if near.hasher.memo is not None else None
            turns = make_router(replica, "cost")  # multi-turn conversations, lists, sha256
            turn_traffic = Conversations(4, systems)
            asyncio.run(sequential(turns, turn_traffic, 300))  # warm-up
            turns_rate, turns_lat = asyncio.run(sequential(turns, turn_traffic, 3000,
                                                           "replica_multiturn"))
            turns_memo = turns.hasher.memo.stats() if turns.hasher.memo is not None else None
            packed = make_router(replica, "cost")  # the same ids, handed over as uint32 arrays
            packed_traffic = Traffic(3, systems, packed=True)
            asyncio.run(sequential(packed, packed_traffic, 300))  # warm-up
            packed_rate, packed_lat = asyncio.run(sequential(packed, packed_traffic, 3000,
                                                             "replica_packed"))
            xxh3 = make_router(replica, "cost", ns=NS_XXH3, hash_fn=HashFn.XXH3_128)
            asyncio.run(sequential(xxh3, packed_traffic, 300))  # warm-up
            xxh3_rate, xxh3_lat = asyncio.run(sequential(xxh3, packed_traffic, 3000,
                                                         "replica_xxh3_packed"))
            xxh3_cached = sum(r.decision.cached_blocks for r in [
                asyncio.run(xxh3.route(token_ids=ids)) for ids in packed_traffic.batch(50)])
        finally:
            replica.close()
    finally:
        ray.shutdown()
    print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; per CPU-second "
          f"of this process: baseline {CPU_RATES['baseline']:.0f}/s, cost in-process "
          f"{CPU_RATES['local']:.0f}/s")
    print(f"cost, through the index actor:     {seq_rate:8.0f} decisions/s sequential  "
          f"p50 {ms(lat, 50):.3f} ms  p99 {ms(lat, 99):.3f} ms; "
          f"{actor_rate:.0f} decisions/s with 32 in flight; fallbacks {remote.fallbacks}")
    print(f"cost, on an index replica:         {rep_rate:8.0f} decisions/s sequential  "
          f"p50 {ms(rep_lat, 50):.3f} ms  p99 {ms(rep_lat, 99):.3f} ms ({rep_rate / seq_rate:.1f}x "
          f"the actor path; {CPU_RATES['replica']:.0f}/CPU-s); the replica answers {agree}/"
          f"{len(hashes)} prompts as the actor does; fallbacks {near.fallbacks}")
    print(f"the same without the hash memo:    {bare_rate:8.0f} decisions/s sequential  "
          f"p50 {ms(bare_lat, 50):.3f} ms  p99 {ms(bare_lat, 99):.3f} ms "
          f"({CPU_RATES['replica_no_memo']:.0f}/CPU-s); memo {memo}")
    print(f"the same on multi-turn chats:      {turns_rate:8.0f} decisions/s sequential  "
          f"p50 {ms(turns_lat, 50):.3f} ms  p99 {ms(turns_lat, 99):.3f} ms "
          f"({CPU_RATES['replica_multiturn']:.0f}/CPU-s); stages "
          f"{STAGES_US['replica_multiturn']} us; memo {turns_memo}")
    print(f"the same on packed ids (uint32): {packed_rate:8.0f} decisions/s sequential  "
          f"p50 {ms(packed_lat, 50):.3f} ms  p99 {ms(packed_lat, 99):.3f} ms "
          f"({CPU_RATES['replica_packed']:.0f}/CPU-s); stages {STAGES_US['replica_packed']} us; "
          f"collector {GC_S['replica_packed'] / 3000 * 1e6:.0f} us a decision")
    print(f"opt-in xxh3-128 hashes, packed ids:  {xxh3_rate:8.0f} decisions/s sequential  "
          f"p50 {ms(xxh3_lat, 50):.3f} ms  p99 {ms(xxh3_lat, 99):.3f} ms "
          f"({CPU_RATES['replica_xxh3_packed']:.0f}/CPU-s); stages "
          f"{STAGES_US['replica_xxh3_packed']} us; {xxh3_cached} blocks cached over 50 decisions "
          "(not the default: non-cryptographic, single-tenant clusters only)")
    print(f"median microseconds per stage of a decision on the replica: {STAGES_US['replica']} "
          "(score: worker list, in-flight load, pending blocks, the policy's ranking)")
    print(f"median microseconds of the score stage's parts (timed one by one): {rep_parts}")
    print(f"the garbage collector ran {GC_S['replica'] * 1e3:.0f} ms of the replica leg's "
          f"{3000 / rep_rate * 1e3:.0f} ms ({GC_S['replica'] / 3000 * 1e6:.0f} us a decision; "
          "mostly young collections walking the ids of the batch of 500 prompts made before them)")
    print(json.dumps({
        "replica_decisions_per_s": round(rep_rate, 1),
        "replica_p99_ms": round(ms(rep_lat, 99), 3),
        "replica_agrees": agree,
        "replica_decisions_per_cpu_s": round(CPU_RATES["replica"], 1),
        "replica_stage_us": STAGES_US["replica"],
        "replica_gc_share": round(GC_S["replica"] * rep_rate / 3000, 3),
        "replica_gc_us_per_decision": round(GC_S["replica"] / 3000 * 1e6, 1),
        "replica_packed_decisions_per_s": round(packed_rate, 1),
        "replica_packed_p99_ms": round(ms(packed_lat, 99), 3),
        "replica_packed_decisions_per_cpu_s": round(CPU_RATES["replica_packed"], 1),
        "replica_packed_stage_us": STAGES_US["replica_packed"],
        "replica_packed_gc_us_per_decision": round(GC_S["replica_packed"] / 3000 * 1e6, 1),
        "replica_xxh3_packed_decisions_per_s": round(xxh3_rate, 1),
        "replica_xxh3_packed_p99_ms": round(ms(xxh3_lat, 99), 3),
        "replica_xxh3_packed_decisions_per_cpu_s": round(CPU_RATES["replica_xxh3_packed"], 1),
        "replica_xxh3_packed_stage_us": STAGES_US["replica_xxh3_packed"],
        "replica_multiturn_decisions_per_s": round(turns_rate, 1),
        "replica_multiturn_p99_ms": round(ms(turns_lat, 99), 3),
        "replica_multiturn_decisions_per_cpu_s": round(CPU_RATES["replica_multiturn"], 1),
        "replica_multiturn_stage_us": STAGES_US["replica_multiturn"],
        "replica_no_memo_decisions_per_s": round(bare_rate, 1),
        "replica_no_memo_p99_ms": round(ms(bare_lat, 99), 3),
        "replica_no_memo_decisions_per_cpu_s": round(CPU_RATES["replica_no_memo"], 1),
        "replica_no_memo_stage_us": STAGES_US["replica_no_memo"],
        "hash_memo": memo,
        "replica_score_parts_us": rep_parts,
        "decisions_per_s": round(local_rate, 1),
        "actor_decisions_per_s": round(actor_rate, 1),
        "p99_decision_ms": round(ms(lat, 99), 3),
        "baseline_decisions_per_s": round(base_rate, 1),
        "ratio_vs_baseline": round(local_rate / base_rate, 3),
        "p99_decision_ms_in_process": round(ms(local_lat, 99), 3),
        "actor_sequential_decisions_per_s": round(seq_rate, 1),
        "decisions_per_cpu_s": round(CPU_RATES["local"], 1),
        "p50_decision_ms_in_process": round(ms(local_lat, 50), 3),
        "load_average": round(os.getloadavg()[0], 1),
    }))


if __name__ == "__main__":
    use_local_ray_defaults()
    main()
