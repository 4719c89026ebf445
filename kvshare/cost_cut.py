"""An engine's cut point from the router's cost model, fitted to that engine's own timings.

:mod:`kvshare.cost` is the same transfer-vs-recompute model the router scores workers with.
The prefill model ``a*n + b*n*(c + n/2)`` is fitted from timings the engine gives it (a short
calibration at start, then live prefills through :meth:`CostCut.observe`). Any engine uses it:
the reference worker (:mod:`kvshare.engines.runtime`) and the vLLM connector.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace

from kvshare.cost import Bandwidths, CostModel, PrefillModel, PrefillTimings, Source
from kvshare.layout import KVLayout
from kvshare.links import Links


class CostCut:
    """A :data:`kvshare.client.sdk.CutPolicy`: the cut ``k`` minimising fetch + prefill time.

    Remote blocks are priced at the probed link from their holder node to this one where
    :meth:`set_peer_bandwidths` gave it (the slowest such link when a plan pulls from several
    holders), else at the node's remote figure (:meth:`set_bandwidths`).

    ``deadline_s``: the load's deadline (the SDK's ``load_deadline_s``). A load still running
    at its deadline is dropped whole and the prompt recomputed after the wait, so a cut whose
    fetch is predicted to take longer than ``DEADLINE_SHARE`` of it is never chosen: the best
    cut among the shorter ones is (on a slow link, a leading part of the prefix, or nothing).
    """

    DEADLINE_SHARE = 0.8
    """Of the deadline, what a planned fetch may take (probes and live transfers vary)."""

    def __init__(
        self,
        layout: KVLayout,
        samples: Sequence[tuple[float, float, float]] = (),
        bandwidths: Mapping[str, float] | None = None,
        *,
        refit_every: int = 16,
        max_samples: int = 256,
        deadline_s: float | None = None,
    ) -> None:
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive seconds or None, got {deadline_s}")
        self.layout = layout
        self.deadline_s = deadline_s
        self._bw = Bandwidths.from_measured(dict(bandwidths or {}))
        self._node = ""  # the reader's node (set_peer_bandwidths)
        self._speed = 0.0  # the engine's measured tokens/s while no timings are fitted
        self._timings = PrefillTimings(refit_every, max_samples, samples)
        self._lock = threading.Lock()
        self.refit_every = refit_every
        self._model = self._fit()

    def _fit(self) -> CostModel:
        try:
            prefill = PrefillModel.fit(self._timings.samples)
        except ValueError:
            prefill = PrefillModel.from_tokens_per_s(self._speed or 5_000.0)
        return CostModel.for_layout(prefill, self._bw, self.layout)

    def set_bandwidths(self, measured: Mapping[str, float]) -> None:
        """Use measured bytes/s (keys as :meth:`kvshare.cost.Bandwidths.from_measured` takes;
        others are ignored) instead of the defaults; the model is rebuilt at once."""
        known = {"shm", "host", "disk", "nixl", "objstore", "remote"}
        usable = {k: float(v) for k, v in measured.items() if k in known and v > 0}
        with self._lock:
            self._bw = Bandwidths.from_measured(usable, replace(Bandwidths(), links=self._bw.links))
            self._model = self._fit()

    def set_peer_bandwidths(self, node: str, per_peer: Mapping[str, float]) -> None:
        """Bytes/s of a pull from each peer node (holder) to this worker's ``node``, e.g. the
        figures this node's pool probed of the transport in use; replaces the last ones."""
        links = Links(tuple((str(peer), node, float(v)) for peer, v in sorted(per_peer.items())
                            if peer != node and v > 0))
        with self._lock:
            self._node = node
            self._bw = replace(self._bw, links=links)
            self._model = self._fit()

    def use_speed(self, tokens_per_s: float) -> None:
        """The engine's measured prefill speed, used while fewer than two timings are known
        (an engine that reports speeds, not timings: vLLM's steps); the model is rebuilt only
        when it moves by more than 10%."""
        if not tokens_per_s > 0:
            return
        with self._lock:
            if len(self._timings.samples) >= 2 or abs(tokens_per_s - self._speed) <= 0.1 * self._speed:
                return
            self._speed = float(tokens_per_s)
            self._model = self._fit()

    @property
    def model(self) -> CostModel:
        """The current :class:`kvshare.cost.CostModel`."""
        return self._model

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Record one prefill timing; the model is refitted every ``refit_every`` samples."""
        with self._lock:
            if self._timings.add(new_tokens, cached_tokens, seconds) is not None:
                self._model = self._fit()

    def __call__(self, prompt_tokens: int, sources: Sequence[Source],
                 holders: Sequence[str] = ()) -> int:
        """The cut for a prompt of ``prompt_tokens`` whose leading blocks come from
        ``sources``; ``holders[i]``: the node block ``i`` would come from (per-link pricing)."""
        if not sources:
            return 0
        model = self._model
        if holders and model.bandwidths.links:
            model = model.for_pull({h for h, s in zip(holders, sources, strict=False) if s.remote},
                                   self._node)
        plan = model.plan(prompt_tokens, sources)
        if self.deadline_s is not None:
            budget = self.DEADLINE_SHARE * self.deadline_s
            while plan.cut and plan.fetch_s > budget:  # that fetch would miss the deadline
                per_block = plan.fetch_s / plan.cut  # shorten in proportion, then re-plan
                fits = min(plan.cut - 1, int(budget / per_block))
                plan = model.plan(prompt_tokens, sources[:fits]) if fits else replace(
                    plan, cut=0, fetch_s=0.0)
        return int(plan.cut)

