"""Everything kvshare has for a GPU that runs without Ray or vLLM, as one check and one JSON.

Run on a GPU machine (``make gpu-check``: builds the native modules for that Python first)::

    PYTHONPATH=. python3 -m kvshare.testing.gpu_check --device cuda --out "$OUT"

and here, on the CPU, the same code (``make gpu-check-cpu``; ``tests/kvshare/testing/test_gpu_check.py``
runs it inside ``make test``, so it cannot rot between devices)::

    PYTHONPATH=. .venv/bin/python -m kvshare.testing.gpu_check --device cpu

Sections, each ``ok``, ``mismatch`` (wrong bytes, or an error) or ``skip`` with a reason:

- ``tier``: the TierStore contract (:mod:`kvshare.testing.tier_conformance`) on the gpu tier
  and the host slab, and the slab's CUDA registration (``cudaHostRegister``), twice at one
  address (a closed slab must unregister);
- ``paged_copies``, ``worker_side``, ``bandwidth``: :mod:`kvshare.testing.gpu_copies`;
- ``cuda_ipc``: skipped while the worker side shares no device memory between processes
  (the check reads the source, and fails the day it does without a section here);
- ``nixl``: a NIXL READ from a registered host slab into device memory (host memory on the
  CPU), when ``nixl`` imports; the nixl_cu13 1.5.1 cp312 wheel is 56.0 MiB, so it fits the
  64 MiB a device run may carry: ``make gpu-wheels`` puts it in ``.gpu-wheels/`` and
  ``scripts/gpu_check.sh`` installs what it finds there into a temporary folder.

It writes one JSON object to ``OUT/gpu_check.json``, prints it as its last line, and exits 1
on any mismatch (2 when ``--device cuda`` finds no GPU). Bandwidth below its target (kvshare's
load and store at >= 0.8x a pinned ``copy_`` of the same bytes) is reported, not failed.

The device run prepared for a session lent a GPU: ``make gpu-wheels`` here first (for the
NIXL section; without it that section skips and says why), then one ``run`` call (build
~30 s, check <= 240 s; the figures that decide the GPU-side copy are
``sections.bandwidth.layouts.flash_nhd.ratios``: ``load_*``/``store_*`` against pinned
``copy_``)::

    run(command="GPU_CHECK_SECONDS=240 bash scripts/gpu_check.sh", timeout_s=420,
        carry=[".gpu-wheels"])
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvshare.testing import gpu_copies
from kvshare.testing.tier_conformance import CHECKS
from kvshare.tiers.base import STREAMING_COPY, TierStore
from kvshare.tiers.host import HostSlab

Record = dict[str, Any]

TIER_SLOT = 64 * 1024 + 8  # as tests/kvshare/tiers/test_tiers.py: deliberately not a power of two
IPC_PATTERNS = re.compile(r"_share_cuda_|cudaIpc|ipc_handle|rebuild_cuda_tensor|"
                          r"torch\.multiprocessing|reductions\.reduce_tensor")
CARRY_LIMIT = 64 * 2**20
SECTIONS = ("tier", "paged_copies", "worker_side", "cuda_ipc", "bandwidth", "nixl")
NIXL_RESERVE_S = 20.0  # of the budget, left to the nixl section after the bandwidth one


def failed(exc: BaseException) -> Record:
    return {"status": "mismatch", "reason": f"{type(exc).__name__}: {exc}"[:300]}


# ------------------------------------------------------------------------------- tier
def tier_section(device: torch.device) -> Record:
    stores: dict[str, Record] = {}
    makers: dict[str, Any] = {"host": lambda: HostSlab(TIER_SLOT, 4)}
    if device.type == "cuda":
        from kvshare.tiers.gpu import GpuStore

        makers["gpu"] = lambda: GpuStore(TIER_SLOT, 4, device=str(device))
    for name, make in makers.items():
        checks: Record = {}
        for check in CHECKS:
            try:
                store: TierStore = make()
            except Exception as exc:
                checks[check.__name__] = failed(exc)
                continue
            try:
                check(store)
                checks[check.__name__] = {"status": "ok"}
            except Exception as exc:  # AssertionError: the contract broke
                checks[check.__name__] = failed(exc)
            finally:
                store.close()
        stores[name] = checks
    if device.type != "cuda":
        stores["gpu"] = {"status": "skip", "reason": "the gpu tier needs CUDA (device=cpu)"}
    bad = [f"{s}/{c}" for s, checks in stores.items() for c, r in checks.items()
           if isinstance(r, dict) and r.get("status") == "mismatch"]
    rec: Record = {"stores": stores}
    if device.type == "cuda":
        rec["slab_registration"] = registration()
        if rec["slab_registration"]["status"] != "ok":
            bad.append("slab_registration")
    else:
        rec["slab_registration"] = {"status": "skip", "reason": "no CUDA to register with"}
    return {"status": "mismatch" if bad else "ok", "failed": bad, **rec}


def registration() -> Record:
    """Two slabs of one size made one after the other (the second usually maps where the
    first was): each must be pinned, so closing one must unregister it."""
    pinned = []
    for _ in range(2):
        slab = HostSlab(8 * 2**20, 2, pin_cuda=True)
        pinned.append(gpu_copies.registered(slab.array))
        slab.close()
    return {"status": "ok" if all(pinned) else "mismatch", "pinned": pinned}


# ------------------------------------------------------------------------------- cuda ipc
def ipc_section() -> Record:
    """Skip (naming what was read) while no library module shares CUDA memory between
    processes; a mismatch once one does, until this check gets an IPC section."""
    package = Path(__file__).resolve().parent.parent
    users = [str(f.relative_to(package.parent)) for f in sorted(package.rglob("*.py"))
             if "testing" not in f.relative_to(package).parts
             and IPC_PATTERNS.search(f.read_text())]
    if users:
        return {"status": "mismatch", "reason": f"{users} share CUDA memory between processes: "
                "add a CUDA IPC section to kvshare.testing.gpu_check"}
    return {"status": "skip", "reason": "the worker side uses no CUDA IPC: it moves blocks "
            "through the node's shared-memory host slab (no kvshare module outside "
            f"kvshare/testing matches {IPC_PATTERNS.pattern})"}


# ------------------------------------------------------------------------------- nixl
def wheels(folder: str) -> list[Record]:
    """NIXL wheels in ``folder`` with their sizes, and whether together they fit a carry."""
    found = sorted(Path(folder).glob("nixl*.whl")) if folder else []
    return [{"wheel": p.name, "mib": round(p.stat().st_size / 2**20, 1)} for p in found]


def nixl_section(device: torch.device, wheel_dir: str, seed: int) -> Record:
    from kvshare.transfer.base import TransportUnavailable
    from kvshare.transfer.nixl_agent import NixlSource, make_agent, xfer_descs

    found = wheels(wheel_dir)
    total = sum(w["mib"] for w in found) * 2**20
    fit = {"wheels": found, "fit_64MiB_carry": bool(found) and total < CARRY_LIMIT}
    try:
        reader = make_agent(f"gpu-check-reader-{os.getpid()}")
    except TransportUnavailable as exc:
        return {"status": "skip", "reason": f"nixl unavailable: {exc}", **fit}
    n, size = 8, 1 << 20
    slab = HostSlab(size, n, pin_cuda=device.type == "cuda")
    source = None
    try:
        slab.array[:] = np.random.default_rng(seed).integers(0, 256, slab.array.shape,
                                                             dtype=np.uint8)
        source = NixlSource(f"gpu-check-source-{os.getpid()}", slab)
        dest = torch.zeros(n * size, dtype=torch.uint8, device=device)
        mem = "VRAM" if device.type == "cuda" else "DRAM"
        dev_id = 0 if device.type != "cuda" else (
            torch.cuda.current_device() if device.index is None else device.index)
        reg = reader.register_memory([(dest.data_ptr(), dest.numel(), dev_id, "")], mem)
        raw = reader.add_remote_agent(source.info(0).metadata)
        remote = raw.decode() if isinstance(raw, bytes) else str(raw)
        order = [int(s) for s in np.random.default_rng(seed).permutation(n)]
        local = xfer_descs([dest.data_ptr() + i * size for i in range(n)], size)
        local[:, 2] = dev_id
        far = xfer_descs([source.base_addr + s * size for s in order], size)
        seconds = []
        for _ in range(2):  # the first READ also connects; the second is the figure
            dest.zero_()
            handle = reader.initialize_xfer("READ", reader.get_xfer_descs(local, mem),
                                            reader.get_xfer_descs(far, "DRAM"), remote)
            t0 = time.perf_counter()
            state = reader.transfer(handle)
            deadline = t0 + 30
            while state == "PROC" and time.perf_counter() < deadline:
                state = reader.check_xfer_state(handle)
            seconds.append(time.perf_counter() - t0)
            reader.release_xfer_handle(handle)
            if state != "DONE":
                return {"status": "mismatch", "reason": f"READ ended {state}", **fit}
        got = dest.cpu().numpy().reshape(n, size)
        diff = int((got != slab.array[order]).sum())
        reader.deregister_memory(reg)
        return {"status": "ok" if diff == 0 else "mismatch", "diff_bytes": diff,
                "memory": f"DRAM -> {mem}", "bytes": n * size,
                "gbps": round(n * size / seconds[-1] / 1e9, 3), **fit}
    except Exception as exc:
        return {**failed(exc), **fit}
    finally:
        if source is not None:
            source.close()
        slab.close()


# ------------------------------------------------------------------------------- main
def environment(device: torch.device) -> Record:
    env: Record = {"python": platform.python_version(), "torch": torch.__version__,
                   "numpy": np.__version__, "device": str(device),
                   "torch_threads": torch.get_num_threads(),
                   "native_copy": {"_copy_streaming": STREAMING_COPY,
                                   "copy_chunks": gpu_copies.COPY_CHUNKS_BUILT}}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory
                                      / 2**30, 1)
        env["cuda"] = torch.version.cuda
    return env


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvshare.testing.gpu_check",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "",
                   help="folder for gpu_check.json (default: $OUT, else a new temporary one)")
    p.add_argument("--seconds", type=float, default=300.0,
                   help="time budget; the bandwidth section gets what the others leave")
    p.add_argument("--wheels", default=".gpu-wheels", help="folder of NIXL wheels to report")
    p.add_argument("--only", default="", help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(device: torch.device, seconds: float, wheel_dir: str, seed: int,
        only: Sequence[str] = SECTIONS, save: Callable[[Record], object] | None = None) -> Record:
    """The sections named in ``only``, in the order of :data:`SECTIONS`; each one that raises
    is a mismatch carrying it. ``save`` gets the result so far after each section (so a run
    that dies in native code, NIXL's say, still leaves what it measured)."""
    t0 = time.perf_counter()
    out: Record = {"check": "kvshare gpu_check", "environment": environment(device),
                   "complete": False, "sections": {}}
    sections: Record = out["sections"]
    steps: dict[str, Callable[[], Record]] = {
        "tier": lambda: tier_section(device),
        "paged_copies": lambda: gpu_copies.copies_section(gpu_copies.PAGED_CASES, device, seed),
        "worker_side": lambda: gpu_copies.copies_section(gpu_copies.WORKER_CASES, device,
                                                         seed + 1),
        "cuda_ipc": ipc_section,
        "bandwidth": lambda: gpu_copies.bandwidth_section(
            device, max(seconds - (time.perf_counter() - t0) - NIXL_RESERVE_S, 1.0), seed),
        "nixl": lambda: nixl_section(device, wheel_dir, seed),
    }
    for name in SECTIONS:
        if name not in only:
            continue
        s0 = time.perf_counter()
        try:
            sections[name] = steps[name]()
        except Exception as exc:
            sections[name] = failed(exc)
        sections[name]["seconds"] = round(time.perf_counter() - s0, 2)
        summarise(out, t0)
        if save is not None:
            save(out)
    out["complete"] = True
    return out


def summarise(out: Record, t0: float) -> None:
    out["mismatches"] = [n for n, s in out["sections"].items() if s["status"] == "mismatch"]
    out["ok"] = not out["mismatches"]
    out["seconds"] = round(time.perf_counter() - t0, 2)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    only = tuple(n for n in args.only.split(",") if n) or SECTIONS
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--only {unknown}: the sections are {','.join(SECTIONS)}")
    out_dir = args.out or tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(out_dir, exist_ok=True)

    def save(result: Record) -> str:
        line = json.dumps(result, sort_keys=True)
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            f.write(line + "\n")
        return line

    if args.device == "cuda" and not torch.cuda.is_available():
        result: Record = {"check": "kvshare gpu_check", "ok": False, "complete": True,
                          "sections": {}, "mismatches": ["device"],
                          "reason": "--device cuda: no CUDA device"}
        code = 2
    else:
        threads = torch.get_num_threads()
        if args.device == "cpu":  # host copies on a shared machine: one thread keeps them steady
            torch.set_num_threads(1)
        try:
            result = run(torch.device(args.device), args.seconds, args.wheels, args.seed, only,
                         save)
        finally:
            torch.set_num_threads(threads)
        code = 0 if result["ok"] else 1
    line = save(result)
    print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
