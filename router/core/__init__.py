"""The routing core: one place a routing decision is made.

- :mod:`~kvshare.router.core.routing`: :class:`RoutingCore` (match, books, policy, ranking);
- :mod:`~kvshare.router.core.index`: :class:`RouterIndex`, the index as the core asks it;
- :mod:`~kvshare.router.core.embed`: :class:`CacheAwareRouter` for any asyncio gateway;
- :mod:`~kvshare.router.core.policy`: the policy interface, the registry, the cost policy and
  the baselines;
- :mod:`~kvshare.router.core.sources`, :mod:`~kvshare.router.core.workers_view`: per-worker
  views of a match and of the workers' loads;
- :mod:`~kvshare.router.core.pending`, :mod:`~kvshare.router.core.ready`,
  :mod:`~kvshare.router.core.recency`: the router's books;
- :mod:`~kvshare.router.core.metrics`, :mod:`~kvshare.router.core.recent`: what it exposes.
"""
