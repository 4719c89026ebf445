"""Lazy package exports: a package names what it re-exports and from where, and a name's
module is imported on first use (so importing a package stays cheap and optional
dependencies stay optional, as mini-sglang's registry does)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module path)
    on first use of ``name`` and returns its attribute; AttributeError for any other name."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(module), name)

    return __getattr__
