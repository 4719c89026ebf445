"""The GPU check (kvshare/testing/gpu_check.py) on the CPU, so its code runs on every `make
test`; planted wrong bytes make it fail; on a machine with CUDA, the real run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshare.testing import gpu_check, gpu_copies

PagedRequestKV = gpu_copies.paged.PagedRequestKV


def check(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code = gpu_check.main(["--out", str(tmp_path), *args])
    text = (tmp_path / "gpu_check.json").read_text()
    assert text.count("\n") == 1  # one JSON object, one line
    return code, json.loads(text)


def test_cpu_twin_passes_every_section_or_says_why_not(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, result = check(tmp_path, "--device", "cpu", "--seconds", "3")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert code == 0 and result["ok"] and result["complete"] and result["mismatches"] == []
    sections = result["sections"]
    assert set(sections) == set(gpu_check.SECTIONS)
    for name, section in sections.items():
        assert section["status"] in ("ok", "skip"), (name, section)
        if section["status"] == "skip":
            assert section["reason"], name
    assert sections["cuda_ipc"]["status"] == "skip"  # the worker side moves blocks over shm
    assert sections["tier"]["stores"]["gpu"]["reason"] == "the gpu tier needs CUDA (device=cpu)"
    steps = [s for case in sections["worker_side"]["cases"] for s in case["steps"]]
    assert {s["step"] for s in steps if s["status"] == "ok"} == {
        "register", "load_slab", "load_staged", "store_slab", "store_staged"}
    for layout in sections["bandwidth"]["layouts"].values():  # host copies, ratios computed
        assert layout["baseline"].startswith("pageable copy_")
        assert all(v > 0 for v in layout["gbps"].values())
        assert "load_kvshare_vs_pageable" in layout["ratios"]


def corrupt_pages(kv: Any) -> None:
    """Flip one byte of the first layer's pages."""
    kv.pages.views[0].view(torch.uint8)[0, 0, 0, 0, 0].bitwise_xor_(0xFF)


@pytest.mark.parametrize("method", ["write_slots", "read_slots", "read_blocks"])
def test_one_wrong_byte_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        method: str) -> None:
    real = getattr(PagedRequestKV, method)

    def planted(self: Any, *args: Any) -> None:
        if method == "write_slots":
            real(self, *args)
            corrupt_pages(self)
        elif method == "read_slots":
            real(self, *args)
            blocks, rows, slots = args
            rows[slots[0], 7] ^= 0x01
        else:
            real(self, *args)
            args[1].reshape(-1).view(torch.uint8)[3] ^= 0x10

    monkeypatch.setattr(PagedRequestKV, method, planted)
    code, result = check(tmp_path, "--device", "cpu", "--only", "paged_copies")
    assert code == 1 and not result["ok"]
    assert result["mismatches"] == ["paged_copies"]
    step = {"write_slots": "load_slab", "read_slots": "store_slab",
            "read_blocks": "store_staged"}[method]
    failed = result["sections"]["paged_copies"]["failed"]
    assert "flash_nhd_bf16/" + step in failed and "cpu_bf16/" + step in failed


def test_a_timed_load_that_writes_nothing_fails_the_bandwidth_section(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PagedRequestKV, "write_slots", lambda self, *args: None)
    code, result = check(tmp_path, "--device", "cpu", "--only", "bandwidth", "--seconds", "2")
    assert code == 1 and result["mismatches"] == ["bandwidth"]
    for layout in result["sections"]["bandwidth"]["layouts"].values():
        assert "load_kvshare wrote other bytes than the reference" in layout["failed"]


def test_the_ipc_scan_sees_a_module_that_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "IPC_PATTERNS", re.compile(r"cudaHostRegister\("))
    section = gpu_check.ipc_section()
    assert section["status"] == "mismatch" and "kvshare/tiers/host.py" in section["reason"]


def test_no_gpu_is_exit_2_not_a_pass(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, result = check(tmp_path, "--device", "cuda")
    assert code == 2 and result["mismatches"] == ["device"]


@pytest.mark.gpu
def test_on_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU check runs with `make gpu-check` on a GPU")
    code, result = check(tmp_path, "--device", "cuda", "--seconds", "120")
    assert code == 0, result["mismatches"]
