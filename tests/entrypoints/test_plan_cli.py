"""`pagedkv plan`: table and JSON output, one-line errors with exit code 2."""

from __future__ import annotations

import json

from pagedkv.entrypoints.cli import main


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_table_for_llama_8b_on_h100(capsys):
    code, out, err = run_plan(
        capsys,
        "Llama-3.1-8B",
        "--device",
        "H100-80GB",
        "--max-model-len",
        "8192",
        "--mean-len",
        "1024",
    )
    assert code == 0 and err == ""
    # Two columns: label, then the value after a run of two or more spaces.
    lines = dict(line.split("  ", 1) for line in out.splitlines())
    lines = {label.strip(): value.strip() for label, value in lines.items()}
    assert lines["bytes per token"] == "131,072 (128.00 KiB)"
    assert lines["bytes per block"] == "2,097,152 (2.00 MiB)"
    assert lines["num_blocks"] == "28,864 (incl. the null block)"
    assert lines["KV tokens"] == "461,808"
    assert lines["max concurrency"].startswith("56 requests at max_model_len")
    assert lines["contiguous"].startswith("56 requests")
    assert lines["at mean len 1,024"] == "paged 450 requests vs contiguous 56"


def test_json_output(capsys):
    code, out, _ = run_plan(
        capsys,
        "Llama-3.1-8B",
        "--device",
        "80GiB",
        "--weight-bytes",
        "15GiB",
        "--activation-bytes",
        "2GiB",
        "--overhead-bytes",
        "1288490188",
        "--max-model-len",
        "8192",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    # 0.9 x 80 GiB - 15 - 2 - 1.2 GiB = 53.8 GiB -> 27,545 blocks of 2 MiB.
    assert data["num_blocks"] == 27_545
    assert data["bytes_per_block"] == 2 * 1024 * 1024
    assert data["max_concurrency"] == 27_544 // 512 == 53
    assert data["weight_source"] == "given"


def test_fp8_and_tensor_parallel_flags(capsys):
    _, out, _ = run_plan(
        capsys,
        "Llama-3.1-8B",
        "--max-model-len",
        "8192",
        "--kv-cache-dtype",
        "fp8",
        "-tp",
        "2",
        "--json",
    )
    data = json.loads(out)
    assert data["kv_cache_dtype"] == "fp8"
    assert data["num_kv_heads_per_device"] == 4
    assert data["bytes_per_token"] == 32 * 2 * 4 * 128 * 1


def test_errors_are_one_line_with_choices(capsys):
    for args, expected in [
        (["nope"], "unknown model 'nope'; choose one of SmolLM2-135M, Llama-3.1-8B"),
        (["Llama-3.1-8B", "--device", "TPU"], "unknown device 'TPU'; choose one of H100-80GB"),
        (["Llama-3.1-8B", "--kv-cache-dtype", "int4"], "choose one of auto, float32"),
        (["Llama-3.1-8B", "--device", "L4"], "largest max_model_len that fits is 40432 tokens"),
        (["SmolLM2-135M", "-tp", "2"], "choose one of 1, 3\n"),
        (["Llama-3.1-8B", "--weight-bytes", "heavy"], "not a memory size: 'heavy'"),
    ]:
        code, out, err = run_plan(capsys, *args)
        assert code == 2, args
        assert out == ""
        assert err.count("\n") == 1, err
        assert err.startswith("pagedkv plan: error: ") and expected in err, err
