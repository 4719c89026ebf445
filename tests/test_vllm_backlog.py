"""The connector's prefill backlog (:mod:`kvshare.vllm.backlog`): its counters always say what
it holds, whatever order the scheduler's calls come in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvshare.vllm.backlog import PrefillBacklog

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
