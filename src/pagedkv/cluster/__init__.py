"""Several engine replicas behind one endpoint, routed to where prompts' prefixes are cached
(docs/cluster.md): the library the multi-replica cluster uses, between the engine and the
entrypoints. The HTTP side (the OpenAI server's engine loop over a cluster, the Ray Serve
ingress) is :mod:`pagedkv.entrypoints.cluster`; ``pagedkv serve --data-parallel-size N`` is
:mod:`pagedkv.entrypoints.serve`.

- :mod:`.kv_events`: KV-cache events on the wire (vLLM's msgspec format, ZMQ PUB / SUB).
- :mod:`.prefix_index`: which replica caches which block hashes, and the ranking of replicas
  (pure Python; the multi-replica simulator uses it too).
- :mod:`.protocol`: what travels between front end, router and replicas, and the
  :class:`~.protocol.Dispatcher` interface the front end sends work through.
- :mod:`.replica`: one engine publishing its KV-cache events.
- :mod:`.router`: the routing decision (events -> prefix index -> ranks).
- :mod:`.local`: a cluster in one process (tests, benchmarks).
- :mod:`.ray_serve`: the same on Ray Serve (needs ``pip install 'pagedkv[cluster]'``).

Nothing here is imported by ``import pagedkv``; Ray, ZMQ and msgspec load only when used.
"""
