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


def _describe(process) -> tuple[str, list[str]]:
    """(command line, ``host:port`` of each TCP socket it listens on) of a psutil Process;
    ("", []) once it has exited."""
    import psutil

    try:
        sockets = [
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in process.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        return " ".join(process.cmdline()).strip(), sockets
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "", []


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address.rpartition(":")[0].strip("[]"))
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def _alive(processes) -> list:
    import psutil

    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.ray
def test_sigterm_stops_the_cluster_and_leaves_no_process_behind():
    """``pagedkv serve --data-parallel-size 2`` (the default model, local Ray): Ray listens on
    loopback, and after SIGTERM the server exits 0 and no process it or Ray started (the
    replicas, the GCS, the raylet, Ray's dashboard and runtime-env agents) is left."""
    pytest.importorskip("ray", reason="needs pip install 'pagedkv[cluster]'")
    psutil = pytest.importorskip("psutil")
    import signal
    import subprocess
    import time

    import httpx
    from _serve_process import serve_subprocess

    args = ["--data-parallel-size", "2", "--dtype", "float32", "--disable-log-stats"]
    with serve_subprocess(args) as (process, url, output):
        response = httpx.post(
            url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=300
        )
        assert response.status_code == 200, response.text
        server = psutil.Process(process.pid)
        descendants = server.children(recursive=True)
        described = {p.pid: _describe(p) for p in [server, *descendants]}
        commands = [command for command, _ in described.values()]
        assert any("DashboardAgent" in c for c in commands), commands  # what used to be left
        assert sum("PagedKVEngine" in c for c in commands) == 2, commands
        # Ray's own servers listen on loopback (checked last, after the cleanup). Ray Serve 2.60
        # binds each replica's internal gRPC server on [::] (not configurable): its replicas are
        # left out.
        exposed = {
            command: [a for a in sockets if not _is_loopback(a)]
            for command, sockets in described.values()
            if not command.startswith("ray::ServeReplica")
        }
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("pagedkv serve did not exit after SIGTERM:\n" + "".join(output))
        # Ray's processes end with their parents: wait for the last ones (bounded).
        deadline = time.monotonic() + 30
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = _alive(descendants)
        left = [described[p.pid][0] for p in alive]
        for p in alive:  # leave nothing behind, even when the test fails
            p.kill()
        assert not left, left
        assert code == 0, "".join(output)
        assert not any(exposed.values()), exposed


def test_a_cluster_on_every_interface_without_a_key_warns(monkeypatch, caplog):
    """As one engine's server does: a warning at start names the open address (the cluster
    path started Ray without it). Ray itself is not started: init_ray is replaced."""
    pytest.importorskip("ray")
    from pagedkv.cluster import ray_serve

    def interrupted(ray_address=None):
        raise KeyboardInterrupt  # as Ctrl-C right at the start

    monkeypatch.setattr(ray_serve, "init_ray", interrupted)
    monkeypatch.setattr(ray_serve, "stop_cluster", lambda: None)
    argv = ["serve", "--data-parallel-size", "2", "--port", "0", "--host", "0.0.0.0"]
    with caplog.at_level("WARNING", logger="pagedkv"):
        assert main(argv) == 0
        assert main([*argv, "--api-key", "k"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "without --api-key" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("listening on 0.0.0.0 without --api-key")
