"""The cost model lives in :mod:`kvshare.cost` (the router and the worker SDK share it)."""

from kvshare.cost import Bandwidths, CostModel, Plan, PrefillModel, Source

__all__ = ["Bandwidths", "CostModel", "Plan", "PrefillModel", "Source"]
