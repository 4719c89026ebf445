"""Admission control at the gateway: how many requests may be in flight, in all and per tenant.

A request holds one slot from the moment it is admitted until its response is complete (the
last streamed byte, or the client gone). Past ``max_inflight`` in all, or past its tenant's
limit, a request is refused with 429 and ``Retry-After`` before it is routed, so one tenant
that opens many long requests fills its own slots and nobody else's. A tenant's limit is
``Tenant.max_inflight`` (the API-keys file's ``"max_inflight"``) or
``AdmissionConfig.max_inflight_per_tenant``. Workers bound their own queues as well
(:mod:`kvshare.engines.scheduler`); the gateway sends a request a worker refused to another.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    """``max_inflight``: requests in flight through this gateway; ``max_inflight_per_tenant``:
    per tenant unless its API key says otherwise; ``retry_after_s``: the ``Retry-After`` sent
    with a 429; ``default_deadline_s``: a request's deadline when it names none (its
    ``deadline_s``, bounded by ``Limits.max_deadline_s``)."""

    max_inflight: int = 256
    max_inflight_per_tenant: int = 64
    retry_after_s: int = 1
    default_deadline_s: float = 300.0

    def __post_init__(self) -> None:
        if min(self.max_inflight, self.max_inflight_per_tenant, self.retry_after_s) < 1:
            raise ValueError("max_inflight, max_inflight_per_tenant and retry_after_s must be >= 1")
        if not 0 < self.default_deadline_s < float("inf"):
            raise ValueError("default_deadline_s must be a finite positive number of seconds")


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted (the 429's message) and when to retry."""

    message: str
    retry_after_s: int


class Admission:
    """Counts in-flight requests per tenant; :meth:`enter` admits or refuses, :meth:`leave`
    frees the slot (exactly once per admitted request). One per event loop (not thread-safe)."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.inflight: Counter[str] = Counter()
        self.total = 0
        self.refused: Counter[str] = Counter()

    def enter(self, tenant: str, limit: int | None = None) -> Refusal | None:
        """Admit one request of ``tenant`` (None) or say why not; ``limit``: the tenant's own."""
        cfg = self.config
        cap = limit or cfg.max_inflight_per_tenant
        if self.inflight[tenant] >= cap:
            self.refused[tenant] += 1
            return Refusal(f"tenant {tenant!r} has {self.inflight[tenant]} requests in flight, "
                           f"its limit: wait for one to finish", cfg.retry_after_s)
        if self.total >= cfg.max_inflight:
            self.refused[tenant] += 1
            return Refusal(f"this gateway has {self.total} requests in flight, its limit: "
                           "retry shortly", cfg.retry_after_s)
        self.inflight[tenant] += 1
        self.total += 1
        return None

    def leave(self, tenant: str) -> None:
        assert self.inflight[tenant] > 0, f"leave() without enter() for {tenant!r}"
        self.inflight[tenant] -= 1
        self.total -= 1
        if not self.inflight[tenant]:
            del self.inflight[tenant]
