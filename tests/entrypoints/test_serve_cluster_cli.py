"""`pagedkv serve --data-parallel-size N`: clear errors before anything loads (the Ray cluster
itself is tested in tests/cluster/test_ray_serve.py)."""

from __future__ import annotations

import sys

import pytest

from pagedkv.entrypoints.cli import main


def test_without_the_cluster_extra_the_error_names_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    # An earlier test may have imported the Ray modules: the modules, or the packages'
    # attributes, would satisfy the imports.
    import pagedkv.cluster
    import pagedkv.entrypoints.cluster

    for package, name in [
        (pagedkv.cluster, "ray_serve"),
        (pagedkv.entrypoints.cluster, "ray_ingress"),
    ]:
        monkeypatch.delitem(sys.modules, f"{package.__name__}.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    code = main(["serve", "--data-parallel-size", "2", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install 'pagedkv[cluster]'" in err and "ray" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["--router", "prefix"], "--router needs --data-parallel-size > 1"),
        (["--hash-seed", "7"], "--hash-seed needs --data-parallel-size > 1"),
        (["--ray-address", "auto"], "--ray-address needs --data-parallel-size > 1"),
    ],
)
def test_cluster_flags_without_replicas_are_refused(args, message, capsys):
    assert main(["serve", "--port", "0", *args]) == 2
    assert f"pagedkv serve: error: {message}" in capsys.readouterr().err


def test_unknown_router_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--data-parallel-size", "2", "--router", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_data_parallel_with_tensor_parallel_is_refused(capsys):
    argv = ["serve", "--port", "0", "--data-parallel-size", "2", "--tensor-parallel-size", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pagedkv serve: error: --data-parallel-size with --tensor-parallel-size" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(command, capsys):
    # SmolLM2-135M (the default model) has 9 attention heads; refused from the GGUF header,
    # before any weight loads or any process starts.
    extra = ["hello"] if command == "generate" else ["--port", "0"]
    assert main([command, "--tensor-parallel-size", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in err
