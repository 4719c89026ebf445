"""The worker's cut point from the router's cost model, fitted to this worker's own timings.

:mod:`kvshare.cost` is the same transfer-vs-recompute model the router scores workers with. The prefill model ``a*n + b*n*(c + n/2)`` is fitted from a short
calibration at start and refitted from live prefill timings (:meth:`CostCut.observe`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from importlib import import_module
from typing import Any

from kvshare.layout import KVLayout

log = logging.getLogger(__name__)


class CostCut:
    """A :data:`kvshare.client.CutPolicy`: the cut ``k`` minimising fetch + prefill time."""

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
        self._cost: Any = import_module("kvshare.cost")
        self._bw = self._cost.Bandwidths.from_measured(dict(bandwidths or {}))
        self._timings = self._cost.PrefillTimings(refit_every, max_samples, samples)
        self._lock = threading.Lock()
        self.refit_every = refit_every
        self._model: Any = None
        self._refit()

    @classmethod
    def try_create(cls, layout: KVLayout, **kwargs: Any) -> CostCut | None:
        """A CostCut, or None when the cost model cannot be built (then load everything)."""
        try:
            return cls(layout, **kwargs)
        except ImportError as exc:
            log.info("cost model not available (%s): loading every cached block", exc)
            return None

    def _refit(self) -> None:
        cost = self._cost
        try:
            prefill = cost.PrefillModel.fit(self._timings.samples)
        except ValueError:
            prefill = cost.PrefillModel.from_tokens_per_s(5_000.0)
        self._model = cost.CostModel(prefill, self._bw, self.layout.block_tokens,
                                     self.layout.bytes_per_token)

    def set_bandwidths(self, measured: Mapping[str, float]) -> None:
        """Use measured bytes/s (keys as :meth:`kvshare.cost.Bandwidths.from_measured` takes;
        others are ignored) instead of the defaults; the model is rebuilt at once."""
        known = {"shm", "host", "disk", "nixl", "objstore", "remote"}
        usable = {k: float(v) for k, v in measured.items() if k in known and v > 0}
        with self._lock:
            self._bw = self._cost.Bandwidths.from_measured(usable)
            self._refit()

    @property
    def model(self) -> Any:
        """The current :class:`kvshare.cost.CostModel`."""
        return self._model

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Record one prefill timing; the model is refitted every ``refit_every`` samples."""
        with self._lock:
            if self._timings.add(new_tokens, cached_tokens, seconds) is not None:
                self._refit()

    def __call__(self, prompt_tokens: int, sources: Sequence[str]) -> int:
        if not sources:
            return 0
        src = self._cost.Source
        plan = self._model.plan(prompt_tokens, [src[s.upper()] for s in sources])
        return int(plan.cut)


def calibrate(engine: Any, sizes: Sequence[int] = (128, 512, 1024)) -> list[tuple[float, float, float]]:
    """Prefill timings ``(new, cached, seconds)`` of a few cold prompts on ``engine``."""
    out = []
    for n in sizes:
        tokens = [(7 * i) % 256 for i in range(n)]
        pre = engine.prefill(tokens)
        out.append((float(pre.computed_tokens), 0.0, pre.seconds))
    return out
