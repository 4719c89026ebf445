"""RecentDecisions makes a decision's record only when it is read or finished; this checks the
records read are exactly those of the decisions added (the newest ``size``, worker figures of
those finished while in the ring) and the tenants' totals count every decision, on random
sequences of decisions, replies and reads."""

from __future__ import annotations

import random

import pytest

import kvshare.router.core.recent as recent_module
from kvshare.router.core.policy import Decision
from kvshare.router.core.recent import RecentDecisions
from kvshare.types import WorkerId


def test_records_read_are_those_of_the_decisions_added(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    clock = iter(range(10**6))
    monkeypatch.setattr(recent_module.time, "time", lambda: float(next(clock)))
    recent = RecentDecisions(size=7)
    model: list[dict[str, object]] = []  # every decision's expected record, oldest first
    totals: dict[str, list[float]] = {}
    for i in range(600):
        op = rng.random()
        if op < 0.6:
            d = Decision(WorkerId(f"w{rng.randrange(3)}"), "http://w", "cost",
                         rng.choice(("load", "cache_local")), rng.random(), rng.random(),
                         rng.randrange(9), rng.randrange(3))
            tenant, tokens, fb = rng.choice("ab"), rng.randrange(1, 900), rng.choice(("", "x"))
            recent.add(f"r{i}", d, tenant, tokens, fb)
            model.append({"request_id": f"r{i}", "at": float(len(model)), "tenant": tenant,
                          "worker": d.worker, "policy": "cost", "reason": d.reason,
                          "prompt_tokens": tokens, "cached_blocks": d.cached_blocks,
                          "remote_blocks": d.remote_blocks, "est_ttft_s": d.est_ttft_s,
                          "est_ttft_saved_s": d.est_ttft_saved_s, "fallback": fb,
                          "worker_stats": {}, "breakdown": {}})
            t = totals.setdefault(tenant, [0, 0, 0, 0.0])
            t[0] += 1
            t[1] += tokens
            t[2] += d.cached_blocks
            t[3] += d.est_ttft_saved_s
        elif op < 0.8 and model:
            rec = rng.choice(model[-10:])
            recent.finish(str(rec["request_id"]), {"ttft_s": 0.5, "breakdown": {"queue": 0.1}})
            if rec in model[-7:]:  # in the ring: kept; fallen out: ignored
                rec["worker_stats"], rec["breakdown"] = {"ttft_s": 0.5}, {"queue": 0.1}
        else:
            who = rng.choice((None, "a", "b"))
            want = [r for r in reversed(model[-7:]) if who is None or r["tenant"] == who]
            assert recent.snapshot(who) == want
    assert {k: list(v.values()) for k, v in recent.tenants.items()} == totals
