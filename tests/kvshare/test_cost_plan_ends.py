"""CostModel.plan_runs computes only the ends of each run where no cut inside can win; this
checks it plans exactly as computing every cut (the loop before the change, kept here as the
reference) on random prompts, runs and models, linear and quadratic, including runs whose
totals are flat (fetch per block equal to its prefill), where every cut is computed."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source


def every_cut(model: CostModel, total_tokens: int,
              runs: Sequence[tuple[int, int]]) -> tuple[int, float, float]:
    """The cut, prefill and fetch seconds, computing every cut (the rest of the plan follows
    from the cut as before)."""
    fetch, bw = model.block_fetch_s, model.bandwidths
    a, b, bt = model.prefill.a, model.prefill.b, model.block_tokens
    p, last = total_tokens, total_tokens - 1
    best_k, best_total, best_fetch = 0, a * p + b * p * p / 2, 0.0
    cum = lat = 0.0
    any_r = any_l = False
    i = 0
    for src, ln in runs:
        f = fetch[src]
        if src >= 3:
            if not any_r:
                any_r, lat = True, lat + bw.remote_latency_s
        elif src and not any_l:
            any_l, lat = True, lat + bw.local_latency_s
        first = i + 1
        for i in range(first, first + ln):
            c = min(i * bt, last)
            cum += f
            n = p - c
            total = cum + lat + a * n + b * n * (c + n / 2)
            if total <= best_total:
                best_k, best_total, best_fetch = i, total, cum + lat
            if c >= last:
                break
        else:
            continue
        break
    return best_k, best_total - best_fetch, best_fetch


def test_plans_as_computing_every_cut() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        bt = rng.choice((16, 64, 256))
        bpt = rng.choice((1024, 131_072))
        bw = Bandwidths(rng.choice((1e9, 25e9)), rng.choice((0.5e9, 5e9)),
                        rng.choice((0.1e9, 12.5e9)), rng.choice((0.0, 0.002)),
                        rng.choice((0.0, 0.001, 0.05)))
        a = rng.choice((1 / 5000, 1 / 400, 1 / 20000))
        b = rng.choice((0.0, 0.0, 1e-9, 3e-8, 1e-20))
        if rng.random() < 0.2:  # a flat run: one source's fetch per block equals its prefill
            src_bw = bw.host
            a = bt * bpt / src_bw / bt
        model = CostModel(PrefillModel(a, b), bw, bt, bpt)
        runs = [(rng.randrange(len(Source)), rng.randrange(1, 12))
                for _ in range(rng.randrange(0, 5))]
        blocks = sum(n for _, n in runs)
        p = max(1, blocks * bt + rng.choice((-bt - 3, -1, 0, 1, bt * 3, -blocks * bt // 2)))
        plan = model.plan_runs(p, runs)
        assert (plan.cut, plan.prefill_s, plan.fetch_s) == every_cut(model, p, runs), (p, runs, a, b)
