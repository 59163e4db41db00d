"""Pictures: every figure renders to a non-empty PNG; the HTML page embeds them."""

from __future__ import annotations

import numpy as np

from pagedkv.sim.blockmap import CACHED_FREE, FREE, NULL_BLOCK, BlockMap
from pagedkv.sim.plots import (
    SHARED_LABEL,
    block_map_image,
    block_map_legend_labels,
    caption,
    fig_block_map,
    fig_kv_blocks,
    fig_prompt_tokens,
    fig_running_waiting,
    holders_per_block,
    metrics_table_rows,
    save_figures,
    step_series,
    write_html,
)
from pagedkv.sim.simulator import (
    PolicyResult,
    SimConfig,
    config_lines,
    simulate_policies,
    sweep_block_sizes,
)
from pagedkv.sim.workloads import make_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_figures_and_html(tmp_path):
    workload = make_workload("shared-prefix", seed=0, num_requests=40, max_model_len=1024)
    config = SimConfig(num_blocks=160, block_size=16, max_model_len=1024, block_map_columns=20)
    results = simulate_policies(workload, config)
    sweep = sweep_block_sizes(workload, config, block_sizes=(8, 16, 64))
    paths = save_figures(results, tmp_path, sweep, dpi=50)
    names = {p.name for p in paths}
    assert names == {
        "kv_blocks.png",
        "running_waiting.png",
        "block_map_contiguous.png",
        "block_map_paged.png",
        "block_map_paged_prefix.png",
        "block_size_sweep.png",
        "prompt_tokens.png",
    }
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    # The block map stayed within its sample budget.
    assert results["paged"].block_map.owners.shape[1] < 2 * 20
    page = write_html(
        tmp_path / "index.html", paths, {p: r.metrics for p, r in results.items()}, command="x"
    )
    text = page.read_text()
    assert text.count("data:image/png;base64,") == len(paths)
    assert "prefix hit rate" in text


def test_block_map_colours():
    owners = np.array([[NULL_BLOCK], [FREE], [CACHED_FREE], [3], [3], [5]], dtype=np.int32)
    shared = np.array([[False], [False], [False], [False], [True], [False]])
    image = block_map_image(BlockMap(np.array([0]), owners, shared, 1))
    assert image.shape == (6, 1, 3)
    assert tuple(image[1, 0]) == (1.0, 1.0, 1.0)
    # A block shared by several requests keeps its (oldest) owner's colour, not black ...
    assert tuple(image[4, 0]) == tuple(image[3, 0]) != (0.0, 0.0, 0.0)
    assert len({tuple(image[i, 0]) for i in range(6)}) == 5


def test_shared_blocks_are_hatched_over_their_owners_colours():
    # Block 1 held by request 2 alone, then shared (request 2 the oldest holder), then shared
    # with request 7 the oldest holder (2 finished); block 2 shared by one request's samples.
    owners = np.array(
        [[NULL_BLOCK] * 3, [2, 2, 7], [4, 4, 4]],
        dtype=np.int32,
    )
    shared = np.array([[False] * 3, [False, True, True], [True, True, True]])
    by_samples = np.array([[False] * 3, [False] * 3, [True, True, True]])
    holders = np.array([[0] * 3, [1, 5, 3], [2, 2, 2]], dtype=np.int32)
    block_map = BlockMap(
        np.array([0, 1, 2]), owners, shared, 1, shared_by_samples=by_samples, num_holders=holders
    )
    image = block_map_image(block_map)
    assert (image[1, 1] == image[1, 0]).all()  # request 2's colour, shared or not
    assert not (image[1, 2] == image[1, 1]).all()  # request 7's colour once it is the oldest
    config = SimConfig(num_blocks=3, block_size=4, max_model_len=8)
    fig = fig_block_map(PolicyResult("paged+prefix", config, None, None, block_map))
    ax_map = fig.axes[0]
    hatches = {c.get_hatch(): c for c in ax_map.collections}
    # One cross-hatched cell run for the shared-by-requests cells (row 1, columns 1-2), one
    # slanted for the samples' (row 2, all columns).
    assert set(hatches) == {"xx", "////"}
    (crossed,) = hatches["xx"].get_paths()
    (x0, y0), (x1, y1) = crossed.vertices.min(axis=0), crossed.vertices.max(axis=0)
    assert (x0, x1, y0, y1) == (1.0, 3.0, 0.5, 1.5)
    assert SHARED_LABEL in block_map_legend_labels(fig)
    # Beside the map: how many requests hold each block (mean while held).
    ax_holders = fig.axes[1]
    assert ax_holders.get_title() == "holders per block"
    assert holders_per_block(block_map, slice(0, 3), slice(0, 3)).tolist() == [0.0, 3.0, 2.0]
    widths = sorted(round(p.get_width(), 6) for p in ax_holders.patches)
    assert widths == [0.0, 2.0, 3.0]


def test_step_series_draws_idle_gaps_at_zero_and_the_last_step_one_wide():
    x, y = step_series(np.array([0, 1, 5]), np.array([3, 4, 2]))
    assert x.tolist() == [0, 1, 2, 5, 6]
    assert y.tolist() == [3, 4, 0, 2, 2]
    x, y = step_series(np.array([7]), np.array([1]))
    assert (x.tolist(), y.tolist()) == ([7, 8], [1, 1])


def test_unused_part_of_a_region_is_a_light_shade_of_its_owner():
    owners = np.array([[NULL_BLOCK], [2], [2]], dtype=np.int32)
    shared = np.zeros((3, 1), dtype=bool)
    unused = np.array([[False], [False], [True]])
    image = block_map_image(BlockMap(np.array([0]), owners, shared, 1, unused))
    written, reserved = image[1, 0], image[2, 0]
    assert (reserved >= written).all() and reserved.sum() > written.sum()  # lighter
    assert np.allclose(reserved, 0.3 * written + 0.7)


def _sixteen_lengths_results():
    workload = make_workload("sixteen-lengths")
    return simulate_policies(workload, SimConfig(**workload.defaults))


def _kv_panels(fig) -> dict[str, object]:
    """fig_kv_blocks' axes by what they show: a policy's panel by its name, "waste" the last."""
    panels = {}
    for ax in fig.axes:
        title = ax.get_title(loc="left")
        if title.startswith("Waste"):
            panels["waste"] = ax
        elif title:
            panels[title.split(":")[0]] = ax
    return panels


def test_coinciding_policies_get_a_panel_each_and_share_one_pool():
    results = _sixteen_lengths_results()
    # No shared prefixes: paged and paged+prefix give the same timeline ...
    paged, cached = results["paged"].timeline, results["paged+prefix"].timeline
    assert paged.num_reserved_tokens.tolist() == cached.num_reserved_tokens.tolist()
    fig = fig_kv_blocks(results)
    panels = _kv_panels(fig)
    assert list(panels) == ["contiguous", "paged", "paged+prefix", "waste"]
    # ... so each policy's reserved blocks are drawn in a panel of its own (lines that coincide
    # on one axis cannot be told apart), all panels on the same axes and the same pool.
    for policy in results:
        lines = [line for line in panels[policy].get_lines() if line.get_label() == policy]
        assert len(lines) == 1
        others = {line.get_label() for line in panels[policy].get_lines()} & set(results)
        assert others == {policy}
        legend = [t.get_text() for t in panels[policy].get_legend().get_texts()]
        assert f"{policy}: blocks reserved" in legend and "usable pool (128 blocks)" in legend
        assert panels[policy].get_ylim() == panels["paged"].get_ylim()
        assert panels[policy].get_xlim() == panels["paged"].get_xlim()
    # Contiguous reserves 4 regions of 32 blocks: the 128-block usable pool, not above it.
    (contiguous,) = [
        line for line in panels["contiguous"].get_lines() if line.get_label() == "contiguous"
    ]
    assert contiguous.get_ydata().max() == 128
    # The waste panel has every policy, each in its own line style and marker.
    waste = {line.get_label(): line for line in panels["waste"].get_lines()}
    assert waste["paged"].get_linestyle() != waste["paged+prefix"].get_linestyle()
    assert waste["paged"].get_marker() != waste["paged+prefix"].get_marker()
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_ylim()[0] == 0  # counts start at 0
        # The legend is outside the axes: it covers no data.
        legend = ax.get_legend()
        if legend is not None:
            box = legend.get_window_extent()
            assert box.x0 >= ax.get_window_extent().x1


def test_kv_blocks_panels_count_preemptions_on_one_shared_scale():
    workload = make_workload("shared-prefix", seed=0, num_requests=60, max_model_len=1024)
    config = SimConfig(num_blocks=200, block_size=16, max_model_len=1024, block_map_columns=0)
    results = simulate_policies(workload, config, ("paged", "paged+prefix"))
    fig = fig_kv_blocks(results)
    twins = [ax for ax in fig.axes if ax.get_ylabel() == "preemptions"]
    assert len(twins) == 2 and twins[0].get_ylim() == twins[1].get_ylim()
    for twin, result in zip(twins, results.values(), strict=True):
        (line,) = twin.get_lines()
        # Cumulative: it ends at the policy's preemption count.
        assert line.get_ydata()[-1] == result.metrics.num_preemptions > 0
        assert result.timeline.num_preemptions.sum() == result.metrics.num_preemptions


def test_count_axes_get_integer_ticks():
    results = _sixteen_lengths_results()
    fig = fig_running_waiting(results)
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = ax.get_yticks()
        assert np.allclose(ticks, np.round(ticks))
        assert ax.get_ylim()[0] == 0
        xticks = ax.get_xticks()
        assert np.allclose(xticks, np.round(xticks))


def test_large_block_maps_show_a_window_with_the_null_block_row():
    workload = make_workload("sharegpt", seed=0, num_requests=80, max_model_len=512)
    config = SimConfig(num_blocks=400, block_size=16, max_model_len=512, block_map_columns=100)
    result = simulate_policies(workload, config, ("paged",))["paged"]
    fig = fig_block_map(result)
    ax_states, ax_map = fig.axes[:2]
    assert "Window: blocks 0-63 of 400" in ax_map.get_title()
    low, high = ax_map.get_ylim()
    assert low <= -0.5 and high <= 64  # block 0's row is in the window
    assert "whole run" in ax_states.get_title()
    small = fig_block_map(result, max_rows=1000, max_columns=1000)
    assert len(small.axes) == 1 or "Window" not in small.axes[-1].get_title()


def test_html_has_a_caption_per_figure(tmp_path):
    results = _sixteen_lengths_results()
    paths = save_figures(results, tmp_path, dpi=40)
    page = write_html(tmp_path / "index.html", paths, {p: r.metrics for p, r in results.items()})
    text = page.read_text()
    assert text.count("<figcaption>") == len(paths)
    for path in paths:
        assert caption(path.name)
    assert "reserved but holds no token yet" in text  # the contiguous map's caption


def test_html_escapes_text_and_ships_its_template(tmp_path):
    from importlib.resources import files

    from pagedkv.sim.plots import HTML_TEMPLATE

    assert files("pagedkv.sim").joinpath("templates", HTML_TEMPLATE).is_file()  # package data
    results = _sixteen_lengths_results()
    paths = save_figures(results, tmp_path, dpi=40)
    page = write_html(
        tmp_path / "index.html",
        paths,
        {p: r.metrics for p, r in results.items()},
        title="<script>alert(1)</script> & co",
        command="pagedkv simulate --workload '<b>'",
    )
    text = page.read_text()
    assert "<script>" not in text and "<b>'" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in text
    assert "<code>pagedkv simulate --workload &#39;&lt;b&gt;&#39;</code>" in text
    assert text.count("<figure>") == len(paths)
    no_command = write_html(
        tmp_path / "bare.html", paths, {p: r.metrics for p, r in results.items()}
    )
    assert "<code>" not in no_command.read_text()


def _present_labels(block_map, rows=slice(None), cols=slice(None)) -> set[str]:
    """The block-map legend labels whose category occurs in ``rows`` x ``cols``."""
    from pagedkv.sim.plots import _shared_by_requests, _shared_by_samples

    owners = block_map.owners[rows, cols]
    present = set()
    if (owners >= 0).any():
        present.add("held by a request (colour = request)")
    if (owners == CACHED_FREE).any():
        present.add("free, still cached")
    if (owners == FREE).any():
        present.add("free")
    if (owners == NULL_BLOCK).any():
        present.add("null block (block 0)")
    if _shared_by_requests(block_map)[rows, cols].any():
        present.add(SHARED_LABEL)
    if _shared_by_samples(block_map)[rows, cols].any():
        present.add("shared by the samples of one request\n(n > 1, forked; ref_cnt > 1)")
    if block_map.unused is not None and block_map.unused[rows, cols].any():
        present.add("reserved, no token yet (waste)")
    return present


def test_block_map_legend_lists_only_categories_present():
    # No cached-free block and no shared one: neither may be in the legend.
    owners = np.array([[NULL_BLOCK, NULL_BLOCK], [3, 3], [FREE, 4]], dtype=np.int32)
    block_map = BlockMap(np.array([0, 1]), owners, np.zeros_like(owners, dtype=bool), 1)
    config = SimConfig(num_blocks=3, block_size=4, max_model_len=8)
    result = PolicyResult("paged", config, None, None, block_map)
    labels = set(block_map_legend_labels(fig_block_map(result)))
    assert labels == _present_labels(block_map)
    assert "free, still cached" not in labels and SHARED_LABEL not in labels


def test_windowed_block_map_legend_is_a_subset_of_the_window():
    workload = make_workload("shared-prefix", seed=0, num_requests=80, max_model_len=512)
    config = SimConfig(num_blocks=400, block_size=16, max_model_len=512, block_map_columns=100)
    result = simulate_policies(workload, config, ("paged+prefix",))["paged+prefix"]
    fig = fig_block_map(result)
    ax_holders = fig.axes[2]  # the map's legend sits right of the holders panel
    labels = [t.get_text() for t in ax_holders.get_legend().get_texts()]
    rows = slice(0, 64)
    num_columns = result.block_map.owners.shape[1]
    width = min(num_columns, 120)
    start = (num_columns - width) // 2
    assert set(labels) == _present_labels(result.block_map, rows, slice(start, start + width))


def test_prompt_tokens_figure_and_html_config_line(tmp_path):
    workload = make_workload("multi-turn", seed=0, num_requests=30, max_model_len=1024)
    config = SimConfig(
        num_blocks=60,
        block_size=16,
        max_model_len=1024,
        kv_offloading_blocks=500,
        kv_bytes_per_block=10**6,
        block_map_columns=0,
    )
    results = simulate_policies(workload, config, ("paged", "paged+prefix", "paged+prefix+tier"))
    fig = fig_prompt_tokens(results)
    ax_tokens = fig.axes[0]
    labels = {t.get_text() for t in ax_tokens.get_legend().get_texts()}
    assert {"tier hit (loaded)", "computed", "of it recomputed (evicted before)"} <= labels
    assert [t.get_text() for t in ax_tokens.get_yticklabels()] == list(results)
    lines = config_lines(config, workload.name, len(workload.requests))
    assert lines[0].startswith("workload multi-turn: 30 requests; pool 60 blocks of 16 tokens")
    assert "KV tier below the paged+prefix+tier pool: 500 blocks" in lines[1]
    assert "16 GB/s" in lines[1]
    paths = save_figures(results, tmp_path, dpi=40)
    assert "prompt_tokens.png" in {p.name for p in paths}
    page = write_html(
        tmp_path / "index.html", paths, {p: r.metrics for p, r in results.items()}, config=lines
    )
    text = page.read_text()
    for line in lines:
        assert f'<p class="config">{line}</p>' in text
    assert "tier hit rate" in text and "tier load time (s)" in text
    # No prefix caching anywhere: no prompt-token figure, no prompt rows.
    assert fig_prompt_tokens({"paged": results["paged"]}) is None
    rows = metrics_table_rows({"paged": results["paged"].metrics})
    assert not any(row[0].strip() == "recomputed" for row in rows)
