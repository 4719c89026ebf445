"""The reference worker's OpenAI HTTP API (real uvicorn, real HTTP, the openai client)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from engine_helpers import BLOCK, prompt, small_engine
from openai import OpenAI

from kvshare.client.local import LocalKVClient
from kvshare.engines.server import WorkerServer
from kvshare.engines.worker import ReferenceWorker
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import PoolConfig, TierSpec
from kvshare.tiers.host import HostSlab
from kvshare.types import NodeId, Tier, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

NS = "srv-test"


class Recorder:
    """Collects registrations and load reports (stands in for nothing: the index has its own
    tests; this checks what the worker sends and how often)."""

    def __init__(self) -> None:
        self.infos: list[WorkerInfo] = []
        self.loads: list[WorkerLoad] = []
        self.lock = threading.Lock()

    def register_worker(self, info: WorkerInfo) -> int:
        with self.lock:
            self.infos.append(info)
        return 1

    def report_load(self, load: WorkerLoad) -> bool:
        with self.lock:
            self.loads.append(load)
        return True


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[WorkerServer, Recorder, ReferenceWorker]]:
    engine = small_engine()
    layout = engine.layout
    pool = TieredBlockPool(
        PoolConfig(NS, layout, (TierSpec(Tier.HOST, 64 * layout.bytes_per_block),)),
        {Tier.HOST: HostSlab(layout.bytes_per_block, 64)},
    )
    worker = ReferenceWorker(engine, LocalKVClient(pool, engine.root))
    rec = Recorder()
    info = WorkerInfo(WorkerId("w0"), NodeId("n0"), (NS,), layout_fingerprint=layout.fingerprint())
    server = WorkerServer(worker, info, model_name="tiny", registrar=rec)
    server.start()
    yield server, rec, worker
    server.stop()


def test_completions_chat_and_streaming_agree(served) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    client = OpenAI(base_url=server.endpoint + "/v1", api_key="x")
    text = "The quick brown fox jumps over the lazy dog. " * 3
    full = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=text, max_tokens=8, stream=True,
                                           extra_body={"ignore_eos": True})
    )
    assert full.usage is not None and full.usage.completion_tokens == 8
    assert streamed == full.choices[0].text
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)  # type: ignore[arg-type]
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, stream=True)]  # type: ignore[arg-type]
    assert "".join(parts) == chat.choices[0].message.content


def test_routed_request_uses_token_ids_and_reuses_blocks(served) -> None:  # type: ignore[no-untyped-def]
    server, _, worker = served
    toks = prompt(4 * BLOCK + 5, seed=21)
    hashes = [h.hex() for h in worker.engine.hashes(toks)]
    body = {"model": "tiny", "prompt": "ignored", "max_tokens": 4, "ignore_eos": True,
            "kvshare": {"token_ids": toks, "namespace": NS, "hashes_hex": hashes}}
    first = httpx.post(server.endpoint + "/v1/completions", json=body, timeout=30).json()
    again = httpx.post(server.endpoint + "/v1/completions", json=body, timeout=30).json()
    assert first["usage"]["prompt_tokens"] == len(toks)
    assert first["kvshare"]["reused_tokens"] == 0
    assert again["kvshare"]["reused_tokens"] == 4 * BLOCK
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    stats = httpx.get(server.endpoint + "/v1/kvshare/stats").json()
    assert stats["counters"]["prefill_tokens_saved"] >= 4 * BLOCK
    assert stats["client"]["loaded_blocks"] >= 4 and stats["client"]["stored_blocks"] >= 4
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.endpoint + "/metrics").text
    got = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
           for fam in text_string_to_metric_families(text) for smp in fam.samples}
    w = (("worker", "w0"),)
    assert got[("kvshare_worker_prefill_tokens_saved_total", w)] >= 4 * BLOCK
    assert got[("kvshare_worker_ttft_seconds_count", w)] == stats["counters"]["requests"]
    nbytes = 4 * worker.engine.layout.bytes_per_block
    assert got[("kvshare_worker_bytes_loaded_total", (("transport", "local"), *w))] >= nbytes
    assert got[("kvshare_client_loaded_blocks_total", w)] >= 4


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"kvshare": {"token_ids": [1, 2], "namespace": "other"}}, "namespace"),
        ({"kvshare": {"token_ids": list(range(40)), "hashes_hex": ["00" * 32, "11" * 32]}},
         "disagree"),
        ({"kvshare": {"token_ids": [1, 99999]}}, "outside"),
        ({"temperature": 0.7}, "greedily"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_bad_requests_get_400_naming_the_fix(served, patch, needle) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = served
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **patch}
    r = httpx.post(server.endpoint + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_registers_and_reports_load_every_100ms(served) -> None:  # type: ignore[no-untyped-def]
    server, rec, _ = served
    start = len(rec.loads)
    deadline = time.monotonic() + 30
    while len(rec.loads) < start + 5:  # a bounded poll: a busy CI machine delays reports
        assert time.monotonic() < deadline, f"{len(rec.loads) - start} load reports in 30 s"
        time.sleep(0.05)
    with rec.lock:
        assert rec.infos and rec.infos[0].endpoint == server.endpoint
        ts = [ld.ts for ld in rec.loads[-5:]]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:], strict=False))
    assert all(g > 0 for g in gaps) and gaps[len(gaps) // 2] < 0.5, gaps  # periodic, ~100 ms


def test_tenant_salt_gets_its_own_blocks(served) -> None:  # type: ignore[no-untyped-def]
    server, _, worker = served
    toks = prompt(3 * BLOCK + 2, seed=31)
    url = server.endpoint + "/v1/completions"

    def ask(salt: str | None) -> dict:  # type: ignore[type-arg]
        extra = {"token_ids": toks, "namespace": NS,
                 "hashes_hex": [h.hex() for h in worker.engine.hashes(toks, salt)]}
        if salt:
            extra["cache_salt"] = salt
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "kvshare": extra}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    plain = ask(None)
    first, again = ask("tenant-a"), ask("tenant-a")
    assert plain["kvshare"]["reused_tokens"] == 0 and first["kvshare"]["reused_tokens"] == 0
    assert again["kvshare"]["reused_tokens"] == 3 * BLOCK
    assert again["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    wrong = {"model": "tiny", "prompt": "x", "max_tokens": 3,
             "kvshare": {"token_ids": toks, "cache_salt": "tenant-b",
                         "hashes_hex": [h.hex() for h in worker.engine.hashes(toks, "tenant-a")]}}
    assert httpx.post(url, json=wrong, timeout=30).status_code == 400


def test_a_taken_port_is_refused_by_name_and_the_server_keeps_its_own(served) -> None:  # type: ignore[no-untyped-def]
    server, _, worker = served
    info = WorkerInfo(WorkerId("w1"), NodeId("n0"), (NS,))
    with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{server.port}.*free port"):
        WorkerServer(worker, info, model_name="tiny", port=server.port)
    # The port is held from construction, so nothing can take it before start(); the running
    # server still answers on it.
    assert httpx.get(server.endpoint + "/v1/models", timeout=10).status_code == 200
