"""The C cut-point scan (``kvshare._native._plan.scan``) against the Python loop (``kvshare.cost._scan_py``):
the same cut and the very same floats on random models, prompts and runs, linear and
quadratic, flat runs included; inputs outside the plain case are refused (the caller then runs
the Python loop), and ``plan_runs`` plans the same either way.

The extension is optional (setup.py builds it where a C compiler is found); where it is not
built these tests skip, unless ``KVSHARE_REQUIRE_NATIVE=1``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import cost
from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source, _scan_py

native = cost._native_scan
if native is None and os.environ.get("KVSHARE_REQUIRE_NATIVE") == "1":
    raise AssertionError("kvshare._native._plan is not built: run setup.py build_ext --inplace")
pytestmark = pytest.mark.skipif(native is None, reason="kvshare._native._plan not built: Python loop only")


def _args(model: CostModel, total: int, runs: tuple[tuple[int, int], ...]) -> Any:
    bw = model.bandwidths
    return (model.block_fetch_s, model.prefill.a, model.prefill.b, model.block_tokens, total,
            bw.remote_latency_s, bw.local_latency_s, runs)


def _model(rng: random.Random) -> CostModel:
    bt = rng.choice((16, 64, 256, 512))
    bpt = rng.choice((1024, 131_072))
    bw = Bandwidths(rng.choice((1e9, 25e9, 3.3e9)), rng.choice((0.5e9, 5e9)),
                    rng.choice((0.1e9, 12.5e9)), rng.choice((0.0, 0.002, 0.0137)),
                    rng.choice((0.0, 0.001, 0.05)))
    a = rng.choice((1 / 5000, 1 / 400, 1 / 20000, rng.uniform(1e-6, 1e-2)))
    b = rng.choice((0.0, 0.0, 1e-9, 3e-8, 1e-20, rng.uniform(0, 1e-7)))
    if rng.random() < 0.2:  # a flat run: one source's fetch per block equals its prefill
        a = bt * bpt / bw.host / bt
    return CostModel(PrefillModel(a, b), bw, bt, bpt)


def _runs(rng: random.Random, max_blocks: int) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    left = rng.randrange(0, max_blocks + 8)
    while left > 0:
        n = rng.randrange(0, min(left, 40) + 1)
        src = rng.randrange(len(Source))
        if out and out[-1][0] == src:
            continue
        out.append((src, n))
        left -= max(n, 1)
    return tuple(out)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_native_scan_gives_the_python_floats(seed: int) -> None:
    rng = random.Random(seed)
    model = _model(rng)
    total = rng.choice((1, 2, model.block_tokens, model.block_tokens + 1, rng.randrange(1, 40_000)))
    runs = _runs(rng, total // model.block_tokens + 2)
    args = _args(model, total, runs)
    got, want = native(*args), _scan_py(*args)
    assert got == want
    assert [type(x) for x in got] == [int, float, float]


def test_plan_runs_same_with_or_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    cases = []
    for _ in range(500):
        model = _model(rng)
        total = rng.randrange(1, 20_000)
        cases.append((model, total, _runs(rng, total // model.block_tokens + 2)))
    fast = [m.plan_runs(t, r) for m, t, r in cases]
    monkeypatch.setattr(cost, "_native_scan", None)
    slow = [m.plan_runs(t, r) for m, t, r in cases]
    assert [(p.cut, p.cached_tokens, p.fetch_s, p.prefill_s, p.sources) for p in fast] == [
        (p.cut, p.cached_tokens, p.fetch_s, p.prefill_s, p.sources) for p in slow]


def test_outside_the_plain_case_is_refused_and_planned_in_python() -> None:
    model = CostModel(PrefillModel(1 / 5000, 0.0), Bandwidths(), 256, 131_072)
    args = list(_args(model, 8192, ((4, 8),)))
    for i, bad in ((1, 1), (2, 0), (7, [[4, 8]]), (7, ((9, 8),)), (7, ((-1, 8),)), (4, 0)):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises((TypeError, ValueError)):
            native(*wrong)
    # int prefill coefficients (Python's int arithmetic): refused, planned by the Python loop
    exact = CostModel(PrefillModel(1, 0), Bandwidths(), 256, 131_072)
    with pytest.raises(TypeError):
        native(*_args(exact, 8192, ((4, 8),)))
    want = _scan_py(*_args(exact, 8192, ((4, 8),)))
    plan = exact.plan_runs(8192, ((4, 8),))
    assert (plan.cut, plan.fetch_s + plan.prefill_s, plan.fetch_s) == want
