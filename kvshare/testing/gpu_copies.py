"""The GPU check's copy sections: vLLM's pages <-> canonical blocks, through kvshare's own code.

- ``paged_copies``: :class:`~kvshare.vllm.connector.paged.PagedRequestKV` in the flash-attention and
  the CPU layouts, each dtype, against :mod:`kvshare.testing.paged_reference` byte for byte,
  both directions: straight from and into the host slab (``write_slots``/``read_slots``, the
  shm path) and staged (``write_blocks``/``read_blocks`` through :mod:`kvshare.kv_convert`,
  the path of NIXL, object-store and remote loads).
- ``worker_side``: the connector's worker side on tensors allocated as vLLM allocates them
  (one raw int8 buffer per layer viewed as dtype and shape; the HND stride order; a TP rank's
  head slice). :class:`~kvshare.vllm.connector.worker_side.WorkerSide` itself imports vLLM (its
  metadata classes), so its steps are driven here: ``register`` (``PageViews.from_vllm`` with
  the rank's heads), ``start_loads`` (``PagedRequestKV(page_ids, first_block, keep_tokens)``
  and the SDK's copies into it), ``submit_saves`` (``PagedRequestKV(page_ids)`` and the
  SDK's copies out of it; TP>1 ranks do not store).
- ``bandwidth``: slab -> device pages (load) and device pages -> slab (store) through
  kvshare's path, beside ``copy_`` of the same bytes from pinned, registered-slab and
  pageable memory in the same run, and a candidate (DMA of whole slab rows to a device
  staging buffer, then the scatter on the device) to choose the GPU-side copy from.

A step that raises NotImplementedError (or torch's "not implemented for <dtype>") is reported
``unsupported``: it never writes wrong bytes (the load fails and vLLM recomputes), but it is
no reuse either. Wrong bytes are ``mismatch``; any other exception is ``error``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvshare.kv_convert import blocks_from_source, blocks_into_target, blocks_view
from kvshare.layout import KVLayout
from kvshare.testing import paged_reference as ref
from kvshare.tiers.host import HostSlab

# The one import of a module that plan/LAYOUT.md moves (-> kvshare.vllm.connector.paged).
from kvshare.vllm.connector import paged

COPY_CHUNKS_BUILT: bool = paged._COPY_CHUNKS
"""Whether the CPU layout's C copy (``kvshare._native._copy.copy_chunks``) was built."""

Record = dict[str, Any]

LAYERS, HEADS, HEAD_DIM, BLOCK, PAGE = 3, 4, 32, 64, 16  # 4 pages per block
REQUEST_BLOCKS = 5  # a request's pages cover 5 blocks, of NUM_PAGES pages in the cache
NUM_PAGES = 24
SLOTS = 8


@dataclass(frozen=True)
class Case:
    """One geometry to copy through: paged ``kind``, layout ``dtype``, vLLM's raw-buffer
    allocation or a plain tensor, and the rank ``rank`` of ``tp``."""

    kind: str
    dtype: str
    raw: bool = False
    tp: int = 1
    rank: int = 0

    @property
    def name(self) -> str:
        extra = ("_raw" if self.raw else "") + (f"_tp{self.tp}r{self.rank}" if self.tp > 1 else "")
        return f"{self.kind}_{self.dtype}{extra}"


PAGED_CASES = tuple(Case(kind, dtype) for kind in ("flash_nhd", "cpu")
                    for dtype in ("bf16", "fp16", "fp32", "fp8_e4m3"))
WORKER_CASES = (Case("flash_nhd", "bf16", raw=True), Case("flash_hnd", "bf16", raw=True),
                Case("flash_nhd", "bf16", raw=True, tp=2, rank=1),
                Case("flash_nhd", "fp16", raw=True), Case("flash_nhd", "fp8_e4m3", raw=True),
                Case("cpu", "bf16", raw=True))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def registered(array: np.ndarray) -> bool:
    """Whether CUDA counts ``array``'s memory as page-locked (cudaHostRegister took effect):
    torch's ``is_pinned``, else CuPy's cudaPointerGetAttributes where CuPy is installed."""
    if not torch.cuda.is_available():
        return False
    if torch.from_numpy(array).is_pinned():
        return True
    try:
        import cupy

        attrs = cupy.cuda.runtime.pointerGetAttributes(int(array.ctypes.data))
        return int(attrs.type) == 1  # cudaMemoryTypeHost
    except Exception:
        return False


def unsupported(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) or "not implemented for" in str(exc)


def step(name: str, run: Callable[[], int]) -> Record:
    """Run one copy-and-compare; ``run`` returns how many bytes differ from the reference."""
    t0 = time.perf_counter()
    try:
        diff = run()
    except Exception as exc:
        status = "unsupported" if unsupported(exc) else "error"
        return {"step": name, "status": status, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    return {"step": name, "status": "ok" if diff == 0 else "mismatch", "diff_bytes": diff,
            "seconds": round(time.perf_counter() - t0, 4)}


def diff_pages(caches: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> int:
    got = ref.host_bytes(caches)
    return sum(int((got[n] != expected[n]).sum()) for n in expected)


def run_case(case: Case, device: torch.device, seed: int) -> Record:
    """Load (slab, staged) and store (slab, staged) one request's blocks; each step against
    the reference."""
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, case.dtype, BLOCK)
    local = HEADS // case.tp
    pages = ref.Pages(case.kind, layout, NUM_PAGES, PAGE, local, case.rank * local)
    caches = ref.allocate(pages, device, seed, raw=case.raw)
    expected = ref.host_bytes(caches)
    rng = np.random.default_rng(seed)
    page_ids = [int(p) for p in rng.permutation(NUM_PAGES)[:REQUEST_BLOCKS * pages.per_block]]
    slab = HostSlab(layout.bytes_per_block, SLOTS, pin_cuda=device.type == "cuda")
    out = HostSlab(layout.bytes_per_block, SLOTS, pin_cuda=device.type == "cuda")
    rec: Record = {"case": case.name, "bytes_per_block": layout.bytes_per_block,
                   "slab_registered": registered(slab.array), "steps": []}
    try:
        slab.array[:] = ref.random_bytes(slab.array.shape, seed + 100).numpy()
        # WorkerSide.register: this rank's heads of every layer
        views = paged.PageViews.from_vllm(caches, local_heads=local, head_dim=HEAD_DIM,
                                          page_tokens=PAGE, head_start=case.rank * local)
        want = paged.CPU_ATTN if case.kind == "cpu" else paged.FLASH_NHD
        rec["steps"].append({"step": "register", "status": "ok" if views.kind == want else
                             "mismatch", "kind": views.kind})
        # start_loads: the plan starts at request block 1; vLLM's own cache holds 5 pages
        first, keep = 1, PAGE * (pages.per_block + 1)
        target = paged.PagedRequestKV(views, layout, page_ids, first, keep)
        target.check(layout, 3 * BLOCK)
        blocks, slots = [2, 0, 1], [4, 1, 6]

        def load_slab() -> int:  # the shm path: slab rows straight into the pages (SlabIO)
            target.write_slots(blocks, slab.array, slots)
            ref.load(expected, pages, torch.from_numpy(slab.array[slots]), page_ids, blocks,
                     first, keep)
            return diff_pages(caches, expected)

        rows = ref.random_bytes((2, layout.bytes_per_block), seed + 200).numpy()

        def load_staged() -> int:  # fetched rows (nixl, objstore) into request blocks 2, 3
            blocks_into_target(rows, paged.PagedRequestKV(views, layout, page_ids, 2), 0, layout)
            ref.load(expected, pages, torch.from_numpy(rows), page_ids, [0, 1], 2)
            return diff_pages(caches, expected)

        rec["steps"] += [step("load_slab", load_slab), step("load_staged", load_staged)]
        if case.tp > 1:
            rec["steps"].append({"step": "store", "status": "skip",
                                 "reason": "WorkerSide does not store with TP>1"})
            return rec
        source = paged.PagedRequestKV(views, layout, page_ids)  # submit_saves
        source.check(layout, 0)

        def store_slab() -> int:  # the shm path: pages straight into slab rows
            out.array[:] = 0
            source.read_slots([3, 1], out.array, [5, 2])
            want_rows = ref.store(expected, pages, page_ids, [3, 1]).numpy()
            others = [s for s in range(SLOTS) if s not in (5, 2)]
            return (int((out.array[[5, 2]] != want_rows).sum())
                    + int(out.array[others].astype(bool).sum()))

        def store_staged() -> int:
            got = np.zeros((2, layout.bytes_per_block), dtype=np.uint8)
            blocks_from_source(source, 2, got, layout)
            return int((got != ref.store(expected, pages, page_ids, [2, 3]).numpy()).sum())

        rec["steps"] += [step("store_slab", store_slab), step("store_staged", store_staged)]
        return rec
    finally:
        slab.close()
        out.close()


def copies_section(cases: tuple[Case, ...], device: torch.device, seed: int) -> Record:
    """Every case; the section fails on any mismatch or error."""
    records = []
    for i, case in enumerate(cases):
        try:
            records.append(run_case(case, device, seed + 1000 * i))
        except Exception as exc:
            records.append({"case": case.name, "steps": [{"step": "setup", "status": "error",
                            "reason": f"{type(exc).__name__}: {exc}"[:300]}]})
    statuses = [s["status"] for r in records for s in r["steps"]]
    bad = [f"{r['case']}/{s['step']}" for r in records for s in r["steps"]
           if s["status"] in ("mismatch", "error")]
    gaps = [f"{r['case']}/{s['step']}" for r in records for s in r["steps"]
            if s["status"] == "unsupported"]
    status = "mismatch" if bad else "ok"
    if device.type == "cuda" and not all(r.get("slab_registered", True) for r in records):
        status, bad = "mismatch", bad + ["host slab not registered with CUDA (cudaHostRegister)"]
    return {"status": status, "failed": bad, "unsupported": gaps,
            "steps_ok": statuses.count("ok"), "cases": records}


# ---------------------------------------------------------------------------- bandwidth
def bench_layout(device: torch.device) -> tuple[KVLayout, int, int]:
    """(layout, page_tokens, blocks per copy): a Llama-3-8B-like bf16 layout on a GPU (32 MiB
    blocks, 16 of them), a small one on the CPU (512 KiB blocks, 8: the CPU run proves the
    code and its ratios, not the machine)."""
    if device.type == "cuda":
        return KVLayout(32, 8, 128, "bf16", 256), 16, 16
    return KVLayout(4, 8, 64, "bf16", 64), 16, 8


def timed(fn: Callable[[], object], device: torch.device, deadline: float, reps: int = 5
          ) -> float:
    """Best seconds of up to ``reps`` runs after one warm-up (fewer past ``deadline``)."""
    best = float("inf")
    for i in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
        if i and time.perf_counter() > deadline:
            break
    return best


def bandwidth_section(device: torch.device, seconds: float, seed: int) -> Record:
    layout, page_tokens, n = bench_layout(device)
    kinds = ("flash_nhd",) if device.type == "cuda" else ("flash_nhd", "cpu")
    per_kind = seconds / len(kinds)
    out: Record = {"status": "ok", "failed": [], "blocks": n,
                   "bytes_per_copy": n * layout.bytes_per_block, "layouts": {}}
    for kind in kinds:
        gbps: dict[str, float] = {}  # filled as it goes: figures measured before an error stay
        try:
            res = bench_kind(kind, layout, page_tokens, n, device, time.perf_counter() + per_kind,
                             seed, gbps)
        except Exception as exc:
            res = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300],
                   "gbps": gbps}
        out["layouts"][kind] = res
        if res["status"] != "ok":
            out["status"] = "mismatch"
            out["failed"].append(f"{kind}: {res.get('reason', res['status'])}")
    return out


def direction(name: str) -> str:
    """``h2d`` for a load or a host-to-device copy, else ``d2h``."""
    return "h2d" if name.startswith(("load_", "h2d_")) else "d2h"


def mapped(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over the registered host memory of ``array`` (zero-copy: kernels
    read and write it across the bus; UVA). ValueError when it is not registered."""
    if not registered(array):
        raise ValueError("the slab is not registered with CUDA")
    flat = array.reshape(-1)

    class Interface:
        __cuda_array_interface__ = {"shape": (flat.size,), "typestr": "|u1", "version": 3,
                                    "data": (int(flat.ctypes.data), False), "strides": None,
                                    "stream": None}

    t = torch.as_tensor(Interface(), device=device)
    assert t.data_ptr() == int(flat.ctypes.data)
    return t


def slot_order(page_ids: list[int], slots: list[int], per_block: int) -> list[int]:
    """The request's pages reordered so that block ``j`` is the one held in slot ``j``
    (block ``i`` lives in slot ``slots[i]``)."""
    out = [0] * len(page_ids)
    for i, s in enumerate(slots):
        out[s * per_block:(s + 1) * per_block] = page_ids[i * per_block:(i + 1) * per_block]
    return out


def bench_kind(kind: str, layout: KVLayout, page_tokens: int, n: int, device: torch.device,
               deadline: float, seed: int, gbps: dict[str, float]) -> Record:
    """GB/s of each copy of ``n`` blocks (into ``gbps``, as they are measured); the loads
    and stores are checked to round-trip."""
    cuda = device.type == "cuda"
    nbytes = n * layout.bytes_per_block
    pages = ref.Pages(kind, layout, n * layout.block_tokens // page_tokens, page_tokens,
                      layout.num_kv_heads)
    caches = ref.allocate(pages, device, seed, raw=True)
    views = paged.PageViews.from_vllm(caches, local_heads=layout.num_kv_heads,
                                      head_dim=layout.head_dim, page_tokens=page_tokens)
    rng = np.random.default_rng(seed)
    page_ids = [int(p) for p in rng.permutation(pages.num_pages)]
    slots = [int(s) for s in rng.permutation(n)]
    slab = HostSlab(layout.bytes_per_block, n, pin_cuda=cuda)
    back = HostSlab(layout.bytes_per_block, n, pin_cuda=cuda)
    try:
        slab.array[:] = ref.random_bytes(slab.array.shape, seed + 1).numpy()
        slab_t, back_t = torch.from_numpy(slab.array), torch.from_numpy(back.array)
        dev = torch.empty((n, layout.bytes_per_block), dtype=torch.uint8, device=device)
        pageable = torch.from_numpy(slab.array.copy())
        pinned = pageable.pin_memory() if cuda else None
        kv = paged.PagedRequestKV(views, layout, page_ids)
        staging = torch.empty_like(dev)
        staged_blocks = blocks_view(staging, layout)
        blocks = list(range(n))

        def load_staged() -> None:  # candidate: DMA each slab row, then scatter on the device
            for i, s in enumerate(slots):
                staging[i].copy_(slab_t[s], non_blocking=True)
            kv.write_blocks(0, staged_blocks)

        def store_staged() -> None:  # candidate: gather on the device, then DMA each row
            kv.read_blocks(0, staged_blocks)
            for i, s in enumerate(slots):
                back_t[s].copy_(staging[i], non_blocking=True)

        runs: dict[str, Callable[[], object]] = {
            "h2d_pageable_copy_": lambda: dev.copy_(pageable),
            "h2d_registered_slab_copy_": lambda: dev.copy_(slab_t, non_blocking=True),
            "load_kvshare": lambda: kv.write_slots(blocks, slab.array, slots),
            "load_staged_dma": load_staged,
            "d2h_pageable_copy_": lambda: pageable.copy_(dev),
            "d2h_registered_slab_copy_": lambda: back_t.copy_(dev, non_blocking=True),
            "store_kvshare": lambda: kv.read_slots(blocks, back.array, slots),
            "store_staged_dma": store_staged,
        }
        if pinned is not None:
            runs["h2d_pinned_copy_"] = lambda: dev.copy_(pinned, non_blocking=True)
            runs["d2h_pinned_copy_"] = lambda: pinned.copy_(dev, non_blocking=True)
        skipped: dict[str, str] = {}
        if cuda:  # candidate: kernels read and write the registered slab in place (UVA)
            try:
                src_rows = blocks_view(mapped(slab.array, device), layout)
                dst_rows = blocks_view(mapped(back.array, device), layout)
                by_slot = paged.PagedRequestKV(views, layout, slot_order(page_ids, slots,
                                                                         pages.per_block))
                runs["load_zero_copy"] = lambda: by_slot.write_blocks(0, src_rows)
                runs["store_zero_copy"] = lambda: by_slot.read_blocks(0, dst_rows)
            except Exception as exc:
                skipped["zero_copy"] = f"{type(exc).__name__}: {exc}"[:200]
        else:
            skipped["zero_copy"] = "needs CUDA (device kernels on registered host memory)"
        failed: list[str] = []
        loaded: dict[str, torch.Tensor] = {}
        candidates = ("load_staged_dma", "store_staged_dma", "load_zero_copy", "store_zero_copy")
        for name, fn in runs.items():
            share = max(deadline - time.perf_counter(), 0.0) / max(len(runs) - len(gbps), 1)
            if name.startswith("load_"):  # a copy that writes nothing must not pass
                for cache in caches.values():
                    cache.zero_()
            elif name.startswith("store_"):
                back.array[:] = 0
            try:
                gbps[name] = round(nbytes / timed(fn, device, time.perf_counter() + share)
                                   / 1e9, 4)
            except Exception as exc:
                if name not in candidates:
                    raise
                skipped[name] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            if name.startswith("store_") and not np.array_equal(back.array, slab.array):
                failed.append(f"{name} did not give back the loaded slab rows")
            if name == "load_kvshare":
                loaded = ref.host_bytes(caches)
                want = {k: torch.zeros_like(v) for k, v in loaded.items()}
                ref.load(want, pages, torch.from_numpy(slab.array[slots]), page_ids, blocks)
                if any(not torch.equal(loaded[k], want[k]) for k in want):
                    failed.append("load_kvshare wrote other bytes than the reference")
                del want
            elif name.startswith("load_") and any(
                    not torch.equal(loaded[k], v) for k, v in ref.host_bytes(caches).items()):
                failed.append(f"{name} wrote other bytes than load_kvshare")
        base = "pinned" if pinned is not None else "pageable"
        ratios = {f"{name}_vs_{base}": round(gbps[name] / gbps[f"{direction(name)}_{base}_copy_"], 4)
                  for name in gbps if name.startswith(("load_", "store_")) or "registered" in name}
        if pinned is not None:
            for d in ("h2d", "d2h"):
                ratios[f"{d}_pageable_vs_pinned"] = round(gbps[f"{d}_pageable_copy_"]
                                                          / gbps[f"{d}_pinned_copy_"], 4)
        rec: Record = {
            "status": "mismatch" if failed else "ok", "failed": failed,
            "baseline": f"{base} copy_" + ("" if pinned is not None
                                           else " (no CUDA: nothing to pin; host copies)"),
            "slab_registered": registered(slab.array), "gbps": gbps, "ratios": ratios,
            "not_measured": skipped,
            "targets_met": {"load >= 0.8x": ratios[f"load_kvshare_vs_{base}"] >= 0.8,
                            "store >= 0.8x": ratios[f"store_kvshare_vs_{base}"] >= 0.8},
        }
        if failed:
            rec["reason"] = "; ".join(failed)
        return rec
    finally:
        slab.close()
        back.close()
