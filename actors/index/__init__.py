"""The global index: which location holds which block, in which tier.

One concept per module, from storage up to the Ray wrapper and the client routers use:

- :mod:`~kvshare.actors.index.holders`: interned holder sets (``{location: tier}`` as one small int);
- :mod:`~kvshare.actors.index.table`: one namespace's ``hash -> holder state`` map;
- :mod:`~kvshare.actors.index.registry`: registered inference workers under leases;
- :mod:`~kvshare.actors.index.engine_value`: what each worker's own engine cache is worth;
- :mod:`~kvshare.actors.index.runs`: a match in run form (:class:`~kvshare.actors.index.runs.HolderRuns`),
  the compact answer the index computes and sends;
- :mod:`~kvshare.actors.index.wire`: the one-bytes-in, one-bytes-out wire format of matches;
- :mod:`~kvshare.actors.index.arrow_io`: event batches, inventories and snapshots in Arrow;
- :mod:`~kvshare.actors.index.global_index`: :class:`GlobalIndex`, the plain class (no Ray);
- :mod:`~kvshare.actors.index.actor`: :class:`GlobalIndexActor`, one shard as a restartable actor;
- :mod:`~kvshare.actors.index.client`: :class:`IndexClient`, N shards behind one object;
- :mod:`~kvshare.actors.index.names`: finding shards by name (what a client needs);
- :mod:`~kvshare.actors.index.keeper`: starting shards, finding them by name, recreating one that is
  gone for good (the watcher runs it).

Import from the module that defines a name (this package re-exports nothing, so importing
the plain index never imports Ray).
"""
