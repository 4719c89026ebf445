"""The global index: which location holds which block, in which tier.

One concept per module, from storage up to the Ray wrapper and the client routers use:

- :mod:`~actors.index.holders`: interned holder sets (``{location: tier}`` as one small int);
- :mod:`~actors.index.table`: one namespace's ``hash -> holder state`` map;
- :mod:`~actors.index.registry`: registered inference workers under leases;
- :mod:`~actors.index.runs`: a match in run form (:class:`~actors.index.runs.HolderRuns`),
  the compact answer the index computes and sends;
- :mod:`~actors.index.wire`: the one-bytes-in, one-bytes-out wire format of matches;
- :mod:`~actors.index.arrow_io`: event batches, inventories and snapshots in Arrow;
- :mod:`~actors.index.global_index`: :class:`GlobalIndex`, the plain class (no Ray);
- :mod:`~actors.index.actor`: :class:`GlobalIndexActor`, one shard as a restartable actor;
- :mod:`~actors.index.client`: :class:`IndexClient`, N shards behind one object;
- :mod:`~actors.index.keeper`: starting shards, finding them by name, recreating one that is
  gone for good (the watcher runs it).

Import from the module that defines a name (this package re-exports nothing, so importing
the plain index never imports Ray).
"""
