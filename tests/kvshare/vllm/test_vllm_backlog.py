"""The connector's prefill backlog (:mod:`kvshare.vllm.connector.backlog`): its counters always say what
it holds, whatever order the scheduler's calls come in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvshare.vllm.connector.backlog import PrefillBacklog

RIDS = st.sampled_from(["a", "b", "c", "d"])
CALLS = st.lists(st.one_of(
    st.tuples(st.just("seen"), RIDS, st.integers(-5, 3000)),
    st.tuples(st.just("step"), st.dictionaries(RIDS, st.integers(0, 1200), max_size=3)),
    st.tuples(st.just("gone"), RIDS)), max_size=40)


@given(CALLS)
def test_counters_are_the_backlog_after_any_calls(calls: list[tuple]) -> None:  # type: ignore[type-arg]
    clock = iter(range(1, 1000))
    b = PrefillBacklog(clock=lambda: float(next(clock)))
    left: dict[str, int] = {}
    waiting: set[str] = set()
    steps = 0
    for call in calls:
        if call[0] == "seen":
            b.seen(call[1], call[2])
            left[call[1]] = max(0, call[2])
            waiting.add(call[1])
        elif call[0] == "step":
            b.step(call[1])
            steps += 1
            for rid, n in call[1].items():
                if rid in left:
                    left[rid] = max(0, left[rid] - n)
                    waiting.discard(rid)
        else:
            b.gone(call[1])
            left.pop(call[1], None)
            waiting.discard(call[1])
        left = {r: n for r, n in left.items() if n > 0}
        waiting &= set(left)
        c = b.counters
        assert b.tokens == sum(left.values()) == c["backlog_tokens_added"] - c["backlog_tokens_removed"]
        assert b.waiting == len(waiting) == c["backlog_waiting_added"] - c["backlog_waiting_removed"]
        assert c["backlog_as_of_seconds"] == steps  # the clock's reading at the last step
        assert all(v >= 0 for v in c.values())
        # the drain counts only backlog tokens that were computed
        assert c["backlog_drained_tokens"] <= c["backlog_tokens_removed"]


def test_the_drain_counts_the_steps_that_computed_backlog_and_ran_on() -> None:
    now = [0.0]
    b = PrefillBacklog(clock=lambda: now[0])
    b.seen("a", 3000)
    b.seen("b", 2400)
    now[0] = 1.0
    b.step({"a": 2048})  # a full step: 952 of a and all of b left
    now[0] = 4.0
    b.step({"a": 952, "b": 1096, "d": 1})  # the last ran 3 s; d decodes (not backlog)
    b.gone("a")  # a finished at its first token: b and d go on
    now[0] = 5.0
    b.step({"b": 1304})  # the last ran 1 s (b and d were still there)
    c = b.counters
    assert (c["backlog_drained_tokens"], c["backlog_drain_seconds"]) == (4096, 4.0)
    b.gone("b")  # every request of that step ended: an idle gap may follow, not counted
    now[0] = 60.0
    b.step({"d": 1})  # decode only: nothing drained
    b.seen("e", 500)
    now[0] = 61.0
    b.step({})  # e waits on a load
    now[0] = 62.0
    b.step({"e": 100})
    now[0] = 62.5
    b.gone("e")  # aborted mid-prefill
    now[0] = 63.0
    b.step({})
    assert (c["backlog_drained_tokens"], c["backlog_drain_seconds"]) == (4096, 4.0)
    b.seen("f", 200)
    now[0] = 70.0
    b.step({"f": 200})  # empties the backlog; f decodes on
    now[0] = 70.5
    b.step({"f": 1})
    assert (c["backlog_drained_tokens"], c["backlog_drain_seconds"]) == (4296, 4.5)
