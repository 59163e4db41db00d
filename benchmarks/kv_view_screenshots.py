"""The screenshots of the /kv page in docs/server.md: under load, and with the KV tier on.

    .venv/bin/python benchmarks/kv_view_screenshots.py [--out docs/img]

Each one starts `pagedkv serve` on the default model, opens /kv in headless chromium (Debian's
``chromium``, through Playwright), sends 64 streamed completions in 8 groups that share a prefix
(each group's prefix of about 130 tokens, then about 12 of the request's own), waits until the
page shows the state worth showing, and saves a PNG:

- ``kv_view_load.png``: 64 requests, 1,024 blocks of 16 tokens; shot while at least 24 requests
  run at once.
- ``kv_view_tier.png``: a pool too small for the load (160 blocks) over a 64 MiB CPU tier, so
  that cached blocks are evicted, page out to the tier and come back as tier hits; shot once the
  tier holds blocks and requests are running.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]


def serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--port", "0", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "listening on " in line:
            url = line.strip().rsplit(" ", 1)[-1]
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, url
    raise RuntimeError("pagedkv serve did not start")


def load(url: str, model: str, num_requests: int = 64, max_tokens: int = 48) -> None:
    def one(i: int) -> None:
        group = i % 8
        prefix = f"Group {group}: " + "the block table maps logical blocks to physical ones. " * 12
        body = {
            "model": model,
            "prompt": prefix + f"Request {i} asks about paging number {i * 7}.",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
            for _ in response.iter_lines():
                pass

    with ThreadPoolExecutor(num_requests) as pool:
        list(pool.map(one, range(num_requests)))


def shoot(serve_args: list[str], condition: str, path: Path) -> None:
    process, url = serve(["--dtype", "float32", "--disable-log-stats", *serve_args])
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # warm the prefix cache a little so the hit rate shows
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"))
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(url + "/kv")
            page.wait_for_selector("body[data-renders]")
            thread = threading.Thread(target=load, args=(url, model), daemon=True)
            thread.start()
            page.wait_for_function(
                f"() => {{ const s = window.kvView.snapshot; return !!s && ({condition}); }}",
                timeout=600_000,
            )
            # light the first request's blocks, as a reader would by hovering it
            page.hover("#requests tr.req")
            page.screenshot(path=str(path))
            browser.close()
            thread.join()
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--only", choices=("load", "tier"), default=None, help="one picture")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    running = "s.requests.filter(r => r.status === 'running').length"
    if args.only != "tier":
        shoot(
            ["--num-blocks", "1024", "--block-size", "16", "--max-num-seqs", "64"],
            f"{running} >= 24 && s.stats.num_shared_blocks > 0",
            out / "kv_view_load.png",
        )
    if args.only != "load":
        shoot(
            [
                "--num-blocks",
                "160",
                "--block-size",
                "16",
                "--max-num-seqs",
                "64",
                "--kv-offloading-size",
                "64MiB",
                "--max-model-len",
                "1024",
            ],
            f"s.kv_tier && s.kv_tier.num_used_blocks > 0 && {running} >= 4",
            out / "kv_view_tier.png",
        )


if __name__ == "__main__":
    main()
