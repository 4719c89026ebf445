"""The SGLang launcher without SGLang: its command line, its checks, ``kvshare sglang``'s
options and the ``/metrics`` reader (the servers themselves: ``test_sglang_server.py``)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from kvshare.sglang.launch import SglangSpec
from kvshare.sglang.load import parse_sglang_metrics


def test_the_command_line_loads_kvshare_as_hicaches_storage_tier(tmp_path: Path) -> None:
    spec = SglangSpec(str(tmp_path), host="10.0.0.7", port=30001, events_dir=str(tmp_path),
                      page_size=32, storage_settings={"namespace": "llama"},
                      extra_args=("--tp", "2")).on_this_node()
    argv = spec.argv()
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--page-size"] == "32" and flag["--host"] == "10.0.0.7"
    assert flag["--hicache-storage-backend"] == "dynamic"
    assert flag["--hicache-mem-layout"] == "layer_first"
    extra = json.loads(flag["--hicache-storage-backend-extra-config"])
    assert extra["module_path"] == "kvshare.sglang.backend" and extra["namespace"] == "llama"
    assert extra["interface_v1"] == 1
    assert json.loads(flag["--kv-events-config"])["endpoint"] == spec.events_endpoint
    assert "--enable-hierarchical-cache" in argv and "--device" not in argv
    assert argv[-2:] == ["--tp", "2"] and spec.endpoint == "http://10.0.0.7:30001"


def test_cpu_and_the_file_peer_and_no_hicache(tmp_path: Path) -> None:
    cpu = SglangSpec(str(tmp_path), host="h", port=1, storage="file", cpu=True).argv()
    assert cpu[cpu.index("--hicache-storage-backend") + 1] == "file"
    assert cpu[cpu.index("--device") + 1] == "cpu" and "--hicache-io-backend" in cpu
    assert "--sleep-on-idle" in cpu  # an idle CPU server must not spin a core
    assert SglangSpec(str(tmp_path), storage="file", cpu=True).environ()[
        "SGLANG_USE_CPU_ENGINE"] == "1"
    plain = SglangSpec(str(tmp_path), host="h", port=1, storage="").argv()
    assert not [a for a in plain if a.startswith("--hicache")]


@pytest.mark.parametrize("kwargs, match", [
    ({"storage": "mooncake"}, "storage must be one of"),
    ({"storage": "kvshare"}, r"needs storage_settings\['namespace'\]"),
    ({"storage": "", "page_size": 0}, "must be positive"),
])
def test_bad_specs_name_the_fix(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SglangSpec(str(tmp_path), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a local model directory"):
        SglangSpec(str(tmp_path / "missing"), storage="")


def test_kvshare_sglang_start_options() -> None:
    from kvshare.actors.sglang_workers import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["sglang", "start", "--model", "/m", "--namespace", "llama",
                              "--page-size", "32", "--cpu", "--storage-settings",
                              '{"remote": "objstore"}', "--", "--tp", "2"])
    assert (args.page_size, args.cpu, args.storage_settings) == (32, True, {"remote": "objstore"})
    assert args.sglang_args == ["--", "--tp", "2"]
    with pytest.raises(SystemExit):
        parser.parse_args(["sglang", "start", "--model", "/m", "--namespace", "x",
                           "--storage-settings", "[1]"])


def test_metrics_give_the_load_and_the_cache_hits_per_source() -> None:
    text = "\n".join([
        '# HELP sglang:num_running_reqs x',
        'sglang:num_running_reqs{model_name="m",engine_type="unified"} 2.0',
        'sglang:num_queue_reqs{model_name="m"} 3.0',
        'sglang:token_usage{model_name="m"} 0.25',
        'sglang:cached_tokens_total{model_name="m",cache_source="device"} 64.0',
        'sglang:cached_tokens_total{model_name="m",cache_source="storage"} 512.0',
        'sglang:cached_tokens_created{model_name="m",cache_source="storage"} 1.7e9',
    ])
    m = parse_sglang_metrics(text)
    assert m["sglang:num_running_reqs"] == 2 and m["sglang:num_queue_reqs"] == 3
    assert m["cached:storage"] == 512 and m["cached:device"] == 64


def test_the_load_is_read_at_most_every_min_interval() -> None:
    """The lease renews at 10 Hz; SGLang's /metrics is read at most every ``min_interval_s``
    (a sooner call answers the last load, ``ts`` as read), again after it; a silent server is
    None at once."""
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from http_helpers import Served

    from kvshare.sglang.load import SglangLoad

    app, hits = FastAPI(), {"n": 0}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        hits["n"] += 1
        return PlainTextResponse(f'sglang:num_running_reqs{{model_name="m"}} {hits["n"]}.0\n')

    served = Served(app)
    try:
        load = SglangLoad("w", served.url, min_interval_s=0.3)
        first = [load.load() for _ in range(5)]
        assert hits["n"] == 1 and all(x is first[0] for x in first) and first[0] is not None
        assert first[0].running == 1
        time.sleep(0.35)
        again = load.load()
        assert hits["n"] == 2 and again is not None and again.running == 2 and again.ts > first[0].ts
    finally:
        served.stop()
    assert load.load() is again  # within the interval: the last load, the server not asked
    time.sleep(0.35)
    assert load.load() is None  # the server is gone
    with pytest.raises(ValueError, match="min_interval_s"):
        SglangLoad("w", "http://127.0.0.1:1", min_interval_s=-1)


def test_the_server_does_not_inherit_rays_one_thread(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray puts OMP_NUM_THREADS=1 in its (zero-CPU) workers; an SGLang server started from one
    must not compute on one core. ``cpus`` or ``env`` still set it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "OMP_NUM_THREADS" not in SglangSpec(str(tmp_path), storage="", cpu=True).environ()
    assert SglangSpec(str(tmp_path), storage="", cpus=(0, 1)).environ()["OMP_NUM_THREADS"] == "2"
    assert SglangSpec(str(tmp_path), storage="", env={"OMP_NUM_THREADS": "3"}).environ()[
        "OMP_NUM_THREADS"] == "3"
