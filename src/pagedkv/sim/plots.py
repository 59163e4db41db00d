"""The simulator's pictures (matplotlib, PNG) and an HTML page with the same figures embedded
(Jinja2, the template ``templates/simulate_report.html.j2`` beside this module).

Figures are built on :class:`matplotlib.figure.Figure` objects, never pyplot, so nothing global is
touched (no backend switch, no open-figure registry); PNGs are rendered by Agg.

- ``kv_blocks.png``: KV blocks reserved per step against the usable pool, one panel per policy
  (paged and paged+prefix both sit at the pool's ceiling: on one axis they would hide each
  other), with each policy's preemptions so far on a shared right axis; and the reserved blocks
  holding no token, the waste, every policy on one log axis (bottom).
- ``running_waiting.png``: running and waiting requests over time, one panel per policy.
- ``block_map_<policy>.png``: physical blocks x sampled steps, coloured by owning request; blocks
  shared by several requests (ref_cnt > 1) cross-hatched over their oldest holder's colour (with
  a side panel of how many requests hold each block), blocks shared only by the samples of one
  request (n > 1, a fork) hatched over that request's colour, cached free blocks grey, free
  blocks white, the null block dark grey, the unwritten part of contiguous regions in a light
  shade of their owner; each legend entry is there only when the drawn map has such blocks. At
  scale
  (more than 64 blocks or 120 samples, paged policies) a window of blocks 0-63 over steps from
  the middle of the run, under a panel counting every block's state over the whole run.
- ``prompt_tokens.png`` (a policy with prefix caching): each policy's prompt tokens from pool
  hits, tier hits and computed (the recomputed part hatched), and its time to drain: steps,
  compute (``time_per_token``) and the KV tier's loads.
- ``block_size_sweep.png``: throughput proxy (output tokens per step) and waste % vs block_size.

Every policy has its own line style and marker, so policies that coincide (paged and paged+prefix
on a trace without shared prefixes) both stay visible where they share an axis. Counts get
integer ticks and y axes from 0; a step lasts until the next one, and the last step is drawn one
step wide.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from pagedkv.sim.blockmap import CACHED_FREE, FREE, NULL_BLOCK, BlockMap
from pagedkv.sim.metrics import PolicyMetrics
from pagedkv.sim.simulator import PolicyResult

_POLICY_STYLES = MappingProxyType(
    {
        "contiguous": {"color": "tab:red", "linestyle": "-", "marker": "s", "linewidth": 1.6},
        # Drawn wide and translucent, so paged+prefix's dashes show on top when they coincide.
        "paged": {
            "color": "tab:blue",
            "linestyle": "-",
            "marker": "o",
            "linewidth": 4.0,
            "alpha": 0.45,
        },
        "paged+prefix": {
            "color": "tab:green",
            "linestyle": (0, (5, 2)),
            "marker": "x",
            "linewidth": 1.6,
            "markersize": 7,
        },
        "paged+prefix+tier": {
            "color": "tab:orange",
            "linestyle": (0, (1, 1.5)),
            "marker": "D",
            "linewidth": 1.8,
            "markersize": 5,
        },
    }
)
_OTHER_STYLE = MappingProxyType({"color": "tab:purple", "linestyle": ":", "marker": "^"})
#: Blocks shared by several requests: cross-hatched in black over the oldest holder's colour
#: (ownership stays visible: a system prompt's blocks keep the colour of whoever holds them
#: longest, and change colour when that request finishes and the block lives on).
_SHARED_HATCH = "xx"
#: Blocks shared by the samples of one request: hatched in black over the request's colour.
_SAMPLES_HATCH = "////"
_CACHED_RGB = (0.78, 0.78, 0.78)
_FREE_RGB = (1.0, 1.0, 1.0)
_NULL_RGB = (0.35, 0.35, 0.35)
#: How much of the owner's colour an unwritten (reserved, no token) block keeps.
_UNUSED_TINT = 0.3
#: The block map's legend entry for blocks shared by several requests.
SHARED_LABEL = "shared by requests (ref_cnt > 1),\ncolour = the oldest holder"
_MARKERS_PER_LINE = 8
#: Paged block maps with more blocks or samples than this show a window of blocks and steps ...
BLOCK_MAP_MAX_ROWS = 160
BLOCK_MAP_MAX_COLUMNS = 150
#: ... of this many blocks (from block 0, the null block) and samples (from mid-run).
BLOCK_MAP_WINDOW_ROWS = 64
BLOCK_MAP_WINDOW_COLUMNS = 120


def _style(policy: str) -> dict:
    return dict(_POLICY_STYLES.get(policy, _OTHER_STYLE))


def _color(policy: str) -> str:
    return _style(policy)["color"]


def step_series(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` for ``ax.step(x, y, where="post")`` from per-busy-step values.

    Idle steps between two busy ones (the clock jumped to the next arrival) are drawn at 0, and
    the last busy step is drawn one step wide (it lasts until ``steps[-1] + 1``).
    """
    steps = np.asarray(steps, dtype=np.int64)
    values = np.asarray(values, dtype=float)
    if len(steps) == 0:
        return steps, values
    gaps = np.nonzero(np.diff(steps) > 1)[0] + 1
    x = np.insert(steps, gaps, steps[gaps - 1] + 1)
    y = np.insert(values, gaps, 0.0)
    return np.append(x, steps[-1] + 1), np.append(y, values[-1])


def _markevery(num_points: int, index: int) -> list[int]:
    """A few marker positions per line (never the end point that only gives the last step its
    width), offset per policy so coinciding lines show distinct markers."""
    every = max(1, num_points // _MARKERS_PER_LINE)
    return list(range((index * every // 3) % every, max(num_points - 1, 1), every))


def _count_axis(ax, axis: str = "y") -> None:
    """Integer ticks from 0 for a count."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(MaxNLocator(integer=True))
    if axis == "y":
        ax.set_ylim(bottom=0)
    else:
        ax.set_xlim(left=0)


def _legend_outside(ax, **kwargs) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kwargs)


def fig_kv_blocks(results: dict[str, PolicyResult]) -> Figure:
    """KV blocks reserved per step, one panel per policy (shared axes, the usable pool dotted),
    with the policy's preemptions so far on a right axis shared by the panels; last panel: the
    reserved blocks holding no token (reserved minus the blocks' worth of written tokens), the
    waste, every policy on one axis.

    A panel per policy, because paged and paged+prefix both sit at the pool's ceiling while the
    pool is full: on one axis their lines would lie on top of each other."""
    num_policies = len(results)
    fig = Figure(figsize=(10, 1.9 * num_policies + 2.4), layout="constrained")
    axes = fig.subplots(
        num_policies + 1, 1, sharex=True, height_ratios=(*[1.0] * num_policies, 1.3)
    )
    ax_waste = axes[-1]
    pool_style = {"color": "black", "linewidth": 1.2, "linestyle": ":"}
    preempt_style = {"color": "0.15", "linewidth": 1.3, "drawstyle": "steps-post"}
    top_preemptions = max(int(r.timeline.num_preemptions.sum()) for r in results.values())
    pool_blocks = 1
    for index, (ax, (policy, result)) in enumerate(zip(axes, results.items(), strict=False)):
        t = result.timeline
        block_size = result.config.block_size
        pool_blocks = result.config.num_blocks - 1
        style = _style(policy)
        reserved = np.asarray(t.num_reserved_tokens) / block_size
        waste = (np.asarray(t.num_reserved_tokens) - np.asarray(t.num_real_tokens)) / block_size
        x, y = step_series(t.step, reserved)
        ax.fill_between(x, y, step="post", color=style["color"], alpha=0.25, linewidth=0)
        ax.step(x, y, where="post", color=style["color"], linewidth=1.4, label=policy)
        ax.axhline(pool_blocks, zorder=5, **pool_style)
        x, y = step_series(t.step, waste)
        ax_waste.step(
            x, y, where="post", markevery=_markevery(len(x), index), label=policy, **style
        )
        m = result.metrics
        handles = [
            Patch(facecolor=style["color"], alpha=0.5, label=f"{policy}: blocks reserved"),
            Line2D([], [], label=f"usable pool ({pool_blocks} blocks)", **pool_style),
        ]
        if top_preemptions:
            ax_preempt = ax.twinx()
            steps, counts = step_series(t.step, np.cumsum(t.num_preemptions))
            ax_preempt.plot(steps, counts, **preempt_style)
            ax_preempt.set_ylim(0, top_preemptions * 1.1)
            ax_preempt.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
            ax_preempt.set_ylabel("preemptions", fontsize="small")
            if m.num_preemptions:
                handles.append(
                    Line2D([], [], label="preemptions so far (right axis)", **preempt_style)
                )
        ax.set_title(
            f"{policy}: {m.num_preemptions} preemptions, peak {m.peak_concurrency} running, "
            f"drained in {m.num_steps} steps",
            fontsize="medium",
            loc="left",
        )
        ax.set_ylabel("KV blocks")
        _count_axis(ax)
        ax.set_ylim(top=max(pool_blocks, 1) * 1.1)
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.09 if top_preemptions else 1.01, 1.0),
            borderaxespad=0,
            fontsize="small",
        )
    fig.suptitle("KV blocks in use over time (same usable pool for every policy)")
    ax_waste.legend(
        loc="upper left",
        bbox_to_anchor=(1.09 if top_preemptions else 1.01, 1.0),
        borderaxespad=0,
        fontsize="small",
    )
    ax_waste.set_ylabel("reserved, no token\n(blocks' worth, log)")
    ax_waste.set_title(
        "Waste: reserved KV holding no token, every policy (log scale: paged's few blocks and "
        "contiguous's hundreds both show)",
        fontsize="medium",
        loc="left",
    )
    ax_waste.set_xlabel("step")
    # symlog: linear below 1 block, so idle steps (0) stay drawn at the axis' bottom.
    ax_waste.set_yscale("symlog", linthresh=1.0)
    top_waste = max(1.0, *(float(np.max(line.get_ydata(), initial=0)) for line in ax_waste.lines))
    ticks = [0, *(10**k for k in range(int(np.ceil(np.log10(top_waste))) + 1))]
    ax_waste.set_yticks(ticks, [str(t) for t in ticks])
    ax_waste.set_ylim(0, ticks[-1])
    for ax in axes:
        _count_axis(ax, "x")
    return fig


def fig_running_waiting(results: dict[str, PolicyResult]) -> Figure:
    """Running and waiting requests per step, one panel per policy, axes shared by the panels so
    heights compare across policies. When the queue is more than 3x the running peak, waiting
    gets its own axis on the right (else the running lines would lie flat at the bottom)."""
    fig = Figure(figsize=(10, 2.2 * max(1, len(results)) + 0.6), layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    peaks = [(int(np.max(r.timeline.num_running, initial=0)), int(np.max(r.timeline.num_waiting,
             initial=0))) for r in results.values()]  # fmt: skip
    top_running = max(1, *(running for running, _ in peaks))
    top_waiting = max(1, *(waiting for _, waiting in peaks))
    twin = top_waiting > 3 * top_running
    if not twin:
        top_running = top_waiting = max(top_running, top_waiting)
    waiting_style = {"color": "0.45", "linestyle": (0, (4, 2)), "linewidth": 1.2}
    for ax, (policy, result) in zip(axes, results.items(), strict=True):
        t = result.timeline
        x, running = step_series(t.step, t.num_running)
        _, waiting = step_series(t.step, t.num_waiting)
        ax_waiting = ax.twinx() if twin else ax
        ax_waiting.step(x, waiting, where="post", **waiting_style)
        ax.step(x, running, where="post", color=_color(policy), linewidth=1.8, zorder=3)
        if twin:
            ax.set_zorder(ax_waiting.get_zorder() + 1)  # running drawn over waiting
            ax.patch.set_visible(False)
            ax.set_ylabel("running", color=_color(policy))
            ax_waiting.set_ylabel("waiting", color="0.35")
        else:
            ax.set_ylabel("requests")
        ax.set_title(
            f"{policy}: peak {result.metrics.peak_concurrency} running, "
            f"{result.metrics.num_steps} steps to drain",
            fontsize="medium",
        )
        for axis, top in ((ax, top_running), (ax_waiting, top_waiting)):
            _count_axis(axis)
            axis.set_ylim(top=top * 1.08)
        _count_axis(ax, "x")
        ax.legend(
            [
                Line2D([], [], color=_color(policy), linewidth=1.8),
                Line2D([], [], **waiting_style),
            ],
            ["running (left axis)", "waiting, queued (right axis)"]
            if twin
            else ["running", "waiting (queued)"],
            loc="upper left",
            bbox_to_anchor=(1.08 if twin else 1.01, 1.0),
            borderaxespad=0,
            fontsize="small",
        )
    axes[-1].set_xlabel("step")
    return fig


def _owner_palette() -> list:
    from matplotlib import colormaps

    # tab20 without its greys (grey means free/cached here).
    colors = list(colormaps["tab20"].colors)
    return [c for i, c in enumerate(colors) if i not in (14, 15)]


def block_map_image(block_map: BlockMap) -> np.ndarray:
    """RGB image ``[num_blocks, num_columns, 3]`` float of a block map (row 0 = block 0)."""
    owners = block_map.owners
    palette = np.asarray(ListedColormap(_owner_palette()).colors)[:, :3]
    image = palette[np.maximum(owners, 0) % len(palette)]
    if block_map.unused is not None:
        unused = block_map.unused
        image[unused] = _UNUSED_TINT * image[unused] + (1.0 - _UNUSED_TINT)
    image[owners == FREE] = _FREE_RGB
    image[owners == CACHED_FREE] = _CACHED_RGB
    image[owners == NULL_BLOCK] = _NULL_RGB
    # Shared blocks keep their (oldest) owner's colour: _draw_map hatches over them, crossed
    # when several requests share them, slanted when one request's samples do.
    return image


def _shared_by_samples(block_map: BlockMap) -> np.ndarray:
    """Blocks shared only by the samples of one request (a fork), bool like ``shared``."""
    if block_map.shared_by_samples is None:
        return np.zeros_like(block_map.shared)
    return block_map.shared_by_samples


def _shared_by_requests(block_map: BlockMap) -> np.ndarray:
    """Blocks shared by two requests or more (ref_cnt > 1 across requests)."""
    return block_map.shared & ~_shared_by_samples(block_map)


def _block_map_legend(
    ax, block_map: BlockMap, rows: slice | None = None, cols: slice | None = None
) -> None:
    """The map's legend; the shared and unused entries only when the drawn part has some."""
    window = (slice(None) if rows is None else rows, slice(None) if cols is None else cols)
    palette = _owner_palette()
    owners = block_map.owners[window]
    handles = []
    if (owners >= 0).any():
        handles.append(Patch(facecolor=palette[0], label="held by a request (colour = request)"))
    if block_map.unused is not None and block_map.unused[window].any():
        tint = _UNUSED_TINT * np.asarray(palette[0]) + (1.0 - _UNUSED_TINT)
        handles.append(Patch(facecolor=tint, label="reserved, no token yet (waste)"))
    if _shared_by_samples(block_map)[window].any():
        handles.append(
            Patch(
                facecolor=palette[0],
                edgecolor="black",
                hatch=_SAMPLES_HATCH,
                label="shared by the samples of one request\n(n > 1, forked; ref_cnt > 1)",
            )
        )
    if _shared_by_requests(block_map)[window].any():
        handles.append(
            Patch(
                facecolor=palette[0],
                edgecolor="black",
                hatch=_SHARED_HATCH,
                label=SHARED_LABEL,
            )
        )
    for code, patch in (
        (CACHED_FREE, Patch(facecolor=_CACHED_RGB, label="free, still cached")),
        (FREE, Patch(facecolor=_FREE_RGB, edgecolor="0.6", label="free")),
        (NULL_BLOCK, Patch(facecolor=_NULL_RGB, label="null block (block 0)")),
    ):
        if (owners == code).any():
            handles.append(patch)
    _legend_outside(ax, handles=handles, fontsize="small")


def block_map_legend_labels(fig: Figure) -> list[str]:
    """The labels of every legend of ``fig`` (what a reader is told to look for)."""
    labels = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            labels += [text.get_text() for text in legend.get_texts()]
    return labels


def _hatch_cells(
    ax, mask: np.ndarray, x_edges: np.ndarray, first_row: int, hatch: str
) -> PolyCollection | None:
    """Hatch the True cells of ``mask`` (rows = blocks from ``first_row``, columns between
    ``x_edges``) with ``hatch``, one rectangle per run of cells in a row; the collection drawn
    (None when ``mask`` has no True cell)."""
    rects = []
    for row in np.flatnonzero(mask.any(axis=1)):
        edges = np.diff(np.concatenate(([0], mask[row].astype(np.int8), [0])))
        y0 = first_row + row - 0.5
        for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
            rects.append(
                [(x_edges[a], y0), (x_edges[b], y0), (x_edges[b], y0 + 1), (x_edges[a], y0 + 1)]
            )
    if not rects:
        return None
    # NOTE: the hatch takes the edge colour; linewidth 0 draws no outline.
    return ax.add_collection(
        PolyCollection(rects, facecolors="none", edgecolors="black", linewidths=0, hatch=hatch)
    )


def _draw_map(ax, block_map: BlockMap, rows: slice, cols: slice) -> None:
    """The owner image of ``rows`` x ``cols`` of the map, steps on x, block ids on y."""
    image = block_map_image(block_map)[rows, cols]
    steps = block_map.steps[cols]
    last = steps[-1] + block_map.stride
    first_row = rows.start or 0
    ax.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        origin="lower",
        extent=(steps[0], last, first_row - 0.5, first_row + image.shape[0] - 0.5),
    )
    x_edges = np.linspace(steps[0], last, image.shape[1] + 1)
    for mask, hatch in (
        (_shared_by_samples(block_map)[rows, cols], _SAMPLES_HATCH),
        (_shared_by_requests(block_map)[rows, cols], _SHARED_HATCH),
    ):
        _hatch_cells(ax, mask, x_edges, first_row, hatch)
    if first_row == 0:
        # One row of hundreds can fall between pixels: draw the null block's row on top.
        ax.axhline(0, color=_NULL_RGB, linewidth=2.5)
    _count_axis(ax, "x")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(steps[0], last)
    ax.set_ylabel("physical block id")


def _state_counts(block_map: BlockMap) -> dict[str, np.ndarray]:
    """Per sampled step, how many blocks are in each state (the null block left out)."""
    owners = block_map.owners[1:]
    shared = block_map.shared[1:]
    unused = block_map.unused[1:] if block_map.unused is not None else np.zeros_like(shared)
    held = (owners >= 0) & ~shared
    return {
        "held by one request": (held & ~unused).sum(axis=0),
        "reserved, no token yet (waste)": (held & unused).sum(axis=0),
        "shared by one request's samples (fork)": _shared_by_samples(block_map)[1:].sum(axis=0),
        "shared by requests (ref_cnt > 1)": _shared_by_requests(block_map)[1:].sum(axis=0),
        "free, still cached": (owners == CACHED_FREE).sum(axis=0),
    }


def holders_per_block(block_map: BlockMap, rows: slice, cols: slice) -> np.ndarray | None:
    """Mean running requests holding each block of ``rows`` over the samples of ``cols`` in
    which it is held (0 for a block never held there), float ``[num_rows]``; None when the
    map has no holder counts."""
    if block_map.num_holders is None:
        return None
    holders = block_map.num_holders[rows, cols]
    owners = block_map.owners[rows, cols]
    held = (holders > 0) & (owners >= 0)
    num_held = held.sum(axis=1)
    total = np.where(held, holders, 0).sum(axis=1)
    return np.divide(total, num_held, out=np.zeros(len(total)), where=num_held > 0)


def _draw_holders(ax, holders: np.ndarray, first_row: int) -> None:
    """Bars of :func:`holders_per_block` beside the map (rows line up with its blocks): dark
    where several requests (or one request's samples) hold the block, light where one does."""
    y = first_row + np.arange(len(holders))
    shared = holders > 1
    ax.barh(y[~shared], holders[~shared], height=1.0, color="0.7", linewidth=0)
    ax.barh(y[shared], holders[shared], height=1.0, color="0.3", linewidth=0)
    ax.set_xlim(0, max(float(holders.max()), 1.0) * 1.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=3))
    ax.set_xlabel("requests\n(mean while held)")
    ax.set_title("holders per block", fontsize="small")
    ax.tick_params(axis="y", labelleft=False)


def _map_axes(fig, block_map: BlockMap, rows: slice, cols: slice, states: bool):
    """(states axes or None, map axes, holders axes or None): the holders panel only when
    some block of the drawn part is held by several requests."""
    holders = holders_per_block(block_map, rows, cols)
    with_holders = holders is not None and bool((holders > 1).any())
    layout = [["map", "holders"]] if with_holders else [["map"]]
    if states:
        layout = [["states"] * len(layout[0]), *layout]
    axes = fig.subplot_mosaic(
        layout,
        height_ratios=(1, 2) if states else None,
        width_ratios=(6, 1) if with_holders else None,
    )
    ax_holders = axes.get("holders")
    if ax_holders is not None:
        ax_holders.sharey(axes["map"])
        _draw_holders(ax_holders, holders, rows.start or 0)
    return axes.get("states"), axes["map"], ax_holders


def fig_block_map(
    result: PolicyResult,
    *,
    max_rows: int = BLOCK_MAP_MAX_ROWS,
    max_columns: int = BLOCK_MAP_MAX_COLUMNS,
    window_rows: int = BLOCK_MAP_WINDOW_ROWS,
    window_columns: int = BLOCK_MAP_WINDOW_COLUMNS,
) -> Figure | None:
    """Physical blocks x sampled steps for one policy; None without a block map.

    A paged map of more than ``max_rows`` blocks or ``max_columns`` samples shows blocks
    ``0 .. window_rows - 1`` over ``window_columns`` samples from the middle of the run (the
    steady state, where freed blocks are reused), under a panel that counts each block state over
    the whole run with the window marked. The contiguous map is always whole (its regions are
    large and few). Beside the map, when several requests share blocks, the mean number of
    requests holding each block (:func:`holders_per_block`).
    """
    block_map = result.block_map
    if block_map is None:
        return None
    num_blocks, num_columns = block_map.owners.shape
    windowed = result.policy != "contiguous" and (
        num_blocks > max_rows or num_columns > max_columns
    )
    stride_note = f"sampled every {block_map.stride}" if block_map.stride > 1 else "every step"
    if not windowed:
        fig = Figure(figsize=(10, 5), layout="constrained")
        rows, cols = slice(0, num_blocks), slice(0, num_columns)
        _, ax, ax_holders = _map_axes(fig, block_map, rows, cols, states=False)
        _draw_map(ax, block_map, rows, cols)
        ax.set_xlabel(f"step ({stride_note})")
        ax.set_title(f"Block map, {result.policy}: which request owns each block")
        _block_map_legend(ax_holders or ax, block_map)
        return fig

    rows = slice(0, min(num_blocks, window_rows))
    width = min(num_columns, window_columns)
    start = (num_columns - width) // 2
    cols = slice(start, start + width)
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    ax_states, ax_map, ax_holders = _map_axes(fig, block_map, rows, cols, states=True)
    counts = _state_counts(block_map)
    palette = _owner_palette()
    styles = [
        {"color": palette[0]},
        {"color": "#f4b6b6"},
        {"facecolor": palette[0], "edgecolor": "black", "hatch": _SAMPLES_HATCH},
        {"facecolor": palette[0], "edgecolor": "black", "hatch": _SHARED_HATCH},
        {"color": _CACHED_RGB},
    ]
    x = np.append(block_map.steps, block_map.steps[-1] + block_map.stride)
    bottom = np.zeros(len(x))
    for (label, values), style in zip(counts.items(), styles, strict=True):
        if not values.any():
            continue
        top = bottom + np.append(values, values[-1])
        ax_states.fill_between(x, bottom, top, step="post", label=label, lw=0, **style)
        bottom = top
    ax_states.axhline(num_blocks - 1, color="black", linewidth=0.9, linestyle=":")
    window = (block_map.steps[start], block_map.steps[start + width - 1] + block_map.stride)
    for edge in window:
        ax_states.axvline(edge, color="darkorange", linewidth=2, zorder=5)
    ax_states.plot([], [], color="darkorange", linewidth=2, label="window shown below")
    ax_states.set_ylabel("blocks")
    ax_states.set_xlim(x[0], x[-1])
    ax_states.set_title(
        f"Block map, {result.policy}: block states over the whole run "
        f"({num_blocks - 1} usable blocks, dotted)",
        fontsize="medium",
    )
    _count_axis(ax_states)
    ax_states.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend_outside(ax_states, fontsize="small")
    _draw_map(ax_map, block_map, rows, cols)
    ax_map.set_xlabel(f"step ({stride_note})")
    ax_map.set_title(
        f"Window: blocks 0-{rows.stop - 1} of {num_blocks}, steps {window[0]}-{window[1] - 1} "
        f"of {block_map.steps[-1] + block_map.stride}"
        + ("" if ax_holders else "; colour = owning request"),
        fontsize="medium",
    )
    _block_map_legend(ax_holders or ax_map, block_map, rows, cols)
    return fig


def fig_prompt_tokens(results: dict[str, PolicyResult]) -> Figure | None:
    """Where each policy's prompt tokens came from (left: pool hits, tier hits, computed, the
    recomputed part of the computed hatched) and what its time went to (right: steps x
    step_time, plus the KV tier's loads). None when no policy has prefix caching."""
    if not any(r.metrics.num_recomputed_tokens is not None for r in results.values()):
        return None
    names = [p for p, r in results.items() if r.metrics.num_prompt_tokens]
    if not names:
        return None
    fig = Figure(figsize=(10, 1.2 + 0.7 * len(names)), layout="constrained")
    ax_tokens, ax_time = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    y = np.arange(len(names))[::-1]
    metrics = [results[p].metrics for p in names]
    pool = np.array([m.num_pool_hit_tokens for m in metrics], dtype=float)
    tier = np.array([m.num_tier_hit_tokens for m in metrics], dtype=float)
    recomputed = np.array([m.num_recomputed_tokens or 0 for m in metrics], dtype=float)
    computed = np.array([m.num_computed_prompt_tokens for m in metrics], dtype=float)
    segments = [
        ("pool hit (prefix cache)", pool, {"color": "tab:green"}),
        ("tier hit (loaded)", tier, {"color": "tab:orange"}),
        ("computed", computed - recomputed, {"color": "0.8"}),
        (
            "of it recomputed (evicted before)",
            recomputed,
            {"color": "tab:red", "hatch": "//", "edgecolor": "white"},
        ),
    ]
    left = np.zeros(len(names))
    for label, values, style in segments:
        if values.any():
            ax_tokens.barh(y, values, left=left, label=label, height=0.6, **style)
        left += values
    for yi, m in zip(y, metrics, strict=True):
        hits = m.num_pool_hit_tokens + m.num_tier_hit_tokens
        ax_tokens.text(
            m.num_prompt_tokens, yi, f" {hits / m.num_prompt_tokens:.0%} hit", va="center"
        )
    ax_tokens.set_yticks(y, names)
    ax_tokens.set_xlabel("prompt tokens")
    ax_tokens.set_xlim(right=max(float(left.max()), 1.0) * 1.2)
    ax_tokens.set_title("Prompt tokens: served from a cache or computed", fontsize="medium")
    below = (0.5, -0.5 / len(names) - 0.12)
    ax_tokens.legend(loc="upper center", bbox_to_anchor=below, ncols=2, fontsize="small")
    compute = np.array([m.compute_time_s for m in metrics])
    load = np.array([m.tier_load_time_s for m in metrics])
    steps = np.array([m.time_s for m in metrics]) - compute - load
    ax_time.barh(y, steps, height=0.6, color="0.55", label="steps x step_time")
    if compute.any():
        ax_time.barh(
            y, compute, left=steps, height=0.6, color="tab:red", label="tokens x time_per_token"
        )
    compute = compute + steps
    if load.any():
        ax_time.barh(y, load, left=compute, height=0.6, color="tab:orange", label="tier loads")
        for yi, m in zip(y, metrics, strict=True):
            if m.tier_load_time_s:
                ax_time.text(m.time_s, yi, f" +{m.tier_load_time_s:.3g} s", va="center")
    ax_time.set_xlim(right=max(float((compute + load).max()), 1e-9) * 1.3)
    ax_time.set_xlabel("simulated seconds to drain")
    ax_time.set_title("Time to drain: steps, compute, tier loads", fontsize="medium")
    ax_time.legend(loc="upper center", bbox_to_anchor=below, fontsize="small")
    return fig


def fig_block_size_sweep(sweep: dict[str, dict[int, PolicyMetrics]]) -> Figure:
    """Output tokens per step and waste % vs block_size, one line per policy (the contiguous
    baseline keeps the same pool bytes, so it barely moves)."""
    fig = Figure(figsize=(10, 4.4), layout="constrained")
    ax_tput, ax_waste = fig.subplots(1, 2)
    all_sizes: set[int] = set()
    for policy, by_size in sweep.items():
        sizes = sorted(by_size)
        all_sizes.update(sizes)
        style = _style(policy)
        ax_tput.plot(
            sizes, [by_size[s].output_tokens_per_step for s in sizes], label=policy, **style
        )
        ax_waste.plot(sizes, [by_size[s].waste_pct for s in sizes], label=policy, **style)
    ticks = sorted(all_sizes)
    for ax in (ax_tput, ax_waste):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(s) for s in ticks])
        ax.minorticks_off()
        ax.set_xlabel("block_size (tokens)")
        ax.set_ylim(bottom=0)
    ax_tput.set_ylabel("output tokens per step")
    ax_tput.set_title("Throughput proxy vs block_size")
    ax_waste.set_ylabel("waste (% of reserved KV)")
    ax_waste.set_title("Internal fragmentation vs block_size")
    handles, labels = ax_tput.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    return fig


#: What to look at in each figure (index.html captions), by file name prefix.
CAPTIONS = MappingProxyType(
    {
        "kv_blocks": (
            "One panel per policy, on the same axes: the KV blocks it reserves at every step, "
            "against the usable pool (dotted; the same for every policy), and its preemptions so "
            "far (black, right axis, the same scale in every panel). Paged and paged+prefix both "
            "fill the pool while the queue is long; the panels show how much sooner prefix "
            'caching drains, and how its preemptions climb while the pool is full ("Why the '
            'preemptions differ", above, says why). Bottom, every policy on one log axis: the '
            "reserved blocks that hold no token. Contiguous reserves max_model_len for every "
            "request and leaves most of it empty, paging wastes at most the unfilled tail of "
            "each request's last block."
        ),
        "running_waiting": (
            "Requests running (holding KV) and waiting (queued, new or preempted) at every step, "
            "one panel per policy. The more requests fit in the same pool, the higher the "
            "running line and the sooner the waiting line reaches 0."
        ),
        "prompt_tokens": (
            "Left: where each policy's prompt tokens came from: hits in the pool's prefix cache "
            "(green), blocks loaded back from the KV tier (orange), and computed (grey; red "
            "hatched: recomputed, blocks whose KV an earlier step had computed but the pool had "
            "evicted: the work a tier saves). Right: simulated seconds to drain: steps x "
            "step_time, tokens computed x --time-per-token (when set), and the tier's loads "
            "(bytes over its bandwidth): a slower tier costs time, never hits."
        ),
        "block_map_contiguous": (
            "Which request owns each physical block over time (colour = request). Each request "
            "holds one region of max_model_len tokens; the light part of a region is reserved "
            "but holds no token yet, the waste the table reports. The tail of the pool too "
            "short for a region stays white; row 0 (dark) is left out as the paged pools' null "
            "block."
        ),
        "block_map": (
            "Which request owns each physical block over time (colour = request). Look for a "
            "request's blocks scattered over the pool (paging needs no contiguous run), blocks "
            "freed by one request and reused by another, cross-hatched blocks shared by several "
            "requests (a common prefix stored once; the colour is the oldest request holding it, "
            "and changes when that one finishes while the block lives on; the side panel says "
            "how many requests hold each block), slanted hatching for blocks shared by the "
            "samples of one request "
            "(n > 1: the prompt prefilled once and forked) and grey free blocks still in the "
            "prefix cache (hits for later requests until reused). Row 0 is the null block. At "
            "scale the top panel counts the blocks in each state over the whole run and the map "
            "below is a window (shaded above) of the first 64 blocks."
        ),
        "block_size_sweep": (
            "The first requests of the trace replayed with other block sizes on a pool of the "
            "same bytes. Bigger blocks waste more of each request's last block (right) and, with "
            "prefix caching, share less; the simulator has no kernel cost, so very small blocks "
            "look free here while real attention kernels slow down with them."
        ),
    }
)


def caption(name: str) -> str:
    """The caption of a figure file name (longest matching prefix of :data:`CAPTIONS`)."""
    stem = Path(name).stem
    matches = [key for key in CAPTIONS if stem.startswith(key)]
    return CAPTIONS[max(matches, key=len)] if matches else ""


def save_figures(
    results: dict[str, PolicyResult],
    out_dir: str | Path,
    sweep: dict[str, dict[int, PolicyMetrics]] | None = None,
    *,
    dpi: int = 110,
) -> list[Path]:
    """Write every figure as PNG into ``out_dir`` (created); returns the paths in order.

    Raises:
        OSError: a file cannot be written (the caller decides what to do with its results).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, Figure | None]] = [
        ("kv_blocks.png", fig_kv_blocks(results)),
        ("running_waiting.png", fig_running_waiting(results)),
        ("prompt_tokens.png", fig_prompt_tokens(results)),
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
#: Rows added when a request has n > 1 samples.
_FORK_LABELS = (
    ("num_sequences", "sequences (samples)", "{:d}"),
    ("peak_blocks", "peak KV blocks", "{:d}"),
    ("num_forks", "forks", "{:d}"),
    ("num_cow_copies", "copy-on-write copies", "{:d}"),
)


#: Rows added when a policy has prefix caching: where the prompt tokens came from.
_PROMPT_LABELS = (
    ("num_prompt_tokens", "prompt tokens", "{:d}"),
    ("num_pool_hit_tokens", "  pool hits", "{:d}"),
    ("num_computed_prompt_tokens", "  computed", "{:d}"),
    ("num_recomputed_tokens", "    recomputed", "{:d}"),
)
#: Rows added when a policy has a KV tier.
_TIER_LABELS = (
    ("num_tier_hit_tokens", "  tier hits", "{:d}"),
    ("pool_hit_rate", "pool hit rate", "{:.1%}"),
    ("tier_hit_rate", "tier hit rate", "{:.1%}"),
    ("num_tier_stored_blocks", "tier stores (blocks)", "{:d}"),
    ("num_tier_loaded_blocks", "tier loads (blocks)", "{:d}"),
    ("tier_loaded_bytes", "tier bytes loaded", "{:d}"),
    ("tier_load_time_s", "tier load time (s)", "{:.4f}"),
    ("compute_time_s", "compute time (s)", "{:.2f}"),
    ("time_s", "time to drain (s)", "{:.2f}"),
)


def metrics_table_rows(metrics: dict[str, PolicyMetrics]) -> list[list[str]]:
    """Rows [label, value per policy] of the summary table (also used for the terminal); the
    fork rows (sequences, peak KV blocks, forks, copy-on-write copies) only when some request
    has n > 1 samples; the prompt-token rows (pool hits, computed, recomputed) when a policy has
    prefix caching; the tier rows (tier hits, loads, load time, time) when one has a KV tier. A
    value a policy does not have (recomputed without prefix caching) is ``-``."""
    labels = _METRIC_LABELS
    if any(m.num_sequences > m.num_requests for m in metrics.values()):
        labels += _FORK_LABELS
    if any(m.num_recomputed_tokens is not None for m in metrics.values()):
        labels += _PROMPT_LABELS
        if any(m.policy == "paged+prefix+tier" for m in metrics.values()):
            labels = labels[:-2] + _TIER_LABELS[:1] + labels[-2:] + _TIER_LABELS[1:]
    rows = [["metric", *metrics]]
    for field, label, fmt in labels:
        values = (getattr(m, field) for m in metrics.values())
        rows.append([label, *("-" if v is None else fmt.format(v) for v in values)])
    return rows


#: The page's Jinja2 template, shipped as package data (``pagedkv/sim/templates``).
HTML_TEMPLATE = "simulate_report.html.j2"


@dataclass(frozen=True, slots=True)
class _PageFigure:
    """One embedded figure of the page: file name, alt text (the stem), PNG as base64, caption."""

    name: str
    alt: str
    png_base64: str
    caption: str


def write_html(
    path: str | Path,
    figure_paths: list[Path],
    metrics: dict[str, PolicyMetrics],
    *,
    title: str = "pagedkv simulate",
    command: str = "",
    config: Sequence[str] = (),
    notes: Sequence[str] = (),
    preemptions: Sequence[str] = (),
) -> Path:
    """Write one self-contained HTML page: the metrics table and every PNG embedded (base64),
    each with a caption saying what to look at (:data:`CAPTIONS`).

    The page is the Jinja2 template :data:`HTML_TEMPLATE` rendered with autoescape on, so a
    title, command line or metric value holding ``<`` or ``&`` is shown as text.

    Args:
        path: the page to write (usually ``OUT/index.html``).
        figure_paths: the PNGs to embed, in page order.
        metrics: per policy, its metrics (the table's columns).
        title: the page's title and heading.
        command: the command line that made the page, shown under the heading ("" for none).
        config: the run's settings, one line each, shown under the command (what stdout
            prints first: :func:`pagedkv.sim.simulator.config_lines`).
        notes: lines shown under the table (the fork's saving:
            :func:`pagedkv.sim.simulator.fork_saving_lines`).
        preemptions: lines of a "Why the preemptions differ" section under the table
            (:func:`pagedkv.sim.preemption.preemption_lines`; empty leaves it out).

    Raises:
        OSError: the page or a figure cannot be read or written.
    """
    from jinja2 import Environment, PackageLoader, StrictUndefined

    path = Path(path)
    rows = metrics_table_rows(metrics)
    figures = [
        _PageFigure(
            name=p.name,
            alt=p.stem,
            png_base64=base64.b64encode(p.read_bytes()).decode("ascii"),
            caption=caption(p.name),
        )
        for p in figure_paths
    ]
    env = Environment(
        loader=PackageLoader("pagedkv.sim", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    page = env.get_template(HTML_TEMPLATE).render(
        title=title,
        command=command,
        config=list(config),
        header=rows[0],
        rows=rows[1:],
        notes=list(notes),
        preemptions=list(preemptions),
        figures=figures,
    )
    path.write_text(page, encoding="utf-8")
    return path
