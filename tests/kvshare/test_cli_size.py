"""`kvshare size`: the console script (subprocess) and ``kvshare.cli.main`` in process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

from kvshare.cli import main

CONFIGS = ROOT / "kvshare" / "configs"
SCRIPT = Path(sys.executable).parent / "kvshare"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    if not SCRIPT.exists():
        pytest.fail(f"console script {SCRIPT} is missing: pip install -e . into this venv")
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_console_script_json() -> None:
    proc = run_script("size", str(CONFIGS / "Llama-3.1-8B.json"), "--tokens", "131072", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bytes_per_token"] == 131072
    assert out["bytes_per_block"] == 131072 * 256
    assert out["total_bytes"] == 131072 * 131072  # 16 GiB


def test_console_script_missing_key_exits_2_naming_it(tmp_path: Path) -> None:
    cfg = json.loads((CONFIGS / "Mistral-7B-v0.3.json").read_text())
    del cfg["model_type"], cfg["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    proc = run_script("size", str(path), "--tokens", "10")
    assert proc.returncode == 2
    assert "num_hidden_layers" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, tokens, per_token", [
    ("Llama-2-70b-hf", 4096, 327680), ("Qwen2.5-7B", 32768, 57344),
    ("Mistral-7B-v0.3", 1000, 131072), ("llava-1.5-7b-hf", 576, 524288),
    ("tiny-llama", 16384, 8192),
])
def test_main_json(name: str, tokens: int, per_token: int,
                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", str(CONFIGS / f"{name}.json"), "--tokens", str(tokens), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == per_token
    assert out["bytes_per_block"] == per_token * 256
    assert out["total_bytes"] == per_token * tokens


def test_main_options_and_bundled_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "Llama-3.1-8B", "--tokens", "32", "--dtype", "fp8",
                 "--block-tokens", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"bytes_per_token": 65536, "bytes_per_block": 65536 * 16,
                   "total_bytes": 65536 * 32, "tokens": 32,
                   "layout": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                              "dtype": "fp8_e4m3", "block_tokens": 16, "kind": "mha"}}


def test_main_human_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", str(CONFIGS / "Llama-3.1-8B.json"), "--tokens", "131072"]) == 0
    text = capsys.readouterr().out
    assert "131,072 (128.00 KiB)" in text  # bytes per token
    assert "33,554,432 (32.00 MiB, 256 tokens)" in text  # bytes per block
    assert "17,179,869,184 (16.00 GiB)" in text  # total


def test_mla_size_of_the_issue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "DeepSeek-V3", "--tokens", "1"]) == 0
    text = capsys.readouterr().out
    assert "61 layers x one 576-wide latent (kv_lora_rank 512 + rope 64), bf16, MLA" in text
    assert "bytes/token     70,272 (68.62 KiB)" in text  # 61 x 576 x 2
    assert "1 tokens  70,272 (68.62 KiB)" in text
    assert main(["size", "DeepSeek-V3", "--tokens", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["bytes_per_token"], out["layout"]["kind"], out["layout"]["rope_dim"]) == (
        70272, "mla", 64)


def test_sliding_sizes_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "gpt-oss-20b", "--tokens", "131072"]) == 0
    text = capsys.readouterr().out
    assert "group 0         12 layers, 24,576 bytes/token (24.00 KiB), full attention" in text
    assert ("group 1         12 layers, 24,576 bytes/token (24.00 KiB), window 128: a hit needs "
            "only its last 1 block (256 tokens)") in text
    assert "131,072 tokens  6,442,450,944 (6.00 GiB)" in text  # 49,152 per token, all layers
    # 512 blocks of the full group + 1 of the sliding group: 513 x 6 MiB
    assert "hit on 131,072 tokens  3,227,516,928 (3.01 GiB, 50.1% of all layers')" in text
    assert main(["size", "gemma-2-9b-it", "--tokens", "100000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 2 * 42 * 8 * 256 * 2
    assert [(g["window"], g["bytes_per_token"], g["hit_blocks"]) for g in out["groups"]] == [
        (None, 172032, 390), (4096, 172032, 16)]
    assert out["hit_tokens"] == 390 * 256
    assert out["hit_bytes"] == (390 + 16) * 172032 * 256


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16,
      "hidden_size": 2048, "kv_lora_rank": 512, "torch_dtype": "bfloat16"}, "qk_rope_head_dim"),
    ({"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4,
      "hidden_size": 256, "torch_dtype": "bfloat16"}, "(model_type 'qwen3_next') keeps gated DeltaNet"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}, "torch_dtype"),
])
def test_main_bad_configs_exit_2(cfg: dict[str, object], message: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["size", str(path), "--tokens", "10"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_main_missing_file_and_bad_json(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", str(tmp_path / "nope.json"), "--tokens", "10"]) == 2
    assert "no config file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["size", str(bad), "--tokens", "10"]) == 2
    assert "error" in capsys.readouterr().err


def test_main_rejects_non_positive_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["size", "Llama-3.1-8B", "--tokens", "0"])
    assert exc.value.code == 2
    assert "positive" in capsys.readouterr().err
