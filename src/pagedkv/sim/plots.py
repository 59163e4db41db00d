"""The simulator's pictures (matplotlib, PNG) and an HTML page with the same figures embedded.

Figures are built on :class:`matplotlib.figure.Figure` objects, never pyplot, so nothing global is
touched (no backend switch, no open-figure registry); PNGs are rendered by Agg.

- ``kv_blocks.png``: KV blocks reserved over time per policy (solid) and the blocks' worth of
  tokens actually held (dashed); the gap is waste.
- ``running_waiting.png``: running and waiting requests over time, one panel per policy.
- ``block_map_<policy>.png``: physical blocks x sampled steps, coloured by owning request; shared
  blocks (ref_cnt > 1) black, cached free blocks grey, free blocks white.
- ``block_size_sweep.png``: throughput proxy (output tokens per step) and waste % vs block_size.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pagedkv.sim.blockmap import CACHED_FREE, FREE, NULL_BLOCK, BlockMap
from pagedkv.sim.metrics import PolicyMetrics
from pagedkv.sim.simulator import PolicyResult

_POLICY_COLORS = {"contiguous": "tab:red", "paged": "tab:blue", "paged+prefix": "tab:green"}


def _color(policy: str) -> str:
    return _POLICY_COLORS.get(policy, "tab:purple")


def fig_kv_blocks(results: dict[str, PolicyResult]) -> Figure:
    """KV blocks reserved (solid) and blocks' worth of real tokens (dashed) per step, per policy."""
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    pool_blocks = None
    for policy, result in results.items():
        t = result.timeline
        block_size = result.config.block_size
        ax.step(
            t.step,
            t.num_reserved_tokens / block_size,
            where="post",
            color=_color(policy),
            label=f"{policy}: reserved",
        )
        ax.step(
            t.step,
            t.num_real_tokens / block_size,
            where="post",
            color=_color(policy),
            linestyle="--",
            linewidth=0.9,
            label=f"{policy}: holding tokens",
        )
        pool_blocks = result.config.num_blocks - 1
    if pool_blocks is not None:
        ax.axhline(pool_blocks, color="black", linewidth=0.8, linestyle=":", label="usable pool")
    ax.set_xlabel("step")
    ax.set_ylabel("KV blocks")
    ax.set_title("KV blocks in use over time")
    ax.legend(fontsize="small", ncols=2)
    return fig


def fig_running_waiting(results: dict[str, PolicyResult]) -> Figure:
    """Running and waiting requests per step, one panel per policy (shared axes)."""
    fig = Figure(figsize=(9, 2.2 * max(1, len(results)) + 0.6), layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (policy, result) in zip(axes, results.items(), strict=True):
        t = result.timeline
        ax.step(t.step, t.num_running, where="post", color=_color(policy), label="running")
        ax.step(t.step, t.num_waiting, where="post", color="gray", label="waiting")
        ax.set_title(
            f"{policy}: peak {result.metrics.peak_concurrency} running, "
            f"{result.metrics.num_steps} steps to drain",
            fontsize="medium",
        )
        ax.set_ylabel("requests")
        ax.legend(fontsize="small", loc="upper right")
    axes[-1].set_xlabel("step")
    return fig


def block_map_image(block_map: BlockMap) -> np.ndarray:
    """RGB image ``[num_blocks, num_columns, 3]`` float of a block map (row 0 = block 0)."""
    owners = block_map.owners
    palette = np.asarray(ListedColormap(_owner_palette()).colors)[:, :3]
    image = palette[np.maximum(owners, 0) % len(palette)]
    image[owners == FREE] = (1.0, 1.0, 1.0)
    image[owners == CACHED_FREE] = (0.78, 0.78, 0.78)
    image[owners == NULL_BLOCK] = (0.35, 0.35, 0.35)
    image[block_map.shared] = (0.0, 0.0, 0.0)
    return image


def _owner_palette() -> list:
    from matplotlib import colormaps

    # tab20 without its greys (grey means free/cached here).
    colors = list(colormaps["tab20"].colors)
    return [c for i, c in enumerate(colors) if i not in (14, 15)]


def fig_block_map(result: PolicyResult) -> Figure | None:
    """Physical blocks x sampled steps for one paged policy; None without a block map."""
    block_map = result.block_map
    if block_map is None:
        return None
    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.add_subplot()
    steps = block_map.steps
    last = steps[-1] + block_map.stride
    ax.imshow(
        block_map_image(block_map),
        aspect="auto",
        interpolation="nearest",
        origin="lower",
        extent=(steps[0], last, -0.5, block_map.owners.shape[0] - 0.5),
    )
    ax.set_xlabel(f"step (sampled every {block_map.stride})")
    ax.set_ylabel("physical block id")
    ax.set_title(f"Block map, {result.policy}: colour = owning request")
    ax.legend(
        handles=[
            Patch(facecolor="black", label="shared (ref_cnt > 1)"),
            Patch(facecolor=(0.78, 0.78, 0.78), label="free, still cached"),
            Patch(facecolor="white", edgecolor="0.6", label="free"),
            Patch(facecolor=(0.35, 0.35, 0.35), label="null block"),
        ],
        loc="upper right",
        fontsize="small",
        framealpha=0.9,
    )
    return fig


def fig_block_size_sweep(sweep: dict[str, dict[int, PolicyMetrics]]) -> Figure:
    """Output tokens per step and waste % vs block_size, one line per policy (the contiguous
    baseline keeps the same pool bytes, so it barely moves)."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_tput, ax_waste = fig.subplots(1, 2)
    for policy, by_size in sweep.items():
        sizes = sorted(by_size)
        style = {"color": _color(policy), "label": policy, "marker": "o"}
        if policy == "contiguous":
            style["linestyle"] = "--"
        ax_tput.plot(sizes, [by_size[s].output_tokens_per_step for s in sizes], **style)
        ax_waste.plot(sizes, [by_size[s].waste_pct for s in sizes], **style)
    for ax in (ax_tput, ax_waste):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block_size (tokens)")
        ax.legend(fontsize="small")
    ax_tput.set_ylabel("output tokens per step")
    ax_tput.set_title("Throughput proxy vs block_size")
    ax_waste.set_ylabel("waste (% of reserved KV)")
    ax_waste.set_title("Internal fragmentation vs block_size")
    return fig


def save_figures(
    results: dict[str, PolicyResult],
    out_dir: str | Path,
    sweep: dict[str, dict[int, PolicyMetrics]] | None = None,
    *,
    dpi: int = 110,
) -> list[Path]:
    """Write every figure as PNG into ``out_dir`` (created); returns the paths in order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, Figure | None]] = [
        ("kv_blocks.png", fig_kv_blocks(results)),
        ("running_waiting.png", fig_running_waiting(results)),
    ]
    for policy, result in results.items():
        name = policy.replace("+", "_")
        figures.append((f"block_map_{name}.png", fig_block_map(result)))
    if sweep:
        figures.append(("block_size_sweep.png", fig_block_size_sweep(sweep)))
    paths = []
    for name, fig in figures:
        if fig is None:
            continue
        path = out_dir / name
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths


_METRIC_LABELS = (
    ("peak_concurrency", "peak concurrency", "{:d}"),
    ("mean_concurrency", "mean concurrency", "{:.1f}"),
    ("kv_utilization", "KV utilization", "{:.1%}"),
    ("waste_pct", "waste %", "{:.1f}"),
    ("peak_kv_usage", "peak KV usage", "{:.1%}"),
    ("num_preemptions", "preemptions", "{:d}"),
    ("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
    ("num_steps", "steps to drain", "{:d}"),
    ("tokens_per_step", "tokens per step", "{:.1f}"),
    ("output_tokens_per_step", "output tokens per step", "{:.2f}"),
    ("num_rejected", "rejected requests", "{:d}"),
)


def metrics_table_rows(metrics: dict[str, PolicyMetrics]) -> list[list[str]]:
    """Rows [label, value per policy] of the summary table (also used for the terminal)."""
    rows = [["metric", *metrics]]
    for field, label, fmt in _METRIC_LABELS:
        rows.append([label, *(fmt.format(getattr(m, field)) for m in metrics.values())])
    return rows


def write_html(
    path: str | Path,
    figure_paths: list[Path],
    metrics: dict[str, PolicyMetrics],
    *,
    title: str = "pagedkv simulate",
    command: str = "",
) -> Path:
    """Write one self-contained HTML page: the metrics table and every PNG embedded (base64)."""
    path = Path(path)
    rows = metrics_table_rows(metrics)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:]
    )
    images = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(p.name)}'
        "</figcaption></figure>"
        for p in figure_paths
    )
    command_html = f"<p><code>{html.escape(command)}</code></p>" if command else ""
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;max-width:1000px;margin:auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}img{max-width:100%}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{command_html}<table><tr>{head}</tr>{body}</table>"
        f"{images}</body></html>",
        encoding="utf-8",
    )
    return path
