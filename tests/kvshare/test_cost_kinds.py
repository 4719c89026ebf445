"""The cost model prices what a hit moves per attention kind: an MLA layout's latent, a
sliding-window layout's full-attention blocks plus only the last window of each sliding group."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from paths import ROOT

from kvshare.attention import AttentionKind, KVGroup
from kvshare.cost import Bandwidths, CostModel, PrefillModel, Source
from kvshare.cost_cut import CostCut
from kvshare.layout import KVLayout

CONFIGS = ROOT / "kvshare" / "configs"
OSS = KVLayout.from_hf_config(CONFIGS / "gpt-oss-20b.json")  # 12 full + 12 window-128 layers
OSS_AS_MHA = KVLayout(24, 8, 64, "bf16")  # the same 24 layers, all full attention
GROUP_BLOCK = 12 * 2 * 8 * 64 * 2 * 256  # one group's share block: 6 MiB
BW = Bandwidths(host=25e9, disk=5e9, remote=10e9, local_latency_s=0.0, remote_latency_s=0.001)


def test_for_layout_routes_the_bytes_through_the_kind() -> None:
    slow = PrefillModel(1e-3)
    mha = KVLayout.from_hf_config(CONFIGS / "Llama-3.1-8B.json")
    assert CostModel.for_layout(slow, BW, mha) == CostModel(slow, BW, 256, 131072)
    mla = CostModel.for_layout(slow, BW, KVLayout.from_hf_config(CONFIGS / "DeepSeek-V3.json"))
    assert (mla.bytes_per_token, mla.windows) == (70272, ())  # the latent: 61 x 576 x 2
    oss = CostModel.for_layout(slow, BW, OSS)
    assert (oss.bytes_per_token, oss.windows) == (24576, ((1, 24576),))
    assert CostCut(OSS).model.windows == ((1, 24576),)  # the worker's cut prices the same


def test_a_sliding_hit_is_priced_at_far_fewer_bytes_than_mha_of_the_same_layers() -> None:
    slow = PrefillModel(1e-3)  # 1 ms/token: every cached block is worth fetching
    blocks = 512  # a 131,072-token prefix on another node's host tier
    runs = [(int(Source.REMOTE_HOST), blocks)]
    oss = CostModel.for_layout(slow, BW, OSS).plan_runs(blocks * 256 + 1, runs)
    mha = CostModel.for_layout(slow, BW, OSS_AS_MHA).plan_runs(blocks * 256 + 1, runs)
    assert oss.cut == mha.cut == blocks
    assert mha.fetch_s == pytest.approx(0.001 + blocks * 2 * GROUP_BLOCK / 10e9)
    assert oss.fetch_s == pytest.approx(0.001 + (blocks + 1) * GROUP_BLOCK / 10e9)
    assert (mha.fetch_s - 0.001) / (oss.fetch_s - 0.001) == pytest.approx(1024 / 513)
    gemma3 = KVLayout.from_hf_config(CONFIGS / "gemma-3-27b-it.json")  # 10 full, 52 window-1024
    g3 = CostModel.for_layout(slow, BW, gemma3).plan_runs(blocks * 256 + 1, runs)
    g3_mha = CostModel.for_layout(slow, BW, KVLayout(62, 16, 128)).plan_runs(
        blocks * 256 + 1, runs)
    assert (g3_mha.fetch_s - 0.001) / (g3.fetch_s - 0.001) > 5  # 62 x 512 / (10 x 512 + 52 x 4)


def test_a_hit_mha_would_recompute_is_worth_fetching_under_a_window() -> None:
    """A link where a whole block costs more than prefilling it, half a block less: the MHA
    plan recomputes everything, the sliding layout's plan fetches the whole prefix."""
    per_token_s = 1.5 * GROUP_BLOCK / 256 / BW.remote  # between half and all of a block's bytes
    prefill = PrefillModel(per_token_s)
    runs = [(int(Source.REMOTE_HOST), 64)]
    assert CostModel.for_layout(prefill, BW, OSS_AS_MHA).plan_runs(64 * 256 + 1, runs).cut == 0
    assert CostModel.for_layout(prefill, BW, OSS).plan_runs(64 * 256 + 1, runs).cut == 64


def test_every_layer_sliding_costs_no_more_than_its_window() -> None:
    mistral = KVLayout(32, 8, 128, "bf16", kind=AttentionKind.SLIDING,
                       groups=(KVGroup(tuple(range(32)), 4096),))
    model = CostModel.for_layout(PrefillModel(1e-3), BW, mistral)
    assert (model.bytes_per_token, model.windows) == (0, ((16, 131072),))
    short = model.plan_runs(16 * 256 + 1, [(int(Source.REMOTE_HOST), 16)])
    long = model.plan_runs(400 * 256 + 1, [(int(Source.REMOTE_HOST), 400)])
    assert (short.cut, long.cut) == (16, 400)
    assert long.fetch_s == pytest.approx(short.fetch_s)  # the last 16 blocks either way


def price(model: CostModel, total: int, srcs: Sequence[int], k: int) -> float:
    """A cut at ``k`` priced from the definition: every block's bytes for blocks ``0..k-1``,
    each window's bytes for its last ``w`` blocks before ``k``, latency per kind of source."""
    bw, pm = model.bandwidths, model.prefill
    c = model.cached_tokens(k, total)
    fetch = sum(model.block_fetch_s[s] for s in srcs[:k])
    for w, wf in model.window_fetch_s:
        fetch += sum(wf[s] for s in srcs[max(0, k - w):k])
    fetch += bw.remote_latency_s if any(s >= 3 for s in srcs[:k]) else 0.0
    fetch += bw.local_latency_s if any(0 < s < 3 for s in srcs[:k]) else 0.0
    return fetch + pm.time(total - c, c)


def reference(model: CostModel, total: int, srcs: Sequence[int]) -> float:
    """The cheapest cut's price, every useful cut computed."""
    useful = min(len(srcs), -(-(total - 1) // model.block_tokens))
    return min(price(model, total, srcs, k) for k in range(useful + 1))


def test_windowed_plans_match_the_definition_on_mixed_sources() -> None:
    rng = random.Random(38)
    for _ in range(300):
        bt = rng.choice((16, 64, 256))
        windows = tuple((rng.choice((1, 2, 5, 16)), rng.choice((1024, 65536)))
                        for _ in range(rng.choice((1, 2))))
        model = CostModel(PrefillModel(rng.choice((1e-5, 1e-4, 1e-3)), rng.choice((0.0, 1e-9))),
                          BW, bt, rng.choice((0, 4096, 131072)), windows)
        n_blocks = rng.randrange(1, 60)
        srcs = [rng.randrange(0, 6) for _ in range(n_blocks)]
        total = n_blocks * bt + rng.choice((-bt // 2, 0, 1, 5 * bt))
        runs: list[tuple[int, int]] = []
        for s in srcs:
            runs = runs[:-1] + [(s, runs[-1][1] + 1)] if runs and runs[-1][0] == s else (
                runs + [(s, 1)])
        plan = model.plan_runs(total, runs)
        assert plan.total_s == pytest.approx(reference(model, total, srcs), rel=1e-9)
        assert plan.total_s == pytest.approx(price(model, total, srcs, plan.cut), rel=1e-9)


@pytest.mark.parametrize("windows", [((1, 0),), ((-1, 8),)])
def test_bad_windows(windows: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError, match="windows"):
        CostModel(PrefillModel(1e-3), BW, 256, 1024, windows)


def test_the_router_prices_a_sliding_layout_by_its_windows() -> None:
    """RouterConfig takes the workers' layout terms; the routing core's model carries them."""
    from types import SimpleNamespace

    from kvshare.router.core.embed import RouterConfig
    from kvshare.router.core.routing import RoutingCore

    cfg = RouterConfig.from_model_keys(SimpleNamespace(identity="m", layout=OSS))
    assert (cfg.bytes_per_token, cfg.kv_windows) == (24576, ((1, 24576),))
    core = RoutingCore(None, cfg.cost_inputs(), policy="cost")
    assert core.cost == CostModel(PrefillModel.from_tokens_per_s(cfg.prefill_tokens_per_s),
                                  cfg.bandwidths, 256, 24576, ((1, 24576),))
    mha = RouterConfig.from_model_keys(SimpleNamespace(identity="m", layout=OSS_AS_MHA))
    assert (mha.bytes_per_token, mha.kv_windows) == (49152, ())
