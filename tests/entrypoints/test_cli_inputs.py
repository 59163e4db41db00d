"""The generate / bench command lines: prompt files and engine flags (no model needed)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.bench import DEFAULT_WORKLOAD
from pagedkv.entrypoints.cli import build_parser
from pagedkv.entrypoints.generate import load_prompts
from pagedkv.errors import ConfigError, InvalidRequestError


def test_load_prompts_accepts_every_documented_shape(tmp_path):
    path = tmp_path / "p.jsonl"
    messages = [{"role": "user", "content": "hi"}]
    lines = [
        '"a question"',
        '{"prompt": "raw", "max_tokens": 5}',
        json.dumps({"messages": messages}),
        "",
        json.dumps(messages),
    ]
    path.write_text("\n".join(lines) + "\n")
    assert load_prompts(path) == [
        ([{"role": "user", "content": "a question"}], None),
        ("raw", 5),
        (messages, None),
        (messages, None),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "nope",
        '{"text": "x"}',
        "[1, 2]",
        '{"prompt": 3}',
        '[{"role": "wizard", "content": "hi"}]',
    ],
)
def test_load_prompts_names_the_bad_line(tmp_path, line):
    path = tmp_path / "p.jsonl"
    path.write_text('"fine"\n' + line + "\n")
    with pytest.raises(InvalidRequestError, match=":2:"):
        load_prompts(path)


def test_load_prompts_unreadable_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="cannot read prompt file"):
        load_prompts(tmp_path / "missing.jsonl")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('"caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(InvalidRequestError, match="cannot read prompt file"):
        load_prompts(latin1)


def test_engine_flags_round_trip():
    args = build_parser().parse_args(
        [
            "generate",
            "q",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "512MiB",
            "--max-num-seqs",
            "8",
            "--no-prefix-caching",
            "--policy",
            "priority",
        ]
    )
    config = EngineConfig.from_cli_args(args)
    assert config.dtype == "float32" and config.kv_cache_memory == 512 << 20
    assert config.max_num_seqs == 8 and not config.enable_prefix_caching
    assert config.policy == "priority" and config.enable_chunked_prefill
    with pytest.raises(ConfigError):
        EngineConfig(dtype="int8")
    with pytest.raises(argparse.ArgumentTypeError):
        from pagedkv.engine.config import _parse_bytes

        _parse_bytes("12 parsecs")


@pytest.mark.parametrize(("text", "num_bytes"), [("1G", 1 << 30), ("512MiB", 512 << 20)])
def test_kv_cache_memory_takes_the_sizes_plan_takes(text, num_bytes):
    from pagedkv.units import parse_memory_size

    args = build_parser().parse_args(["generate", "--kv-cache-memory", text])
    assert args.kv_cache_memory == num_bytes == parse_memory_size(text)


@pytest.mark.parametrize("num_blocks", [-3, 1])
def test_num_blocks_message_names_the_null_block(num_blocks):
    with pytest.raises(ConfigError, match=r">= 2 \(block 0 is the null block\)"):
        EngineConfig(num_blocks=num_blocks)


def test_committed_workload_has_64_chats():
    conversations = load_prompts(DEFAULT_WORKLOAD)
    assert len(conversations) == 64
    assert all(isinstance(c, list) and c[0]["role"] == "user" for c, _ in conversations)


@pytest.mark.parametrize(
    "flags", [["--num-prompts", "-1"], ["--num-prompts", "0"], ["--hf-batch-size", "0"]]
)
def test_bench_counts_below_one_fail_while_parsing(flags, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", *flags])
    assert "must be an int >= 1" in capsys.readouterr().err


def test_base_model_prompts_are_plain_text():
    """A model without a chat template completes text: single user messages become their text,
    --demo's chat questions become completion prompts, conversations are refused."""
    from pagedkv.entrypoints.generate import (
        DEMO_COMPLETION_PROMPTS,
        DEMO_PROMPTS,
        as_completion_prompts,
    )

    demo = [([{"role": "user", "content": p}], None) for p in DEMO_PROMPTS]
    items = [([{"role": "user", "content": "Paging is"}], 5), ("raw text", None)]
    converted = as_completion_prompts(demo + items, demo=True)
    assert converted == [(p, None) for p in DEMO_COMPLETION_PROMPTS] + [
        ("Paging is", 5),
        ("raw text", None),
    ]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequestError, match=r"no chat template.*2 messages"):
        as_completion_prompts([(conversation, None)], demo=False)


@pytest.mark.parametrize(
    "argv, prog, unknown",
    [
        (
            ["plan", "SmolLM2-135M", "--kv-cache-memory", "1GiB"],
            "pagedkv plan",
            "--kv-cache-memory 1GiB",
        ),
        (["bench", "latency", "--bogus"], "pagedkv bench latency", "--bogus"),
        (["simulate", "--bogus", "1"], "pagedkv simulate", "--bogus 1"),
    ],
)
def test_unknown_flags_are_reported_by_the_subcommand(argv, prog, unknown, capsys):
    """The usage line and the error name the subcommand the user typed, not `pagedkv`."""
    from pagedkv.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: unrecognized arguments: {unknown}" in err
    assert f"usage: {prog}" in err


def test_serve_port_out_of_range_is_a_usage_error(capsys):
    from pagedkv.entrypoints.cli import main

    assert main(["serve", "--port", "99999"]) == 2
    assert "pagedkv serve: error: --port must be in 0..65535, got 99999" in capsys.readouterr().err


def test_serve_logs_its_engine_start_up_at_the_log_level(monkeypatch, caplog):
    """The engine's start-up lines (which attention backend runs, and why) reach serve's log:
    its handler and level are set before the engine is built."""
    import logging

    from pagedkv.entrypoints.cli import main

    package = logging.getLogger("pagedkv")
    monkeypatch.setattr(package, "level", package.level)
    monkeypatch.setattr(package, "handlers", list(package.handlers))

    def engine_start(config):
        logging.getLogger("pagedkv.engine.attention_backend").info("attention backend torch")
        raise ConfigError("stop after start-up")

    monkeypatch.setattr("pagedkv.engine.llm_engine.LLMEngine", engine_start)
    assert main(["serve", "--port", "0", "--log-level", "info"]) == 2
    assert "attention backend torch" in caplog.messages


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "hi", "--block-size", "0"], "--block-size"),
        (["serve", "--max-num-seqs", "-3"], "--max-num-seqs"),
        (["generate", "hi", "-tp", "0"], "--tensor-parallel-size/-tp"),
        (["plan", "SmolLM2-135M", "-tp", "0"], "--tensor-parallel-size/-tp"),
        (["bench", "throughput", "--num-threads", "x"], "--num-threads"),
    ],
)
def test_count_flags_below_one_fail_while_parsing(argv, flag, capsys):
    from pagedkv.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"error: argument {flag}: must be an int >= 1, got" in capsys.readouterr().err
