"""The OpenAI app as the ingress of the cluster on Ray Serve (``pagedkv serve
--data-parallel-size N``): one Serve replica that serves ``pagedkv serve``'s routes over the
engine replicas of :mod:`pagedkv.cluster.ray_serve`, through :class:`ClusterEngineLoop`.

Pass :class:`OpenAIIngress` as ``ingress`` to :func:`pagedkv.cluster.ray_serve.start_cluster`.
Requires ``pip install 'pagedkv[cluster]'``.
"""

from __future__ import annotations

from typing import Any

from pagedkv.cluster.protocol import ReplicaInfo
from pagedkv.cluster.ray_serve import RayDispatcher
from pagedkv.entrypoints.cluster.frontend import ClusterEngineLoop


class OpenAIIngress:
    """The OpenAI app over the engine deployment (wrapped by ``serve.ingress()`` in
    :func:`pagedkv.cluster.ray_serve.build_app`).

    Args:
        engine_handle: DeploymentHandle of the engine deployment.
        num_replicas: engine replicas (ranks 0..N-1), which ``/metrics`` and
            ``/reset_prefix_cache`` ask.
        model_name: the name clients pass as ``model`` (None: the engines' model file's name).
        server_options: the HTTP layer's security and limits
            (:class:`pagedkv.entrypoints.openai.server_options.ServerOptions`; None: defaults).
        app_options: more keyword arguments of
            :func:`pagedkv.entrypoints.openai.app.create_app` (``chat_options``,
            ``metrics_prefix``).
    """

    async def __init__(
        self,
        engine_handle: Any,
        *,
        num_replicas: int,
        model_name: str | list[str] | None = None,
        server_options: Any = None,
        app_options: dict[str, Any] | None = None,
    ) -> None:
        self.dispatcher = RayDispatcher(engine_handle, num_replicas)
        self.info: ReplicaInfo = await engine_handle.describe.remote()
        self.model_name = model_name or self.info.model_name
        self.server_options = server_options
        self.app_options = dict(app_options or {})

    def __serve_build_asgi_app__(self) -> Any:
        # Lazy: built in the Ray Serve replica, not where the deployment is declared.
        from pagedkv.entrypoints.openai.app import create_app

        loop = ClusterEngineLoop(self.dispatcher, self.info.input_processor)
        return create_app(
            loop, model_name=self.model_name, options=self.server_options, **self.app_options
        )
