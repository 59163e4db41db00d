"""Several engine replicas behind one OpenAI endpoint, routed by where prompts' prefixes are
cached (docs/cluster.md).

- :mod:`.protocol`: what travels between front end, router and replicas.
- :mod:`.replica`: one engine publishing its KV-cache events (:mod:`pagedkv.engine.kv_events`).
- :mod:`.router`: the routing decision (events -> :mod:`pagedkv.core.prefix_index` -> ranks).
- :mod:`.frontend`: the OpenAI server's engine loop over a cluster.
- :mod:`.local`: a cluster in one process (tests, benchmarks).
- :mod:`.ray_serve`: the same on Ray Serve (``pagedkv serve --data-parallel-size N``; needs
  ``pip install 'pagedkv[cluster]'``).

Nothing here is imported by ``import pagedkv``; Ray, ZMQ and msgpack load only when used.
"""
