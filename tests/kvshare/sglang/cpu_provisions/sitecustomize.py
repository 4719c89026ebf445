"""TEST-ONLY CPU PROVISION 2 of 2: SGLang's HiCache host pool on a machine without CUDA.

Run by Python at start-up in every process of a test SGLang server (``tests/kvshare/sglang``
puts this folder first on ``PYTHONPATH``); it changes three things of SGLang 0.5.23 as SGLang
imports them, nothing else, and kvshare never imports it:

- **no pinning**: on ``--device cpu`` HiCache's host pools pin their memory with
  ``torch.cuda.cudart().cudaHostRegister``, which fails without a CUDA driver; every
  ``HostKVCache`` is built with ``pin_memory=False`` (pageable memory, what a CPU server has
  anyway);
- **the direct copy**: with ``--hicache-io-backend direct --hicache-mem-layout layer_first``
  the MHA host pool copies pages between the device pool and itself with
  ``sgl_kernel.kvcacheio.transfer_kv_direct``, which it imports only on CUDA/HIP/XPU (on the
  CPU the name is undefined); :func:`transfer_kv_direct` is the same row copy in torch
  (``dst[dst_indices] = src[src_indices]`` per layer), defined where it is missing;
- **the host-memory reserve**: SGLang refuses any host pool unless 10 GiB of RAM stay free
  beside it (``HICACHE_HOST_MEMORY_RESERVE_BYTES``); the test machine has 24 GiB shared by
  several test runs, and the test pools are a few MiB, so the reserve is 256 MiB here.

Provision 1 is the ``sgl_kernel`` stand-in beside this file.
"""

from __future__ import annotations

import importlib.abc
import inspect
import sys
from typing import Any


def transfer_kv_direct(src_layers: list[Any], dst_layers: list[Any], src_indices: Any,
                       dst_indices: Any, page_size: int) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` in torch: token rows ``src_indices`` of
    each source layer tensor into rows ``dst_indices`` of its destination (whole pages)."""
    dst_i = dst_indices.to(dst_layers[0].device) if dst_layers else dst_indices
    src_i = src_indices.to(src_layers[0].device) if src_layers else src_indices
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_i] = src[src_i].to(dst.device)


def _define_direct_copy(module: Any) -> None:
    if not hasattr(module, "transfer_kv_direct"):
        module.transfer_kv_direct = transfer_kv_direct


def _unpinned(cls: Any) -> None:
    init = cls.__init__
    params = inspect.signature(init)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = params.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        init(*bound.args, **bound.kwargs)

    cls.__init__ = __init__


def _small_machine(base: Any) -> None:
    _unpinned(base.HostKVCache)
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 256 * 2**20


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.base": _small_machine,
    "sglang.srt.mem_cache.pool_host.mha": _define_direct_copy,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the modules in :data:`_PATCHES` so each is patched as it loads."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
