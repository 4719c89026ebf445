"""An operator's connector settings for kvshare-launched vLLM workers reach vLLM's
``--kv-transfer-config``, and a bad one is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import tiny_model

from kvshare.vllm.server.launch import VllmSpec
from kvshare.vllm.server.worker import VllmWorker, VllmWorkerConfig


def config(model: str, **kw: Any) -> VllmWorkerConfig:
    spec = VllmSpec(model=model, port=18123, events_dir="/tmp", block_size=32)
    return VllmWorkerConfig("w", "node-a", "ns", spec, 128, connector=True, **kw)


class _NoIndex:
    def register_worker(self, info: Any) -> int:
        raise AssertionError("not started")

    report_load = unregister_worker = register_worker


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("cfg")))


def test_connector_settings_reach_the_kv_transfer_config(model: str) -> None:
    worker = VllmWorker(config(model, connector_settings={"sync_save_mib": 0,
                                                          "lookup_threads": 2}), _NoIndex())
    argv = worker.spec.argv()
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"sync_save_mib": 0, "lookup_threads": 2, "namespace": "ns",
                     "block_tokens": 128, "ray_namespace": "kvshare", "node": "node-a"}


@pytest.mark.parametrize(("settings", "match"), [
    ({"namespace": "other"}, r"\['namespace'\] are set from the worker's own config"),
    ({"sync_save_mb": 0}, r"unknown kv_connector_extra_config keys \['sync_save_mb'\]"),
    ({"sync_save_mib": -1}, "sync_save_mib"),
])
def test_a_bad_connector_setting_is_refused_naming_it(model: str, settings: dict[str, Any],
                                                        match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config(model, connector_settings=settings)


def test_the_models_own_dtype_by_default_and_dtype_reaches_vllm_and_the_layout(model: str) -> None:
    own = VllmWorker(config(model), _NoIndex())  # the tiny model is bfloat16
    assert "--dtype" not in own.spec.argv() and own.keys.layout.dtype == "bf16"
    f32 = VllmWorker(config(model, dtype="float32"), _NoIndex())
    argv = f32.spec.argv()
    assert argv[argv.index("--dtype") + 1] == "float32" and f32.keys.layout.dtype == "fp32"
    # the registration (what a gateway and the connector's namespace check compare) follows
    assert f32.keys.layout.bytes_per_token == 2 * own.keys.layout.bytes_per_token
    assert f32.info.layout_fingerprint != own.info.layout_fingerprint
    assert f32.keys.identity != own.keys.identity  # float32 KV is other bytes: other hashes


def test_connector_settings_without_the_connector_are_refused(tmp_path: Path) -> None:
    spec = VllmSpec(model=str(tmp_path), port=18124, events_dir="/tmp", block_size=32)
    with pytest.raises(ValueError, match="without the connector"):
        VllmWorkerConfig("w", "n", "ns", spec, 128, connector=False,
                         connector_settings={"sync_save_mib": 0})


def test_the_cli_refuses_connector_settings_that_are_not_a_json_object(
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvshare.actors.vllm_workers import register

    parser = argparse.ArgumentParser(prog="kvshare")
    register(parser.add_subparsers())
    base = ["vllm", "start", "--model", "m", "--namespace", "ns", "--connector"]
    ok = parser.parse_args([*base, "--connector-settings", '{"sync_save_mib": 0}'])
    assert ok.connector_settings == {"sync_save_mib": 0}
    for bad, says in (("[1]", "a JSON object"), ("{sync", "not JSON")):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--connector-settings", bad])
        assert says in capsys.readouterr().err
