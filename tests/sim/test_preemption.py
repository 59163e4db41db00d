"""Preemptions: what each one freed, and the page's explanation of why prefix caching preempts
more (shared blocks stay held when their victim is preempted)."""

from __future__ import annotations

from pagedkv.sim.plots import save_figures, write_html
from pagedkv.sim.preemption import PreemptionStats, preemption_lines
from pagedkv.sim.simulator import SimConfig, simulate_policies
from pagedkv.sim.workloads import make_workload


def _results():
    workload = make_workload("shared-prefix", seed=0, num_requests=60, max_model_len=1024)
    config = SimConfig(num_blocks=200, block_size=16, max_model_len=1024, block_map_columns=0)
    return simulate_policies(workload, config)


def test_victims_of_prefix_caching_give_back_only_their_unshared_blocks():
    results = _results()
    assert results["contiguous"].preemptions is None  # its regions never need to grow
    paged, cached = results["paged"].preemptions, results["paged+prefix"].preemptions
    for policy in ("paged", "paged+prefix"):
        stats = results[policy].preemptions
        assert stats.num_preemptions == results[policy].metrics.num_preemptions
        assert results[policy].timeline.num_preemptions.sum() == stats.num_preemptions
    # Without prefix caching (and without forks) nothing is shared: a victim frees its whole
    # table.
    assert paged == PreemptionStats(
        num_preemptions=14,
        num_victims=14,
        num_repeats=0,
        max_per_request=1,
        num_victim_blocks=546,
        num_freed_blocks=546,
        num_running=67,
    )
    # With it, two thirds of the victims' blocks are system prompts other requests still hold:
    # 3x the preemptions give back fewer blocks in all.
    assert cached == PreemptionStats(
        num_preemptions=42,
        num_victims=28,
        num_repeats=14,
        max_per_request=4,
        num_victim_blocks=1555,
        num_freed_blocks=511,
        num_running=384,
    )
    assert cached.num_shared_blocks == 1044


def test_the_page_says_why_prefix_caching_preempts_more(tmp_path):
    results = _results()
    stats = {p: r.preemptions for p, r in results.items() if r.preemptions is not None}
    lines = preemption_lines(stats, block_size=16)
    assert lines[0].startswith("paged: 14 preemptions of 14 requests (0 repeats")
    assert "12.2 went back to the pool (511 blocks in all)" in lines[1]
    why = lines[2]
    assert why.startswith("Why paged+prefix preempts more than paged (42 vs 14)")
    assert "12.2 blocks came back per preemption against 39.0 under paged" in why
    assert "14 of the 42 were repeats" in why
    paths = save_figures(results, tmp_path, dpi=30)
    page = write_html(
        tmp_path / "index.html",
        paths,
        {p: r.metrics for p, r in results.items()},
        preemptions=lines,
    ).read_text()
    assert '<h2 id="preemptions">Why the preemptions differ</h2>' in page
    assert page.count('<p class="preemption">') == 3
    assert "12.2 blocks came back per preemption" in page
    # No preemption, no section; and no "why" line when prefix caching preempts no more.
    metrics = {p: r.metrics for p, r in results.items()}
    bare = write_html(tmp_path / "bare.html", paths, metrics).read_text()
    assert '<h2 id="preemptions">' not in bare and 'class="preemption"' not in bare
    no_more = {"paged": stats["paged"], "paged+prefix": PreemptionStats()}
    assert preemption_lines(no_more, 16) == [lines[0]]
