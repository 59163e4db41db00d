"""The layer contract (.importlinter, checked by `lint-imports` in make test) covers every
package, and docs/design.md draws exactly its layers and maps exactly its packages."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def contract_layers() -> list[list[str]]:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    lines = config["importlinter:contract:layers"]["layers"].splitlines()
    return [[m.strip() for m in line.split("|")] for line in lines if line.strip()]


def top_level_modules() -> set[str]:
    src = ROOT / "src" / "pagedkv"
    names = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in src.iterdir() if (p / "__init__.py").is_file()}
    return {f"pagedkv.{name}" for name in names}


def test_every_package_and_module_is_in_a_layer():
    layered = {m for layer in contract_layers() for m in layer}
    assert layered == top_level_modules()


def test_design_md_draws_the_contract():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    drawn = [
        [m.strip() for m in line[4:].split("   ")[0].split("|")]
        for line in section.splitlines()
        if re.match(r"    [a-z]", line)
    ]
    assert drawn == [[m.removeprefix("pagedkv.") for m in layer] for layer in contract_layers()]


def test_design_md_maps_every_package():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Package map", 1)[1].split("\n## ", 1)[0]
    mapped = set(re.findall(r"^\| `(pagedkv\.[a-z_]+)` \|", section, flags=re.MULTILINE))
    assert mapped == top_level_modules()


def test_design_md_names_every_module():
    """Issue 48: the package map names every module, C source and page template in its
    package's row (``name.py``, or the module's name in backticks), so a reader finds every
    file's job."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Package map", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(pagedkv\.[a-z_]+)` \|(.*)$", section, flags=re.MULTILINE))
    src = ROOT / "src" / "pagedkv"
    unnamed = []
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".py", ".c", ".h", ".html", ".j2") or path.name == "__init__.py":
            continue
        parts = path.relative_to(src).parts
        if len(parts) == 1:
            continue  # a top-level module: its own row (test_design_md_maps_every_package)
        row = rows.get(f"pagedkv.{parts[0]}", "")
        if path.name not in row and f"`{path.stem}`" not in row:
            unnamed.append(str(path.relative_to(src)))
    assert unnamed == []


def test_modelinfo_imports_neither_torch_nor_numpy():
    """The planner's model shapes load where no torch is installed (checked in a fresh
    interpreter: this one has torch loaded already)."""
    import subprocess
    import sys

    code = (
        "import sys, pagedkv.modelinfo.shape; "
        "print(any(m in sys.modules for m in ('torch', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_cluster_library_left_the_core_the_engine_and_the_entrypoints():
    """Issue 23: the cluster's library is `pagedkv.cluster` (between engine and entrypoints), the
    engine loop is the engine's, and no shim stays at an old path (each would be a second way in
    past the layer contract)."""
    src = ROOT / "src" / "pagedkv"
    old_paths = [
        "core/prefix_index.py",
        "engine/kv_events.py",
        "entrypoints/openai/engine_loop.py",
        *(f"entrypoints/cluster/{m}.py" for m in ("router", "replica", "ray_serve", "local")),
        "entrypoints/cluster/protocol.py",
    ]
    assert [p for p in old_paths if (src / p).exists()] == []
    # What stays in entrypoints/cluster is the command's: the HTTP front end, the Ray Serve
    # ingress, and the process around Ray (loopback, SIGTERM).
    http_side = {p.stem for p in (src / "entrypoints" / "cluster").glob("*.py")}
    assert http_side == {"__init__", "frontend", "ray_ingress", "ray_process"}
