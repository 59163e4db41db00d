"""`pagedkv serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

    pagedkv serve                                  # default model on http://127.0.0.1:8000
    pagedkv serve gemma3-270m --port 0             # a packaged model; any free port (printed)
    pagedkv serve Qwen/Qwen2.5-0.5B-Instruct       # from the local Hugging Face cache (HF_HOME)

The model is positional, as ``vllm serve MODEL`` takes it, or ``--model`` / ``-m`` as in the
other subcommands (:func:`pagedkv.model.loader.resolve_model` says what it may name); the
default name clients pass as ``model`` is the file's name, or the Hugging Face id.

The routes are described in :mod:`pagedkv.entrypoints.openai.app`; docs/server.md has examples,
and its "Security and limits" section the API key, origin, body and shutdown options
(:mod:`pagedkv.entrypoints.openai.server_options`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import signal
import time
from typing import Any

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.log_setup import LOG_LEVELS, configure_logging
from pagedkv.entrypoints.openai.chat_options import ChatOptions
from pagedkv.entrypoints.openai.metrics import METRICS_PREFIXES
from pagedkv.entrypoints.openai.server_options import ServerOptions
from pagedkv.entrypoints.openai.serving_responses import DEFAULT_RESPONSES_STORE_SIZE
from pagedkv.errors import ConfigError
from pagedkv.pooling_params import DEFAULT_POOLING, POOLING_TYPES

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over the OpenAI API: completions and chat completions with "
        "streaming, /v1/models, /health, /metrics (Prometheus) and, with "
        "--enable-admin-routes, POST /reset_prefix_cache.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as `vllm serve MODEL` (or --model); see --model for what it "
        "may name",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    server.add_argument(
        "--port", type=int, default=8000, help="port to bind; 0 = any free port (default 8000)"
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name(s) clients pass as `model`: each is accepted, the first is reported "
        "(default: MODEL as typed, e.g. `smollm2`, and the model file's name as an alias)",
    )
    server.add_argument(
        "--metrics-prefix",
        default="pagedkv",
        choices=METRICS_PREFIXES,
        help="the /metrics names' prefix: pagedkv (default) or vllm (vLLM's names, so its "
        "Grafana dashboards work unchanged; docs/server.md has the table)",
    )
    server.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        metavar="N",
        help="how many /v1/responses responses are kept in memory (least recently used "
        "dropped first) for previous_response_id and GET /v1/responses/{id} (default "
        f"{DEFAULT_RESPONSES_STORE_SIZE}); 0 keeps none",
    )
    server.add_argument(
        "--pooling",
        default=DEFAULT_POOLING,
        choices=POOLING_TYPES,
        help="how /v1/embeddings pools an input's final hidden states: last (the last token's; "
        "default, as vLLM's for a decoder model), mean (over every token) or cls (the first "
        "token's); L2-normalized unless the request sets normalize false",
    )
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, running / waiting, KV usage, prefix hit rate)",
    )
    server.add_argument(
        "--disable-kv-view",
        action="store_true",
        help="no KV cache view (GET /kv, the live page of the block pool; /kv/state, "
        "/kv/events): they answer 404",
    )
    server.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in a process of its own (vLLM V1's engine core process): the "
        "HTTP and streaming work per token then runs beside the engine's Python instead of "
        "waiting on it (served decode 0.92-0.98x offline in one process on 2 cores, "
        "0.96-1.05x in two, with SmolLM2-135M; about 1.0x both at 1B; docs/perf.md); "
        "start-up takes a second more",
    )
    server.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between two stats lines (default 10, as vLLM)",
    )
    ServerOptions.add_cli_args(
        parser.add_argument_group("security and limits (docs/server.md, Security and limits)")
    )
    ChatOptions.add_cli_args(
        parser.add_argument_group("chat template and tool calling (docs/server.md, Tool calling)")
    )
    cluster = parser.add_argument_group(
        "cluster (Ray Serve replicas; needs pip install 'pagedkv[cluster]', see docs/cluster.md)"
    )
    cluster.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind one endpoint (default 1: one engine, no Ray)",
    )
    cluster.add_argument(
        "--router",
        choices=ROUTERS,
        default=None,
        help="how requests pick a replica: prefix (longest cached prefix, then queue length; "
        "default) or round_robin",
    )
    cluster.add_argument(
        "--hash-seed",
        default=None,
        help="block-hash seed shared by the replicas and the router (default: a random one)",
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of starting one here",
    )
    cluster.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=None,
        help="CPUs Ray reserves for each replica (default 1)",
    )
    cluster.add_argument(
        "--kv-events-host",
        default=None,
        help="address each replica publishes its KV-cache events on (default 127.0.0.1: this "
        "machine only). The events are unauthenticated and carry the token ids of every cached "
        "prompt: open them only on a trusted network. Replicas on other nodes of a multi-node "
        "Ray cluster need it: 0.0.0.0 binds every interface of each replica's node and tells "
        "the router the node's IP (with the default, such a cluster is refused)",
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(func=run)


ROUTERS = ("prefix", "round_robin")
_CLUSTER_ONLY = ("router", "hash_seed", "ray_address", "num_cpus_per_replica", "kv_events_host")


def run(args: argparse.Namespace) -> int:
    """Load the model, bind the socket, print the URL, and serve until interrupted."""
    # Lazy: the engine (torch, the model) and the HTTP stack load only when serving.
    from pagedkv.engine.engine_loop import EngineLoop
    from pagedkv.engine.engine_process import EngineProcessClient
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.entrypoints.openai.app import create_app
    from pagedkv.entrypoints.openai.launch import bind_socket, make_server
    from pagedkv.model.loader import resolve_model

    if args.model_tag is not None and args.model not in (None, args.model_tag):
        raise ConfigError(
            f"the model is given twice, as MODEL ({args.model_tag}) and --model ({args.model}); "
            "give it once"
        )
    args.model = args.model_tag or args.model
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if not args.log_stats_interval > 0:
        raise ConfigError(
            f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}"
        )
    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    options = ServerOptions.from_cli_args(args)  # bad values fail before the model loads
    chat_options = ChatOptions.from_cli_args(args)
    if args.responses_store_size < 0:
        raise ConfigError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    app_options = {
        "chat_options": chat_options,
        "metrics_prefix": args.metrics_prefix,
        "responses_store_size": args.responses_store_size,
        "pooling": args.pooling,
    }
    if args.data_parallel_size > 1 and args.tensor_parallel_size > 1:
        raise ConfigError(
            "--data-parallel-size with --tensor-parallel-size is not supported yet (a Ray "
            "replica does not start tensor-parallel worker processes); use one of them"
        )
    if args.data_parallel_size > 1 and args.engine_process:
        raise ConfigError(
            "--engine-process is for one engine; with --data-parallel-size > 1 every replica "
            "already runs in a process of its own"
        )
    if args.data_parallel_size > 1:
        return run_cluster(args, options, app_options)
    for name in _CLUSTER_ONLY:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} needs --data-parallel-size > 1")
    # Bind first: a busy port should fail in a blink, not after the model has loaded.
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    configure_logging(args.log_level)  # before the engine: its start-up names CPU and backend
    _warn_if_open(args.host, options)
    source = resolve_model(args.model)  # its files, and the name it is served under
    config = dataclasses.replace(EngineConfig.from_cli_args(args), model=str(source.path))
    names = args.served_model_name or list(source.names)
    name = names[0]
    if args.engine_process:
        engine_loop: Any = EngineProcessClient(
            config, setup=functools.partial(configure_logging, args.log_level)
        )
        engine_loop.launch()
        shutdown = engine_loop.stop  # the engine process (and its tensor-parallel workers)
    else:
        engine = LLMEngine(config)
        engine_loop = EngineLoop(engine)
        shutdown = engine.shutdown  # stops tensor-parallel worker processes
    # uvicorn drains on Ctrl-C or SIGTERM (make_server), then re-raises the signal with the
    # handler it found: KeyboardInterrupt for Ctrl-C, _Terminated for SIGTERM (the default
    # action would kill the process before the engine's shutdown). Neither is an error here.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with contextlib.suppress(KeyboardInterrupt, _Terminated):
            app = create_app(
                engine_loop,
                model_name=names,
                kv_view=None if args.disable_kv_view else engine_loop,
                log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                options=options,
                **app_options,
            )
            host, port = sock.getsockname()[:2]
            shown_host = f"[{host}]" if ":" in host else host
            # Scripts (benchmarks/bench_serving.py) read the URL from this line.
            print(f"pagedkv serve: {name} listening on http://{shown_host}:{port}", flush=True)
            server = make_server(
                app, log_level=args.log_level, shutdown_timeout=options.shutdown_timeout
            )
            server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutdown()
    return 0


class _Terminated(Exception):
    """SIGTERM, once the server has drained: the process exits through its cleanup."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _warn_if_open(host: str, options: ServerOptions) -> None:
    """One warning for a server that anyone on the network may use."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not options.api_keys:
        logger.warning(
            "listening on %s without --api-key: anyone who can reach this address can use the "
            "server (docs/server.md, Security and limits)",
            host,
        )


def run_cluster(
    args: argparse.Namespace,
    options: ServerOptions | None = None,
    app_options: dict | None = None,
) -> int:
    """``--data-parallel-size N``: N engine replicas on Ray Serve behind one OpenAI endpoint,
    routed by cached prefix (docs/cluster.md). Serves until interrupted (Ctrl-C or SIGTERM),
    then stops the Serve app and the local Ray: no process of ours or Ray's is left. A local
    Ray listens on 127.0.0.1 (:mod:`pagedkv.entrypoints.cluster.ray_process`).

    Args:
        options: the HTTP layer's security and limits, installed in the ingress's app (its
            ``shutdown_timeout`` does not apply: Ray Serve's proxy serves the HTTP).
        app_options: more keyword arguments of the ingress's ``create_app`` (chat options,
            metrics prefix).

    Raises:
        ConfigError: Ray Serve, pyzmq or msgspec missing (the message names the extra), or a
            bad engine option.
    """
    # Lazy: Ray is the optional [cluster] extra.
    from pagedkv.entrypoints.cluster.ray_process import loopback_ray

    with loopback_ray(args.ray_address):  # from before Ray is imported
        return _serve_cluster(args, options, app_options)


def _serve_cluster(
    args: argparse.Namespace, options: ServerOptions | None, app_options: dict | None
) -> int:
    # Lazy: Ray, msgspec and zmq are the optional [cluster] extra.
    from pagedkv.entrypoints.cluster.ray_process import SigtermAsInterrupt

    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401

        from pagedkv.cluster import ray_serve
        from pagedkv.entrypoints.cluster.ray_ingress import OpenAIIngress
    except ImportError as e:
        raise ConfigError(
            f"--data-parallel-size needs Ray Serve, pyzmq and msgspec ({e.name} is missing): "
            "pip install 'pagedkv[cluster]'"
        ) from None
    from pagedkv.model.loader import resolve_model

    source = resolve_model(args.model)  # its files, and the name it is served under
    config = dataclasses.replace(EngineConfig.from_cli_args(args), model=str(source.path))
    if args.hash_seed is not None:
        config = dataclasses.replace(config, hash_seed=args.hash_seed)
    names = args.served_model_name or list(source.names)
    name = names[0]
    policy = args.router or "prefix"
    configure_logging(args.log_level)
    _warn_if_open(args.host, options or ServerOptions())
    # SIGTERM, as Ctrl-C, unwinds to the finally below: without it the process would end at
    # once and leave Ray's agents running. ray.init installs Ray's own handler: install again.
    with SigtermAsInterrupt() as sigterm, contextlib.suppress(KeyboardInterrupt):
        try:
            ray_serve.init_ray(args.ray_address)
            sigterm.install()
            url = ray_serve.start_cluster(
                config,
                ingress=OpenAIIngress,
                num_replicas=args.data_parallel_size,
                host=args.host,
                port=args.port,
                policy=policy,
                ray_address=args.ray_address,
                num_cpus_per_replica=args.num_cpus_per_replica or 1.0,
                kv_events_host=args.kv_events_host,
                model_name=names,  # handed to the ingress as is: each accepted, the first reported
                ingress_options={"server_options": options, "app_options": app_options},
            )
            print(
                f"pagedkv serve: {name} listening on {url} "
                f"({args.data_parallel_size} replicas, {policy} routing)",
                flush=True,
            )
            while True:
                time.sleep(3600)
        finally:
            ray_serve.stop_cluster()
    return 0
