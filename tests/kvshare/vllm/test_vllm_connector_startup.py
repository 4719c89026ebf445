"""The connector's start-up check of the deployment (``check_namespace``): an index that is
slow to answer a freshly joined engine process is asked again until the start-up deadline, not
failed on the first slow answer (a lookup's hot-path deadline is 2 s; an engine loading on a
busy 2-core node can take longer for its first actor call); one that never answers, an unknown
namespace and another layout each fail the start with the fix named. The index here is a plain
object answering ``namespaces()`` as the real index client does (what is under test is the
connector's handling of its answers, not Ray)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvshare.layout import KVLayout  # noqa: E402
from kvshare.vllm.connector.config import ConnectorSettings, check_model, refuse_kind  # noqa: E402
from kvshare.vllm.connector.kv_connector import check_namespace  # noqa: E402
from kvshare.vllm.server.worker import VllmKeys  # noqa: E402

LAYOUT = KVLayout(2, 2, 16, "fp32", 32)
KEYS: Any = SimpleNamespace(layout=LAYOUT)
SETTINGS = ConnectorSettings(namespace="ns")


class SlowIndex:
    """Times out ``fails`` times (as ``IndexClient`` does: GetTimeoutError), then answers."""

    def __init__(self, fails: int, known: dict[str, dict[str, Any]]) -> None:
        self.fails, self.known, self.asked = fails, known, 0

    def namespaces(self) -> dict[str, dict[str, Any]]:
        self.asked += 1
        if self.asked <= self.fails:
            raise TimeoutError("index_timeout")
        return self.known


def test_a_slow_first_answer_is_asked_again_not_a_failed_start() -> None:
    index = SlowIndex(2, {"ns": {"layout_fingerprint": LAYOUT.fingerprint()}})
    check_namespace(index, SETTINGS, KEYS, startup_s=30)
    assert index.asked == 3


def test_an_index_that_never_answers_fails_the_start_naming_the_fix() -> None:
    index = SlowIndex(10**9, {})
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"does not answer .* within 1 s: is kvshare deployed"):
        check_namespace(index, SETTINGS, KEYS, startup_s=1)
    assert 1 <= time.monotonic() - t0 < 5 and index.asked >= 2


def test_an_unknown_namespace_or_another_layout_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match=r"unknown kvshare namespace 'ns' \(deployed: \['other'\]\)"):
        check_namespace(SlowIndex(0, {"other": {}}), SETTINGS, KEYS, startup_s=30)
    other = KVLayout(2, 2, 16, "fp32", 64).fingerprint()
    index = SlowIndex(0, {"ns": {"layout_fingerprint": other}})
    with pytest.raises(ValueError, match="was deployed with another KV layout"):
        check_namespace(index, SETTINGS, KEYS, startup_s=30)
    assert index.asked == 1


def _vllm_config(hybrid: bool = False) -> Any:
    mc = SimpleNamespace(model="/models/m", use_mla=False, is_hybrid=hybrid,
                         is_attention_free=False, get_sliding_window=lambda: None)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(block_size=16))


def test_the_engine_refuses_state_that_is_not_attention_kv() -> None:
    with pytest.raises(ValueError, match="(?s)state-space .*remove the KVShareConnector"):
        check_model(_vllm_config(hybrid=True), SETTINGS)


@pytest.mark.parametrize("extra, match", [
    ({"model_type": "jamba"}, "Mamba SSM state"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked local attention"),
])
def test_a_worker_refuses_them_before_vllm_starts(extra: dict[str, Any], match: str,
                                                  tmp_path: Any) -> None:
    """VllmKeys (the worker's and the gateway's keys) sizes the layout, so a kind kvshare has
    no block format for is refused, naming the model type, before a vLLM process starts."""
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 256, "torch_dtype": "bfloat16", **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"(?s){match}.*does not share yet"):
        VllmKeys.from_model(str(tmp_path), 256)
    refuse_kind(LAYOUT, "tiny")  # MHA/GQA passes

