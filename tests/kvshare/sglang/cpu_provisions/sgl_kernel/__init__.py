"""TEST-ONLY CPU PROVISION 1 of 2: an import stand-in for ``sgl_kernel`` (never used to serve).

Every ``sgl-kernel``/``sglang-kernel`` wheel is a CUDA build and none installs on a machine
without ``libcuda.so.1``, yet SGLang 0.5.23 imports some of its ops at module load (e.g.
``sglang/kernels/ops/kvcache/cache_move.py``) even when it serves on the CPU, where it never
calls them. This package lets those imports succeed: any name, in ``sgl_kernel`` or any of its
submodules, is a :class:`StandInOp`. Calling one appends its name to the file named by
``$KVSHARE_SGL_STANDIN_LOG`` (the server tests read it after serving and fail on any line)
and raises :class:`StandInCalled`, so a stand-in can never compute part of an answer.

Only ``tests/kvshare/sglang`` puts this folder on ``PYTHONPATH``; kvshare never imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

LOG_ENV = "KVSHARE_SGL_STANDIN_LOG"
__version__ = "0.0.0+kvshare-test-standin"


class StandInCalled(RuntimeError):
    """A CUDA op of the stand-in was called: SGLang took a path that needs the real kernels."""


def _record(name: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {name}\n")


class StandInOp:
    """A named placeholder: attribute access gives deeper names, a call records and raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> StandInOp:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandInOp(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _record(self._name)
        raise StandInCalled(f"{self._name} (sgl_kernel stand-in) was called: the CPU test "
                            "server took a path that needs SGLang's CUDA kernels")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def _module_getattr(module: str) -> Any:
    def __getattr__(attr: str) -> StandInOp:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandInOp(f"{module}.{attr}")
    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel.<anything>`` imports as a module of stand-ins."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(f, _Submodules) for f in sys.meta_path):
    sys.meta_path.insert(0, _Submodules())
__getattr__ = _module_getattr(__name__)
