"""Encode + decode of one KV-event batch (:mod:`pagedkv.cluster.kv_events`): microseconds per
batch of ``--num-events`` BlockStored events (default 1,000; each one block of 16 tokens, sha256
hashes chained), best of ``--repeat`` timings of ``--number`` calls each.

``--against REV`` also times the kv_events module of git revision REV (loaded from ``git show``,
at its path then, in this process, on the same events) and checks that each reads the other's
bytes back as the same events: how the issue-23 msgspec codec was compared with the hand-packed
msgpack one (which needs the msgpack package; Ray installs it).

    .venv/bin/python benchmarks/bench_kv_events.py
    .venv/bin/python benchmarks/bench_kv_events.py --against 750adb8   # the msgpack codec
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from types import ModuleType

from pagedkv.cluster import kv_events
from pagedkv.core.events import BlockStored

ROOT = Path(__file__).resolve().parents[1]
#: Where kv_events.py was at some point of the history (newest first).
MODULE_PATHS = ("src/pagedkv/cluster/kv_events.py", "src/pagedkv/engine/kv_events.py")


def make_events(num_events: int, block_size: int) -> tuple[BlockStored, ...]:
    """``num_events`` BlockStored of one block each, a chain of sha256 digests."""
    events, parent = [], None
    for i in range(num_events):
        block_hash = hashlib.sha256((parent or b"root") + i.to_bytes(8, "little")).digest()
        token_ids = tuple(range(i * block_size, (i + 1) * block_size))
        events.append(BlockStored((block_hash,), parent, token_ids, block_size))
        parent = block_hash
    return tuple(events)


def load_revision(rev: str) -> ModuleType:
    """kv_events.py as of git revision ``rev``, imported under another name."""
    for path in MODULE_PATHS:
        shown = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, check=False
        )
        if shown.returncode == 0:
            break
    else:
        sys.exit(f"no kv_events.py at {rev} (looked at {', '.join(MODULE_PATHS)})")
    name = f"kv_events_at_{rev}".replace("-", "_").replace(".", "_")
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"{name}.py"
        file.write_bytes(shown.stdout)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def time_codec(module: ModuleType, events: list, number: int, repeat: int) -> dict[str, float]:
    """Best microseconds per call of encode_batch, decode_batch and both."""
    payload = module.encode_batch(events, ts=1.0, data_parallel_rank=0)

    def best(stmt) -> float:
        return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e6

    encode = best(lambda: module.encode_batch(events, ts=1.0, data_parallel_rank=0))
    decode = best(lambda: module.decode_batch(payload))
    return {"encode_us": encode, "decode_us": decode, "total_us": encode + decode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-events", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--number", type=int, default=20, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings (the best is kept)")
    parser.add_argument("--against", metavar="REV", help="also time kv_events.py of git REV")
    args = parser.parse_args(argv)
    if min(args.num_events, args.block_size, args.number, args.repeat) < 1:
        parser.error("--num-events, --block-size, --number and --repeat must be >= 1")

    events = make_events(args.num_events, args.block_size)
    codecs = {"this tree": kv_events}
    if args.against:
        codecs[args.against] = load_revision(args.against)
        old = codecs[args.against]
        ours = kv_events.encode_batch(events, ts=1.0, data_parallel_rank=0)
        theirs = old.encode_batch(events, ts=1.0, data_parallel_rank=0)
        if not kv_events.decode_batch(theirs).events == old.decode_batch(ours).events == events:
            sys.exit("the codecs do not read each other's bytes back as the events")
        print(
            f"each codec reads the other's batch back as the events; {len(ours):,} bytes "
            f"({args.against}: {len(theirs):,})"
        )
    print(
        f"{args.num_events} BlockStored events x 1 block of {args.block_size} tokens, "
        f"best of {args.repeat} x {args.number} calls (us per batch)"
    )
    print(f"{'codec':>12} {'encode':>9} {'decode':>9} {'total':>9}")
    for name, module in codecs.items():
        t = time_codec(module, events, args.number, args.repeat)
        print(f"{name:>12} {t['encode_us']:9.0f} {t['decode_us']:9.0f} {t['total_us']:9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
