"""quick_init: a cheaper ``__init__`` for a frozen dataclass built on every routing decision.

A frozen dataclass's generated ``__init__`` sets each field through
``object.__setattr__(self, name, value)``: a global lookup, an attribute lookup and a call per
field, ~4x the cost of a plain class's (a 9-field ``Decision``: ~1.3 us against ~5 us on the
benchmark machine). A router makes half a dozen such objects per decision (the request, the
index answer, the plan, the decision, the routed result, a candidate's load), a few percent of
a decision each. :func:`quick_init` replaces the generated ``__init__`` with one that writes
the same values into the instance's ``__dict__`` directly, as ``object.__setattr__`` would:

    @quick_init
    @dataclass(frozen=True)
    class Decision: ...

Contract: the instance is the same object the generated ``__init__`` makes (same fields, same
defaults and default factories, ``__post_init__`` called last, still frozen: assigning a field
raises ``FrozenInstanceError``; equality, hashing and ``repr`` unchanged). Only plain frozen
dataclasses qualify: positional-or-keyword fields all in ``__init__`` (no ``init=False``,
``kw_only``, ``InitVar``) and no ``__slots__``; anything else raises TypeError at decoration,
so a class that grows such a field fails at import, never later. ``tests/test_quick_init.py``
checks the replaced ``__init__`` against the generated one.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")

_DICT = "_qi_dict"  # the local naming the instance dict (no field may take this name)
_NO_ARG = object()  # a default-factory field's default: "not passed"


def quick_init(cls: type[T]) -> type[T]:
    """``cls`` with its ``__init__`` replaced (module docstring); TypeError if it does not
    qualify."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"quick_init takes a frozen dataclass, not {cls.__name__}")
    if "__slots__" in vars(cls):
        raise TypeError(f"quick_init: {cls.__name__} has __slots__ (no instance dict to write)")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = [f.name for f in fields]
    generated = list(inspect.signature(cls.__init__).parameters)[1:]  # (without self)
    if any(not f.init or f.kw_only for f in fields) or generated != names or _DICT in names:
        raise TypeError(f"quick_init: {cls.__name__} has fields outside the plain case "
                        "(init=False, kw_only or InitVar): keep its generated __init__")
    scope: dict[str, Any] = {"_NO_ARG": _NO_ARG}
    args, body = [], [f"    {_DICT} = self.__dict__"]
    for f in fields:
        if f.default is not dataclasses.MISSING:
            scope[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
            body.append(f"    {_DICT}[{f.name!r}] = {f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"_factory_{f.name}"] = f.default_factory
            args.append(f"{f.name}=_NO_ARG")
            body.append(f"    {_DICT}[{f.name!r}] = "
                        f"_factory_{f.name}() if {f.name} is _NO_ARG else {f.name}")
        else:
            args.append(f.name)
            body.append(f"    {_DICT}[{f.name!r}] = {f.name}")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    source = f"def __init__(self, {', '.join(args)}):\n" + "\n".join(body) + "\n"
    exec(source, scope)  # noqa: S102 - code built above from the class's own field names
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
