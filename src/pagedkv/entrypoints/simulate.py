"""`pagedkv simulate`: replay a request trace through the KV cache with a model that costs nothing.

Compares contiguous reservation, paged, and paged + prefix caching on the same trace (same pool
bytes), and with ``--kv-offloading-size`` paged + prefix caching over a KV tier (its capacity and
bandwidth), prints the metrics (or JSON), and with ``--out DIR`` draws the pictures (``--html``
adds one page with all of them). See docs/simulate.md.

    pagedkv simulate --workload shared-prefix --num-requests 500 --out sim-out --html
    pagedkv simulate --workload multi-turn --num-requests 200 --num-blocks 256 \
        --kv-offloading-size 1GiB --time-per-token 0.003
    pagedkv simulate --trace my_trace.jsonl --on-error skip --kv-cache-memory 2GiB --json
    pagedkv simulate --model gemma3-270m --kv-cache-memory 64MiB    (its KV cache groups)
"""

from __future__ import annotations

import argparse
import html
import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from pagedkv.core.config import KVCacheConfig, group_layers
from pagedkv.core.spec import FullAttentionSpec, unify_kv_cache_specs
from pagedkv.entrypoints.openai.kv_view import kv_page_html
from pagedkv.entrypoints.output_paths import check_output_dir
from pagedkv.errors import ConfigError
from pagedkv.sim.preemption import preemption_lines
from pagedkv.sim.workloads import Workload, make_workload, with_samples
from pagedkv.units import parse_memory_size
from pagedkv.validation import check_int

#: Pool size when neither --num-blocks nor --kv-cache-memory is given (nor set by the workload).
DEFAULT_NUM_BLOCKS = 1024
_SETTINGS_DEFAULTS = {
    "block_size": 16,
    "max_model_len": 2048,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 2048,
}
_POLICY_CHOICES = ("contiguous", "paged", "paged+prefix", "paged+prefix+tier")
#: --policies' default; paged+prefix+tier joins it when --kv-offloading-size is given.
_DEFAULT_POLICIES = ("contiguous", "paged", "paged+prefix")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand."""
    parser = subparsers.add_parser(
        "simulate",
        help="trace-driven simulation of KV-cache memory (contiguous vs paged vs prefix caching "
        "vs a KV tier)",
        description=(
            "Replay a built-in workload or a JSONL trace through the KV-cache manager and the "
            "scheduler with a zero-cost model; compare contiguous reservation, paging, and "
            "paging with prefix caching on the same pool bytes."
        ),
    )
    source = parser.add_argument_group("trace")
    which = source.add_mutually_exclusive_group()
    which.add_argument(
        "--workload",
        default=None,
        help="built-in workload: shared-prefix (default: system prompts shared by many requests, "
        "where prefix caching shows), multi-turn, sharegpt, sixteen-lengths",
    )
    which.add_argument("--trace", default=None, help="JSONL trace file (see docs/simulate.md)")
    source.add_argument(
        "--on-error",
        choices=("strict", "skip"),
        default="strict",
        help="malformed trace lines: stop with an error (strict) or report and skip them",
    )
    source.add_argument("--num-requests", type=int, default=1000, help="built-in workloads")
    source.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests (multi-turn: conversations) per second, Poisson; default all at once",
    )
    source.add_argument("--seed", type=int, default=0, help="seed of lengths and token ids")
    source.add_argument(
        "--n",
        type=int,
        default=None,
        help="samples per request (SamplingParams.n) for every request whose n is 1: one "
        "prefill, then the samples fork its blocks; also runs the paged policies without fork "
        "to report the blocks it saves",
    )

    pool = parser.add_argument_group("KV cache")
    size = pool.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None, help="blocks in the pool")
    size.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV-cache bytes (e.g. 512MiB, 2GiB), sized with the model shape below",
    )
    pool.add_argument(
        "--model",
        "-m",
        default=None,
        help="model whose KV cache groups the paged pools hold (as `pagedkv plan` takes it: "
        "gemma3-270m / Gemma-3-270M, a catalog name, a config.json, a .gguf); default one "
        "full-attention group of the shape below",
    )
    pool.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="with --model: hold sliding-window layers as full attention (one group)",
    )
    pool.add_argument(
        "--num-layers", type=int, default=None, help="model shape without --model (SmolLM2: 30)"
    )
    pool.add_argument("--num-kv-heads", type=int, default=None, help="(3)")
    pool.add_argument("--head-size", type=int, default=None, help="(64)")
    pool.add_argument("--kv-dtype", default="bfloat16")
    pool.add_argument("--block-size", type=int, default=None, help="tokens per block (16)")
    pool.add_argument("--max-model-len", type=int, default=None, help="tokens per request (2048)")
    pool.add_argument("--hash-algo", default=None, help="block hash: sha256 (default), xxh3_128")
    pool.add_argument(
        "--kv-offloading-size",
        default=None,
        help="bytes of a KV tier below the pool (e.g. 1GiB): adds the paged+prefix+tier "
        "policy, whose evicted blocks page out there by block hash and hit again",
    )
    pool.add_argument(
        "--kv-offloading-backend",
        choices=("cpu", "disk"),
        default=None,
        help="the tier's medium, for its default bandwidth: cpu (host RAM, 16 GB/s) or disk "
        "(NVMe, 2 GB/s)",
    )
    pool.add_argument(
        "--kv-offloading-bandwidth",
        default=None,
        help="the tier's load bandwidth in bytes/s (e.g. 16GB, 500MB); default the backend's",
    )

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=int, default=None, help="running requests (256)")
    sched.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per step (2048)"
    )
    sched.add_argument(
        "--admission",
        choices=("fcfs", "skip"),
        default="fcfs",
        help="fcfs: stop at the first waiting request that does not fit; skip: try later ones",
    )
    sched.add_argument(
        "--step-time", type=float, default=0.025, help="simulated seconds per step (arrivals)"
    )
    sched.add_argument(
        "--time-per-token",
        type=float,
        default=0.0,
        help="simulated seconds per token computed, added to its step (default 0: a step "
        "costs --step-time whatever it computes); prices recompute against the tier's loads",
    )
    sched.add_argument(
        "--policies",
        default=None,
        help="comma-separated subset of contiguous,paged,paged+prefix,paged+prefix+tier "
        "(default the first three, and paged+prefix+tier with --kv-offloading-size)",
    )

    cluster = parser.add_argument_group(
        "cluster (several replicas, each its own pool of --num-blocks; docs/cluster.md)"
    )
    cluster.add_argument(
        "--num-replicas",
        type=int,
        default=None,
        help="simulate this many replicas behind a router instead of the --policies",
    )
    cluster.add_argument(
        "--routers",
        default=None,
        help="comma-separated subset of prefix,round_robin (default both)",
    )
    cluster.add_argument(
        "--num-prefix-groups",
        type=int,
        default=None,
        help="shared-prefix workload: distinct system prompts (default 4)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        default=None,
        help="directory for the PNG pictures (created; checked before the simulation runs)",
    )
    output.add_argument("--html", action="store_true", help="also write OUT/index.html")
    output.add_argument("--no-sweep", action="store_true", help="skip the block_size sweep picture")
    output.add_argument(
        "--sweep-requests",
        type=int,
        default=300,
        help="requests of the trace replayed in the block_size sweep (first N)",
    )
    output.add_argument(
        "--block-map-columns", type=int, default=300, help="sampled steps in the block map"
    )
    output.add_argument("--json", action="store_true", help="print JSON instead of a table")
    output.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


#: The model shape without --model (SmolLM2-135M's KV heads).
_SHAPE_DEFAULTS = {"num_layers": 30, "num_kv_heads": 3, "head_size": 64}


def layer_specs(args: argparse.Namespace, block_size: int) -> list:
    """Each layer's KV-cache spec: ``--model``'s (sliding-window layers as full attention with
    ``--disable-hybrid-kv-cache-manager``), or ``--num-layers`` full-attention layers of
    ``--num-kv-heads`` x ``--head-size``.

    Raises:
        ConfigError: --model together with the shape flags, an unknown model, bad values.
    """
    shape_flags = [name for name in _SHAPE_DEFAULTS if getattr(args, name) is not None]
    if args.model is not None:
        if shape_flags:
            flags = ", ".join("--" + name.replace("_", "-") for name in shape_flags)
            raise ConfigError(f"--model gives the model's shape; drop {flags}")
        # Lazy (as the simulator's modules below): ~30-70 ms each, only for `pagedkv simulate`.
        from pagedkv.plan.catalog import resolve_model

        specs = list(
            resolve_model(args.model).layer_specs(
                block_size=block_size, kv_cache_dtype=args.kv_dtype
            )
        )
        if args.disable_hybrid_kv_cache_manager:
            specs = unify_kv_cache_specs(specs)
        return specs
    if args.disable_hybrid_kv_cache_manager:
        raise ConfigError("--disable-hybrid-kv-cache-manager needs --model (a hybrid model)")
    shape = {
        name: default if getattr(args, name) is None else getattr(args, name)
        for name, default in _SHAPE_DEFAULTS.items()
    }
    check_int("--num-layers", shape["num_layers"], 1)
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=shape["num_kv_heads"],
        head_size=shape["head_size"],
        dtype=args.kv_dtype,
    )
    return [spec] * shape["num_layers"]


def build(args: argparse.Namespace):
    """Resolve the workload and :class:`SimConfig` from parsed arguments.

    Returns (workload, trace_issues, config, policies).
    """
    from pagedkv.sim.simulator import DEFAULT_KV_OFFLOADING_BANDWIDTH, SimConfig
    from pagedkv.sim.trace import read_trace

    tiered = args.kv_offloading_size is not None
    if args.policies is None:
        policies = _DEFAULT_POLICIES + (("paged+prefix+tier",) if tiered else ())
    else:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in _POLICY_CHOICES]
    if unknown or not policies:
        raise ConfigError(
            f"--policies: unknown {', '.join(unknown) or '(empty)'}; "
            f"choose from {', '.join(_POLICY_CHOICES)}"
        )
    if tiered != ("paged+prefix+tier" in policies):
        raise ConfigError(
            "--policies paged+prefix+tier needs --kv-offloading-size"
            if not tiered
            else "--kv-offloading-size: add paged+prefix+tier to --policies (the tier's policy)"
        )
    for flag in ("kv_offloading_bandwidth", "kv_offloading_backend"):
        if getattr(args, flag) is not None and not tiered:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --kv-offloading-size")
    if tiered and args.num_replicas is not None:
        raise ConfigError(
            "--kv-offloading-size: the cluster simulation (--num-replicas) has no tier"
        )
    max_model_len = args.max_model_len or _SETTINGS_DEFAULTS["max_model_len"]
    issues = []
    if args.trace:
        workload, issues = read_trace(args.trace, on_error=args.on_error, seed=args.seed)
    else:
        name = args.workload or "shared-prefix"
        # A workload's own settings (sixteen-lengths: 128 blocks, max_model_len 512) apply unless
        # the user set them.
        probe = make_workload(name, seed=args.seed, num_requests=1, max_model_len=max_model_len)
        if args.max_model_len is None:
            max_model_len = probe.defaults.get("max_model_len", max_model_len)
        extra = {}
        if args.num_prefix_groups is not None:
            if name != "shared-prefix":
                raise ConfigError("--num-prefix-groups applies to --workload shared-prefix only")
            extra["num_prefix_groups"] = args.num_prefix_groups
        workload = make_workload(
            name,
            seed=args.seed,
            num_requests=args.num_requests,
            max_model_len=max_model_len,
            request_rate=args.request_rate,
            **extra,
        )
    if args.n is not None:
        workload = with_samples(workload, args.n, seed=args.seed)
    defaults = {**_SETTINGS_DEFAULTS, **workload.defaults}
    settings = {
        key: getattr(args, key) if getattr(args, key) is not None else defaults[key]
        for key in _SETTINGS_DEFAULTS
    }
    settings["max_model_len"] = max_model_len
    specs = layer_specs(args, settings["block_size"])
    groups, _ = group_layers(specs)
    kv_cache_specs = None
    if args.model is not None:
        kv_cache_specs = tuple(group.kv_cache_spec for group in groups)
        if len(groups) > 1 and "contiguous" in policies:
            if args.policies is not None:
                raise ConfigError(
                    f"--policies contiguous: {args.model} has {len(groups)} KV cache groups; "
                    "the contiguous baseline reserves one full-attention region (compare with "
                    "--disable-hybrid-kv-cache-manager instead)"
                )
            policies = tuple(p for p in policies if p != "contiguous")
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    elif args.kv_cache_memory is not None:
        num_blocks = KVCacheConfig.from_kv_cache_memory(
            specs,
            parse_memory_size(args.kv_cache_memory),
            max_model_len=max_model_len,
            max_num_batched_tokens=settings["max_num_batched_tokens"],
        ).num_blocks
    else:
        num_blocks = workload.defaults.get("num_blocks", DEFAULT_NUM_BLOCKS)
    tier_blocks = 0
    bytes_per_block = KVCacheConfig.from_num_blocks(specs, 2).bytes_per_block
    bandwidth = DEFAULT_KV_OFFLOADING_BANDWIDTH[args.kv_offloading_backend or "cpu"]
    if args.kv_offloading_size is not None:
        if args.kv_offloading_bandwidth is not None:
            bandwidth = parse_memory_size(args.kv_offloading_bandwidth)
            if bandwidth < 1:
                raise ConfigError(
                    f"--kv-offloading-bandwidth must be > 0 bytes/s, got "
                    f"{args.kv_offloading_bandwidth!r}"
                )
        tier_bytes = parse_memory_size(args.kv_offloading_size)
        tier_blocks = tier_bytes // bytes_per_block
        if tier_blocks < 1:
            raise ConfigError(
                f"--kv-offloading-size {args.kv_offloading_size} holds no KV block "
                f"({bytes_per_block} bytes each)"
            )
    config = SimConfig(
        num_blocks=num_blocks,
        kv_offloading_blocks=tier_blocks,
        kv_offloading_bandwidth=bandwidth,
        kv_bytes_per_block=bytes_per_block,
        admission=args.admission,
        step_time=args.step_time,
        time_per_token=args.time_per_token,
        block_map_columns=args.block_map_columns if args.out else 0,
        hash_algo=args.hash_algo,
        kv_cache_specs=kv_cache_specs,
        **settings,
    )
    return workload, issues, config, policies


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv simulate`."""
    from pagedkv.sim.simulator import (
        fork_saving_lines,
        simulate,
        simulate_fork_baselines,
        sweep_block_sizes,
    )

    if args.html and not args.out:
        raise ConfigError("--html needs --out DIR (the page is written as DIR/index.html)")
    if args.out:
        check_output_dir(args.out, "--out")  # before the work, not after it
    if args.routers is not None and args.num_replicas is None:
        raise ConfigError("--routers needs --num-replicas")
    workload, issues, config, policies = build(args)
    for issue in issues:
        print(f"pagedkv simulate: skipped {args.trace} {issue}", file=sys.stderr)
    if args.num_replicas is not None:
        return run_cluster(args, workload, config)

    # The report's replay in the /kv page's view: the caching policy if it ran, else the first
    # paged one.
    paged = [p for p in policies if p != "contiguous"]
    replayed = "paged+prefix" if "paged+prefix" in paged else (paged[0] if paged else None)
    show_progress = not args.quiet and sys.stderr.isatty()
    num_rows = len(workload.requests) * len(policies)
    results = {}
    with tqdm(total=num_rows, disable=not show_progress, unit="req", desc="simulate") as bar:
        for policy in policies:
            bar.set_postfix_str(policy)
            results[policy] = simulate(
                workload,
                config,
                policy,
                on_finish=bar.update,
                kv_snapshots=KV_REPLAY_SNAPSHOTS if args.html and policy == replayed else 0,
            )
    # n > 1: the paged policies again, every sample its own request (what fork saves against).
    fork_baselines = simulate_fork_baselines(workload, config, policies)
    fork_lines = fork_saving_lines(results, fork_baselines)
    why_preempted = preemption_lines(
        {p: r.preemptions for p, r in results.items() if r.preemptions is not None},
        config.block_size,
    )

    sweep = None
    if args.out and not args.no_sweep:
        sub = Workload(workload.name, _prefix_closed(workload.requests, args.sweep_requests))
        sweep = sweep_block_sizes(sub, config, policies=policies)

    from pagedkv.sim.simulator import config_lines

    summary = config_lines(config, workload.name, len(workload.requests), args.model)
    figure_paths = []
    write_error = None
    if args.out:
        # Lazy: matplotlib, only when figures are written.
        from pagedkv.sim.plots import save_figures, write_html

        # A failed write (disk full, folder removed meanwhile) must not lose the results: they
        # are printed below whatever happens here, then the error in one line.
        try:
            figure_paths = save_figures(results, args.out, sweep)
            if args.html:
                command = ""
                if sys.argv[1:2] == ["simulate"]:
                    command = "pagedkv simulate " + shlex.join(sys.argv[2:])
                figure_paths.append(
                    write_html(
                        f"{args.out}/index.html",
                        [p for p in figure_paths if p.suffix == ".png"],
                        {p: r.metrics for p, r in results.items()},
                        title=f"pagedkv simulate: {workload.name}",
                        command=command,
                        config=summary,
                        notes=fork_lines,
                        preemptions=why_preempted,
                    )
                )
                if replayed is not None and results[replayed].kv_snapshots:
                    figure_paths.append(
                        write_kv_replay(
                            f"{args.out}/kv_replay.html",
                            results[replayed].kv_snapshots,
                            f"pagedkv simulate: {workload.name}, {replayed}",
                        )
                    )
        except OSError as exc:
            write_error = f"--out {args.out}: cannot write the pictures: {exc.strerror or exc}"

    if args.json:
        report = {
            "workload": workload.name,
            "num_requests": len(workload.requests),
            "num_sequences": sum(r.n for r in workload.requests),
            "seed": args.seed,
            "config": {
                name: getattr(config, name)
                for name in (
                    "num_blocks",
                    "block_size",
                    "max_model_len",
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "admission",
                    "step_time",
                    "time_per_token",
                    "kv_offloading_blocks",
                    "kv_offloading_bandwidth",
                    "kv_bytes_per_block",
                )
            },
            "model": args.model,
            "kv_cache_groups": (
                None
                if config.kv_cache_specs is None
                else [getattr(spec, "sliding_window", None) for spec in config.kv_cache_specs]
            ),
            "policies": {p: r.metrics.to_dict() for p, r in results.items()},
            "fork_baseline": {p: m.to_dict() for p, m in fork_baselines.items()},
            "preemptions": {
                p: asdict(r.preemptions) for p, r in results.items() if r.preemptions is not None
            },
            "trace_issues": [{"line": i.line_no, "message": i.message} for i in issues],
            "rejected": {p: r.rejected for p, r in results.items() if r.rejected},
            "files": [str(p) for p in figure_paths],
        }
        if sweep is not None:
            report["block_size_sweep"] = {
                policy: {str(bs): m.to_dict() for bs, m in by_size.items()}
                for policy, by_size in sweep.items()
            }
        json.dump(report, sys.stdout, indent=2)
        print()
        return _report_write_error(write_error)

    from pagedkv.sim.plots import metrics_table_rows

    for line in summary:
        print(line)
    _print_table(metrics_table_rows({p: r.metrics for p, r in results.items()}))
    for line in fork_lines + why_preempted:
        print(line)
    for path in figure_paths:
        print(f"wrote {path}")
    return _report_write_error(write_error)


#: Snapshots the HTML report's replay keeps (spread over the run; see ``simulate``).
KV_REPLAY_SNAPSHOTS = 300


def write_kv_replay(path: str | Path, snapshots: list[dict], title: str) -> Path:
    """Write the /kv page with ``snapshots`` embedded (a time slider replays them; no server).

    Raises:
        OSError: the page cannot be written.
    """
    # "</" could end the script element early: JSON allows "<\/" for it.
    data = json.dumps(snapshots, separators=(",", ":")).replace("</", "<\\/")
    page = kv_page_html().replace(
        "<script>\n",
        f'<script id="kv-replay" type="application/json">{data}</script>\n<script>\n',
        1,
    )
    page = page.replace("<title>pagedkv: KV cache</title>", f"<title>{html.escape(title)}</title>")
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


def _report_write_error(message: str | None) -> int:
    """0, or 2 after printing ``message`` (the results were printed already)."""
    if message is None:
        return 0
    print(f"pagedkv simulate: error: {message}", file=sys.stderr)
    return 2


def run_cluster(args: argparse.Namespace, workload, config) -> int:
    """``--num-replicas N``: the trace over N replicas (each its own pool), once per router."""
    from pagedkv.sim.cluster import ROUTERS, simulate_cluster

    if args.out:
        raise ConfigError("--out draws the single-pool policies; not with --num-replicas")
    routers = tuple(r.strip() for r in (args.routers or ",".join(ROUTERS)).split(",") if r)
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or not routers:
        raise ConfigError(
            f"--routers: unknown {', '.join(unknown) or '(empty)'}; choose from "
            f"{', '.join(ROUTERS)}"
        )
    show_progress = not args.quiet and sys.stderr.isatty()
    results = {}
    with tqdm(
        total=len(workload.requests) * len(routers),
        disable=not show_progress,
        unit="req",
        desc="simulate",
    ) as bar:
        for router in routers:
            bar.set_postfix_str(router)
            results[router] = simulate_cluster(
                workload,
                config,
                num_replicas=args.num_replicas,
                router=router,
                on_finish=bar.update,
            )
    if args.json:
        json.dump(
            {
                "workload": workload.name,
                "num_requests": len(workload.requests),
                "seed": args.seed,
                "num_replicas": args.num_replicas,
                "num_blocks_per_replica": config.num_blocks,
                "routers": {r: m.to_dict() for r, m in results.items()},
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    print(
        f"workload {workload.name}: {len(workload.requests)} requests over {args.num_replicas} "
        f"replicas of {config.num_blocks} blocks of {config.block_size} tokens, max_num_seqs "
        f"{config.max_num_seqs}, max_num_batched_tokens {config.max_num_batched_tokens}"
    )
    rows = [
        [
            "router",
            "hit rate",
            "prefill tokens",
            "steps",
            "mean latency (s)",
            "p90 (s)",
            "preempt",
            "max share",
        ]
    ]
    for router, m in results.items():
        rows.append(
            [
                router,
                f"{m.prefix_hit_rate:.1%}",
                str(m.num_computed_prompt_tokens),
                str(m.num_steps),
                f"{m.mean_latency_s:.2f}",
                f"{m.p90_latency_s:.2f}",
                str(m.num_preemptions),
                f"{m.max_replica_share:.2f}",
            ]
        )
    _print_table(rows)
    return 0


def _prefix_closed(requests: list, limit: int) -> list:
    """The first ``limit`` requests, with follow-up turns whose parent was cut dropped (and the
    parent indices renumbered)."""
    kept: dict[int, int] = {}
    out = []
    for index, request in enumerate(requests[: max(1, limit)]):
        if request.parent_index is not None and request.parent_index not in kept:
            continue
        kept[index] = len(out)
        if request.parent_index is not None:
            request = replace(request, parent_index=kept[request.parent_index])
        out.append(request)
    return out
