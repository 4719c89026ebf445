"""quick_init: the replaced __init__ makes the same frozen objects as the generated one."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import FrozenInstanceError, InitVar, dataclass, field

import pytest

from kvshare.cost import CutPlan, Source
from kvshare.quick_init import quick_init
from kvshare.router.core.embed import Routed, Tenant
from kvshare.router.core.policy import Candidate, Decision, Estimate, RouteRequest
from kvshare.router.core.routing import IndexAnswer
from kvshare.workers import WorkerLoad


def _pair() -> tuple[type, type]:
    """The same frozen dataclass twice: with its generated __init__, and quick_init's."""

    def make() -> type:
        @dataclass(frozen=True)
        class Shape:
            a: int
            b: str = "b"
            c: list[int] = field(default_factory=list)
            d: float = field(default=2.5, compare=False)
            seen: tuple[int, ...] = ()

            def __post_init__(self) -> None:
                if self.a < 0:
                    raise ValueError("a must be >= 0")
                object.__setattr__(self, "seen", (*self.seen, self.a))

        return Shape

    return make(), quick_init(make())


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, "x"), {}), ((2,), {"c": [3]}),
                                          ((), {"a": 4, "d": 1.0, "b": "y"})])
def test_same_fields_defaults_and_post_init_as_the_generated_init(args: tuple, kwargs: dict) -> None:
    plain, quick = _pair()
    want, got = plain(*args, **kwargs), quick(*args, **kwargs)
    assert vars(got) == vars(want)
    assert list(vars(got)) == list(vars(want))  # (same field order: repr and pickling agree)
    assert repr(got).split("(", 1)[1] == repr(want).split("(", 1)[1]


def test_errors_are_the_generated_inits() -> None:
    plain, quick = _pair()
    for cls in (plain, quick):
        with pytest.raises(ValueError, match="a must be >= 0"):
            cls(-1)
        with pytest.raises(TypeError):
            cls()  # a is required
        with pytest.raises(TypeError):
            cls(1, "b", [], 1.0, (), "one too many")


def test_still_frozen_hashable_and_a_fresh_default_per_instance() -> None:
    _, quick = _pair()
    one, two = quick(1), quick(1)
    with pytest.raises(FrozenInstanceError):
        one.a = 2
    assert one == two and hash(quick(1, c=())) == hash(quick(1, c=()))
    assert one.c is not two.c  # the default factory ran for each


def test_the_router_types_build_as_before() -> None:
    load = WorkerLoad("w1", 10, 2, 800.0, 5.0)
    assert load.with_queue(4, 1) == WorkerLoad("w1", 4, 1, 800.0, 5.0)
    assert dataclasses.replace(load, running=7).running == 7
    assert pickle.loads(pickle.dumps(load)) == load  # (reports cross Ray by pickle)
    plan = CutPlan(2, 512, 0.01, 0.2, {Source.LOCAL_HOST: 2})
    assert plan.total_s == pytest.approx(0.21) and CutPlan(0, 0, 0.0, 1.0).sources == {}
    d = Decision("w1", "http://w1", "cost", "cache_local", 0.3, 0.1, 2, 0, plan)
    assert d.plan is plan and d.to_dict()["reason"] == "cache_local"
    assert Estimate("w1", "", 0.3, 0.1, plan, "load").queue_s == 0.1
    with pytest.raises(ValueError, match="at least one token"):
        RouteRequest("ns", [], 0)
    assert RouteRequest("ns", [], 3).tenant == ""
    assert IndexAnswer(None, "index_timeout").timed is False  # type: ignore[arg-type]
    r = Routed("r1", d, Tenant(), "ns", [1, 2], [], 0.0)
    assert r.timings == {} and r.timings is not Routed("r2", d, Tenant(), "ns", [], [], 0.0).timings
    assert Candidate(None, load).active_blocks == 0  # type: ignore[arg-type]
    with pytest.raises(FrozenInstanceError):
        d.worker = "w2"  # type: ignore[misc]


def test_refuses_what_it_cannot_build_the_same() -> None:
    @dataclass
    class Mutable:
        a: int

    @dataclass(frozen=True)
    class Derived:
        a: int
        b: int = field(init=False, default=0)

    @dataclass(frozen=True)
    class KwOnly:
        a: int = field(kw_only=True)

    @dataclass(frozen=True)
    class Var:
        a: int
        scale: InitVar[int] = 1

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    for cls in (Mutable, Derived, KwOnly, Var, Slotted):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)
