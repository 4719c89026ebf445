"""An engine's cut point from the router's cost model, fitted to that engine's own timings.

:mod:`kvshare.cost` is the same transfer-vs-recompute model the router scores workers with.
The prefill model ``a*n + b*n*(c + n/2)`` is fitted from timings the engine gives it (a short
calibration at start, then live prefills through :meth:`CostCut.observe`). Any engine uses it:
the reference worker (:mod:`kvshare.engines.runtime`) and the vLLM connector.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from kvshare.cost import Bandwidths, CostModel, PrefillModel, PrefillTimings, Source
from kvshare.layout import KVLayout


class CostCut:
    """A :data:`kvshare.client.sdk.CutPolicy`: the cut ``k`` minimising fetch + prefill time."""

    def __init__(
        self,
        layout: KVLayout,
        samples: Sequence[tuple[float, float, float]] = (),
        bandwidths: Mapping[str, float] | None = None,
        *,
        refit_every: int = 16,
        max_samples: int = 256,
    ) -> None:
        self.layout = layout
        self._bw = Bandwidths.from_measured(dict(bandwidths or {}))
        self._timings = PrefillTimings(refit_every, max_samples, samples)
        self._lock = threading.Lock()
        self.refit_every = refit_every
        self._model = self._fit()

    def _fit(self) -> CostModel:
        try:
            prefill = PrefillModel.fit(self._timings.samples)
        except ValueError:
            prefill = PrefillModel.from_tokens_per_s(5_000.0)
        return CostModel.for_layout(prefill, self._bw, self.layout)

    def set_bandwidths(self, measured: Mapping[str, float]) -> None:
        """Use measured bytes/s (keys as :meth:`kvshare.cost.Bandwidths.from_measured` takes;
        others are ignored) instead of the defaults; the model is rebuilt at once."""
        known = {"shm", "host", "disk", "nixl", "objstore", "remote"}
        usable = {k: float(v) for k, v in measured.items() if k in known and v > 0}
        with self._lock:
            self._bw = Bandwidths.from_measured(usable)
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

    def __call__(self, prompt_tokens: int, sources: Sequence[Source]) -> int:
        if not sources:
            return 0
        plan = self._model.plan(prompt_tokens, sources)
        return int(plan.cut)

