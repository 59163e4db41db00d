"""What the command line takes as a model (issue 34): ``pagedkv serve MODEL`` (vLLM's shape),
``--model`` / ``-m`` (llama.cpp's) on every subcommand that loads one, the packaged models'
short names, and Hugging Face ids from the local Hugging Face cache."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from _hf_hub_model import write_hub_model
from _serve_process import serve_process

from pagedkv.entrypoints.cli import build_parser, main
from pagedkv.errors import ConfigError, ModelLoadError
from pagedkv.model.loader import resolve_model
from pagedkv.model.packaged_models import CACHE_DIR_ENV, GEMMA3_270M_FILE


@pytest.fixture
def started(monkeypatch):
    """The config each ``pagedkv serve`` passes its engine; the engine stops the run there."""
    configs = []

    def engine_start(config):
        configs.append(config)
        raise ConfigError("stop after start-up")

    monkeypatch.setattr("pagedkv.engine.llm_engine.LLMEngine", engine_start)
    return configs


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    """Both packaged models resolvable without their real weights: smollm2 from its package
    (skipped when missing), gemma3-270m from a placeholder already in the cache folder."""
    try:
        smollm2 = resolve_model("smollm2").path
    except ModelLoadError as e:
        pytest.skip(str(e))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    (tmp_path / GEMMA3_270M_FILE).write_bytes(b"GGUF")
    return {"smollm2": smollm2, "gemma3-270m": tmp_path / GEMMA3_270M_FILE}


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
@pytest.mark.parametrize("shape", [[], ["--model"], ["-m"]])
def test_serve_takes_the_model_positionally_or_by_flag(name, shape, packaged, started):
    assert main(["serve", *shape, name, "--port", "0"]) == 2  # stopped at the engine
    assert started[-1].model == str(packaged[name])  # resolved once, before the engine


def test_serve_refuses_two_different_models(started, capsys):
    assert main(["serve", "smollm2", "--model", "gemma3-270m", "--port", "0"]) == 2
    assert "given twice" in capsys.readouterr().err and not started
    with pytest.raises(SystemExit):  # a second positional is not a model
        main(["serve", "smollm2", "gemma3-270m"])
    assert "unrecognized arguments: gemma3-270m" in capsys.readouterr().err


def test_an_unknown_model_lists_the_short_names(started, capsys):
    assert main(["serve", "no-such-model-here", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-model-here' does not exist" in err and "smollm2, gemma3-270m" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi"],
        ["serve"],
        ["bench", "throughput"],
        ["bench", "latency"],
        ["bench", "serving"],
        ["simulate"],
    ],
)
def test_every_model_flag_has_llama_cpps_short_form(argv):
    assert build_parser().parse_args([*argv, "-m", "gemma3-270m"]).model == "gemma3-270m"


@pytest.mark.parametrize("argv", [["serve"], ["generate"], ["bench", "throughput"]])
def test_help_lists_the_short_names(argv, capsys):
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    assert "smollm2, gemma3-270m" in " ".join(capsys.readouterr().out.split())


def test_plan_and_simulate_know_the_short_names(capsys):
    assert main(["plan", "smollm2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "SmolLM2-135M"
    assert main(["simulate", "-m", "smollm2", "--num-requests", "4", "--json"]) == 0


def test_serve_a_hugging_face_id_from_the_local_cache(tmp_path):
    """A new process finds the model through HF_HOME alone (offline) and serves it under its
    id, as vLLM does."""
    hub = write_hub_model(tmp_path / "hf")
    env = os.environ | {"HF_HOME": str(hub.hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    args = [hub.repo_id, "--dtype", "float32", "--disable-log-stats"]
    with serve_process(args, env=env) as (url, _):
        with urllib.request.urlopen(f"{url}/v1/models") as response:
            models = json.load(response)["data"]
        assert [m["id"] for m in models] == [hub.repo_id]
        body = json.dumps({"model": hub.repo_id, "prompt": "w5 w7", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request) as response:
            assert json.load(response)["usage"]["completion_tokens"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_serve_a_packaged_model_by_its_short_name(name):
    try:
        path = resolve_model(name).path
    except ModelLoadError as e:
        pytest.skip(str(e))
    with serve_process([name, "--disable-log-stats"]) as (url, output):
        with urllib.request.urlopen(f"{url}/v1/models") as response:
            ids = [m["id"] for m in json.load(response)["data"]]
        # served as typed (as `vllm serve NAME`), the file's own name kept as an alias
        assert ids == [name, path.stem]
        assert any(f"pagedkv serve: {name} listening on" in line for line in output)
        for model in ids:
            body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
            request = urllib.request.Request(
                f"{url}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request) as response:
                assert json.load(response)["model"] == name  # the first name is reported
