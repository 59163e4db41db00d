"""The cluster's HTTP side: the OpenAI server over several engine replicas (docs/cluster.md).
The replicas, the routing and the Ray Serve deployment are the library :mod:`pagedkv.cluster`.

- :mod:`.frontend`: the OpenAI server's engine loop over a cluster (:class:`ClusterEngineLoop`).
- :mod:`.ray_ingress`: the OpenAI app as the Ray Serve ingress (``pagedkv serve
  --data-parallel-size N``; needs ``pip install 'pagedkv[cluster]'``).
- :mod:`.ray_process`: how ``pagedkv serve`` runs Ray in its process (a local Ray on loopback,
  SIGTERM that stops the cluster cleanly).

Nothing here is imported by ``import pagedkv``; Ray loads only when used.
"""
