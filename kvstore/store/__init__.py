"""The shared-store tier: a Mooncake Store DRAM pool below the workers, in one place.

* :mod:`kvstore.store.client` — :class:`~kvstore.store.client.KVStore`, one worker's client
  (asynchronous bounded puts on a writer thread, lookups and gets, what the store holds as
  ``stored`` / ``removed`` changes), :class:`~kvstore.store.client.StoreConfig`
  (``K3SERVE_STORE_*``) and the key format;
* :mod:`kvstore.store.bridge` — :class:`~kvstore.store.bridge.StoreBridge`, the engine-thread
  side: the cache manager's ids ↔ bytes in the pools (write-through, local view, import);
* :mod:`kvstore.store.tier` — :class:`~kvstore.store.tier.StoreTier`, a worker's use of both
  (export every tick, fetch before a prefill, cache events with ``source: "store"``, metrics);
* :mod:`kvstore.store.sim` — :class:`~kvstore.store.sim.SimStore`, the simulator's model of the
  store (an LRU pool measured in block units, with an event log for the router's index).

The core (``k3serve/``) does not import this package; it offers the cache manager's events,
index and :class:`~k3serve.cache.imports.PrefixImporter`, and the pools' byte copies.
"""
