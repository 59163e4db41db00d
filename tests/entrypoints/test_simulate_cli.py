"""`pagedkv simulate` end to end (small workloads)."""

from __future__ import annotations

import json

import pytest

from pagedkv.entrypoints.cli import main


def test_json_on_the_sixteen_lengths(capsys):
    assert main(["simulate", "--workload", "sixteen-lengths", "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 128 usable blocks for every policy, plus the null block.
    assert report["config"]["num_blocks"] == 129 and report["config"]["max_model_len"] == 512
    peaks = {p: m["peak_concurrency"] for p, m in report["policies"].items()}
    assert peaks == {"contiguous": 4, "paged": 13, "paged+prefix": 13}


def test_json_and_stdout_say_what_the_preemptions_freed(capsys):
    argv = ["simulate", "--workload", "shared-prefix", "--num-requests", "60", "--num-blocks"]
    argv += ["201", "--max-model-len", "1024", "--quiet"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # The paged policies only (contiguous never preempts); the same counts as the table's.
    assert set(report["preemptions"]) == {"paged", "paged+prefix"}
    cached = report["preemptions"]["paged+prefix"]
    assert cached["num_preemptions"] == report["policies"]["paged+prefix"]["num_preemptions"]
    assert cached["num_freed_blocks"] < cached["num_victim_blocks"]
    paged = report["preemptions"]["paged"]
    assert paged["num_freed_blocks"] == paged["num_victim_blocks"] > 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"Why paged+prefix preempts more than paged ({cached['num_preemptions']} vs " in out


def test_skip_admission_gives_14(capsys):
    argv = ["simulate", "--workload", "sixteen-lengths", "--admission", "skip", "--json"]
    assert main([*argv, "--policies", "paged"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policies"]["paged"]["peak_concurrency"] == 14
    assert report["config"]["admission"] == "skip"


def test_table_pictures_and_html(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "simulate",
        "--workload",
        "multi-turn",
        "--num-requests",
        "30",
        "--num-blocks",
        "200",
        "--max-model-len",
        "1024",
        "--out",
        str(out),
        "--html",
        "--sweep-requests",
        "15",
        "--seed",
        "4",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "steps to drain" in text and "paged+prefix" in text
    assert (out / "index.html").stat().st_size > 10_000
    assert (out / "block_size_sweep.png").stat().st_size > 0


def test_trace_file_with_skip_and_memory_budget(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"prompt_len": 100, "output_len": 20}\n'
        "not json\n"
        '{"prompt_len": 50, "output_len": 10, "arrival_time": 0.1}\n',
        encoding="utf-8",
    )
    argv = ["simulate", "--trace", str(trace), "--json", "--kv-cache-memory", "64MiB"]
    assert main([*argv, "--on-error", "skip"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["num_requests"] == 2
    assert report["trace_issues"] == [{"line": 2, "message": report["trace_issues"][0]["message"]}]
    assert "line 2" in captured.err
    # 64 MiB / (30 layers x 2 x 16 x 3 x 64 x 2 bytes) = 182 blocks of SmolLM2's shape.
    assert report["config"]["num_blocks"] == 64 * 2**20 // (30 * 2 * 16 * 3 * 64 * 2)
    assert main([*argv, "--on-error", "strict"]) == 2
    assert ":2:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "sixteen-lengths", "--html"], "--html needs --out"),
        (["--workload", "sixteen-lengths", "--policies", "paged,bogus"], "bogus"),
        (["--workload", "bogus"], "unknown workload"),
        (["--workload", "sixteen-lengths", "--num-blocks", "1"], "num_blocks"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    assert main(["simulate", "--json", *argv]) == 2
    assert message in capsys.readouterr().err


def test_model_with_sliding_window_groups_fits_more_than_all_full_attention(tmp_path, capsys):
    """Gemma 3 270M's six KV cache groups on one pool: 4,096-token requests hold 256 blocks in
    the full-attention group and at most 65 in each sliding-window group (512-token steps), so
    the same bytes run more of them at once than with every layer as full attention (6 x 256)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 3968, "output_len": 128}\n' * 8)
    argv = ["simulate", "--trace", str(trace), "--model", "gemma3-270m"]
    argv += ["--kv-cache-memory", "128MiB", "--max-model-len", "4096"]
    argv += ["--max-num-batched-tokens", "512", "--json", "--quiet"]
    peaks = {}
    for extra in ([], ["--disable-hybrid-kv-cache-manager"]):
        assert main([*argv, *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        # The contiguous baseline is one full-attention region: only for the unified form.
        policies = {"paged", "paged+prefix"} | ({"contiguous"} if extra else set())
        assert set(report["policies"]) == policies
        groups = report["kv_cache_groups"]
        assert groups == ([512] * 5 + [None] if not extra else [None])
        assert report["config"]["num_blocks"] == (128 << 20) // (
            3 * 16 * 1024 if not extra else 18 * 16 * 1024
        )
        peaks[bool(extra)] = report["policies"]["paged"]["peak_concurrency"]
    # 2,729 usable blocks: a whole request needs 581 (hybrid) or 1,536 (unified); requests still
    # prefilling hold less, so more run at the peak: 7 against 2.
    assert peaks == {False: 7, True: 2}


def test_model_refuses_the_shape_flags_and_contiguous(capsys):
    base = ["simulate", "--workload", "sixteen-lengths", "--model", "gemma3-270m", "--quiet"]
    for argv, message in [
        ([*base, "--num-layers", "4"], "drop --num-layers"),
        ([*base, "--policies", "contiguous,paged"], "has 6 KV cache groups"),
        (["simulate", "--disable-hybrid-kv-cache-manager", "--quiet"], "needs --model"),
    ]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_n_forks_and_reports_the_blocks_it_saves(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    # 30-token prompts, blocks of 4: with fork the 4 samples of a line share 7 full blocks and
    # each holds 3 of its own (19 blocks); without, 4 x 10 = 40.
    trace.write_text('{"prompt_len": 30, "output_len": 8, "n": 4}\n')
    argv = ["simulate", "--trace", str(trace), "--num-blocks", "64", "--block-size", "4"]
    argv += ["--max-model-len", "64", "--policies", "paged", "--quiet"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fork under paged: peak 19 KV blocks with fork vs 40 without" in text
    assert "copy-on-write copies" in text
    out = tmp_path / "out"
    assert main([*argv, "--json", "--out", str(out), "--html", "--no-sweep"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_sequences"] == 4
    assert report["policies"]["paged"]["peak_blocks"] == 19
    assert report["policies"]["paged"]["num_forks"] == 3
    assert report["fork_baseline"]["paged"]["peak_blocks"] == 40
    assert "fork under paged: peak 19 KV blocks" in (out / "index.html").read_text()


def test_n_flag_on_a_built_in_workload(capsys):
    argv = ["simulate", "--workload", "sixteen-lengths", "--n", "2", "--json", "--quiet"]
    assert main([*argv, "--policies", "paged"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_requests"] == 16 and report["num_sequences"] == 32
    # 1 output token each: a sample forks, computes the last prompt token and samples.
    assert report["policies"]["paged"]["num_forks"] == 16
    assert set(report["fork_baseline"]) == {"paged"}
    # Without --n: no baseline run, no fork rows.
    assert main(["simulate", "--workload", "sixteen-lengths", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["fork_baseline"] == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "sixteen-lengths", "--n", "0"], "n must be an int >= 1"),
        (
            [
                "--workload",
                "shared-prefix",
                "--num-requests",
                "4",
                "--n",
                "2",
                "--num-replicas",
                "2",
            ],
            "n > 1",
        ),
    ],
)
def test_bad_n_exits_2(argv, message, capsys):
    assert main(["simulate", "--json", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_kv_tier_turns_multi_turn_misses_into_hits(capsys):
    argv = ["simulate", "--workload", "multi-turn", "--num-requests", "60", "--num-blocks", "150"]
    argv += ["--policies", "paged+prefix,paged+prefix+tier", "--json", "--quiet", "--no-sweep"]
    assert main([*argv, "--kv-offloading-size", "1GiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    off, on = (report["policies"][p] for p in ("paged+prefix", "paged+prefix+tier"))
    # SmolLM2's shape: 30 layers x 16 tokens x (K, V) x 3 heads x 64 x 2 bytes per block
    block_bytes = 30 * 16 * 2 * 3 * 64 * 2
    assert report["config"]["kv_offloading_blocks"] == 2**30 // block_bytes
    assert report["config"]["kv_offloading_bandwidth"] == 16e9  # the cpu backend's default
    assert off["prefix_hit_rate"] < 0.05 and on["prefix_hit_rate"] > 0.5
    assert on["num_scheduled_tokens"] < off["num_scheduled_tokens"]
    assert on["num_tier_hit_tokens"] > 0 and off["num_tier_hit_tokens"] == 0
    assert on["num_recomputed_tokens"] < off["num_recomputed_tokens"]
    assert on["tier_loaded_bytes"] == on["num_tier_loaded_blocks"] * block_bytes
    assert on["tier_load_time_s"] == pytest.approx(on["tier_loaded_bytes"] / 16e9)


def test_kv_tier_table_html_and_bandwidth(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["simulate", "--workload", "multi-turn", "--num-requests", "30", "--num-blocks", "80"]
    argv += ["--max-model-len", "1024", "--block-map-columns", "20", "--quiet", "--no-sweep"]
    argv += ["--kv-offloading-size", "64MiB"]
    assert main([*argv, "--kv-offloading-backend", "disk", "--out", str(out), "--html"]) == 0
    text = capsys.readouterr().out
    config_line = next(line for line in text.splitlines() if line.startswith("workload "))
    tier_line = next(line for line in text.splitlines() if line.startswith("KV tier "))
    assert "loads at 2 GB/s" in tier_line
    for label in ("tier hits", "recomputed", "tier load time (s)", "paged+prefix+tier"):
        assert label in text
    page = (out / "index.html").read_text()
    assert config_line in page and tier_line in page
    assert (out / "prompt_tokens.png").is_file()
    assert main([*argv, "--kv-offloading-bandwidth", "500MB"]) == 0
    assert "loads at 0.5 GB/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "paged+prefix+tier"], "needs --kv-offloading-size"),
        (["--kv-offloading-bandwidth", "1GB"], "needs --kv-offloading-size"),
        (["--kv-offloading-backend", "disk"], "needs --kv-offloading-size"),
        (["--kv-offloading-size", "1GiB", "--num-replicas", "2"], "has no tier"),
        (["--kv-offloading-size", "1GiB", "--policies", "paged"], "add paged+prefix+tier"),
        (["--kv-offloading-size", "1GiB", "--kv-offloading-bandwidth", "fast"], "not a memory"),
    ],
)
def test_bad_tier_flags_exit_2(argv, message, capsys):
    assert main(["simulate", "--workload", "multi-turn", "--quiet", "--json", *argv]) == 2
    assert message in capsys.readouterr().err
