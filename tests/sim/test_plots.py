"""Pictures: every figure renders to a non-empty PNG; the HTML page embeds them."""

from __future__ import annotations

import numpy as np

from pagedkv.sim.blockmap import CACHED_FREE, FREE, NULL_BLOCK, BlockMap
from pagedkv.sim.plots import block_map_image, save_figures, write_html
from pagedkv.sim.simulator import SimConfig, simulate_policies, sweep_block_sizes
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
    owners = np.array([[NULL_BLOCK], [FREE], [CACHED_FREE], [3], [3]], dtype=np.int32)
    shared = np.array([[False], [False], [False], [False], [True]])
    image = block_map_image(BlockMap(np.array([0]), owners, shared, 1))
    assert image.shape == (5, 1, 3)
    assert tuple(image[1, 0]) == (1.0, 1.0, 1.0)
    assert tuple(image[4, 0]) == (0.0, 0.0, 0.0)
    assert len({tuple(image[i, 0]) for i in range(5)}) == 5
