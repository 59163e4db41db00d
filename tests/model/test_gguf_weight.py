"""GGUF weights kept as the file stores them: the products on their blocks, the loader that maps
the file, and the memory rule (a model's resident weights are about its file's size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from _gguf_files import mapping_of

from pagedkv.errors import ConfigError, ModelLoadError
from pagedkv.model import gguf_loader, loader
from pagedkv.model.gguf_loader import MMAP_ENV, WeightArena, hf_name, load_gguf, stored_types
from pagedkv.model.gguf_metadata import read_gguf_header
from pagedkv.model.gguf_weight import GGUFMatmul, GGUFWeight
from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def kernels():
    """The process's kernels with fp32 activations (``PAGEDKV_GGUF_ACTIVATIONS=fp32``, not
    the int8 default): these tests hold the products to the dequantized weights'."""
    from pagedkv.model.kernels.cpu_quant import ACTIVATIONS_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ACTIVATIONS_ENV, "fp32")
        found = default_cpu_quant_kernels()
    if found is None:
        pytest.skip("pagedkv's CPU kernels do not run here")
    return found


@pytest.fixture(scope="module")
def stored(gguf_path, kernels):
    """SmolLM2's checkpoint with its 2-D weights kept as stored (Q4_1 linears, Q8_0
    embedding; read into the weight arena: ``PAGEDKV_GGUF_MMAP=0``, whatever the page cache
    holds) and the same file dequantized."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MMAP_ENV, "0")
        return load_gguf(gguf_path, quantized=True, kernels=kernels), load_gguf(gguf_path)


def test_every_2d_weight_stays_as_stored(stored):
    kept, dense = stored
    assert set(kept.state_dict) == set(dense.state_dict)
    for name, weight in kept.state_dict.items():
        if dense.state_dict[name].dim() == 2:
            assert isinstance(weight, GGUFWeight), name
            assert torch.equal(weight.dequantize(), dense.state_dict[name]), name
        else:
            assert torch.equal(weight, dense.state_dict[name]), name
    assert stored_types(kept.state_dict) == {"Q4_1": 210, "Q8_0": 1}


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_match_the_dequantized_weights(stored, num_tokens, dtype):
    """Small steps (the blocks read in registers) and large ones (tiles dequantized, then
    torch's GEMM) give the dequantized weights' product; q, k and v stacked as three parts."""
    kept, dense = stored
    prefix = "model.layers.3.self_attn."
    parts = [kept.state_dict[f"{prefix}{p}_proj.weight"].with_(dtype=dtype) for p in "qkv"]
    product = GGUFMatmul(parts)
    reference = torch.cat([dense.state_dict[f"{prefix}{p}_proj.weight"] for p in "qkv"])
    x = torch.randn(num_tokens, reference.shape[1], generator=torch.Generator().manual_seed(0))
    got = product(x.to(dtype))
    assert got.dtype == dtype and got.shape == (num_tokens, reference.shape[0])
    expected = x.to(dtype).double() @ reference.double().T
    scale = expected.abs().max().item()
    # fp32: summation order; bf16 large steps: the tile and the activations rounded to bf16
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - expected).abs().max().item() <= tolerance * scale


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux's /proc/self/maps")
def test_weights_a_step_reads_whole_are_read_into_anonymous_memory(stored, gguf_path):
    """Every kept weight but a lookup-only embedding is a copy of the file's bytes in the
    weight arena (anonymous memory, not the mapped file: a decode step reads it faster there);
    q / k rows reordered in place; the bytes otherwise the file's own."""
    kept, _ = stored
    file_bytes = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    header = read_gguf_header(gguf_path)
    offsets = {hf_name(info.name): info.offset for info in header.tensors}
    for name, weight in kept.state_dict.items():
        if not isinstance(weight, GGUFWeight):
            continue
        # SmolLM2's embedding is its LM head too: every weight in anonymous memory
        assert mapping_of(weight.data.data_ptr()) == "", name
        assert weight.data.data_ptr() % WeightArena.ALIGN == 0, name
        raw = file_bytes[offsets[name] : offsets[name] + weight.data.numel()]
        if ".q_proj." in name or ".k_proj." in name:  # the same rows, reordered
            assert sorted(map(bytes, weight.data.numpy())) == sorted(
                map(bytes, raw.reshape(weight.data.shape))
            ), name
        else:
            assert np.array_equal(weight.data.numpy().reshape(-1), raw), name


@pytest.mark.parametrize("num_threads", [1, 3])
def test_weight_arena_reads_the_file_and_refuses_what_it_cannot(tmp_path, monkeypatch, num_threads):
    path = tmp_path / "bytes.bin"
    payload = np.arange(10_000, dtype=np.uint32).view(np.uint8)
    path.write_bytes(payload.tobytes())
    monkeypatch.setattr(WeightArena, "CHUNK", 1000)  # extents read in several chunks
    first, second, empty = WeightArena(
        path, [(100, 5000), (33_000, 7000), (0, 0)], num_threads=num_threads
    ).tensors
    assert np.array_equal(first.numpy(), payload[100:5100])
    assert np.array_equal(second.numpy(), payload[33_000:40_000])
    assert empty.numel() == 0
    assert first.data_ptr() % (2 << 20) == 0 and second.data_ptr() - first.data_ptr() == 8192
    assert WeightArena(path, []).tensors == []
    assert [t.numel() for t in WeightArena(path, [(5, 0)]).tensors] == [0]
    with pytest.raises(ModelLoadError, match=r"^\S+ ends inside a tensor at byte 40000$"):
        WeightArena(path, [(38_000, 5000)], num_threads=num_threads)
    with pytest.raises(ModelLoadError, match="cannot read"):
        WeightArena(tmp_path / "missing.bin", [(0, 10)], num_threads=num_threads)


def test_weight_arena_reports_memory_the_system_refuses(tmp_path, monkeypatch):
    import mmap

    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(100))

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(ModelLoadError, match=r"cannot hold the weights .* 4\.00 KiB"):
        WeightArena(path, [(0, 100)])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux's /proc/self/maps")
@pytest.mark.parametrize(
    ("setting", "huge_share", "read_back", "in_place"),
    [("1", 0.0, None, True), ("0", 1.0, None, False), (None, 1.0, None, True),
     (None, 0.85, None, True), (None, (0.85, 0.75), None, False),
     (None, 0.75, (0.75, "fast"), False), (None, 0.0, (1.0, "fast"), True),
     (None, 0.0, (1.0, "slow"), False), (None, None, None, False)],
)  # fmt: skip
def test_where_the_weights_are_computed_on(
    stored, gguf_path, kernels, monkeypatch, setting, huge_share, read_back, in_place
):
    """PAGEDKV_GGUF_MMAP=1, or unset where the page cache maps at least IN_PLACE_SHARE of the
    file with 2 MiB pages: every kept weight a view of the mapped file (processes mapping it
    share its pages) but the q / k rows llama's rotary reorders (read into anonymous memory
    and reordered there: the mapping is read-only); =0, or unset with less in 2 MiB pages:
    every kept weight read into anonymous memory (and what was faulted in to decide it
    released). Unset with the sample in smaller pages: the sample dropped from the page cache
    and read back; where it comes back in 2 MiB pages (``read_back``'s share) fast enough, the
    whole file dropped and read back, in place; else the copy. The same values every way."""
    copied = stored[0].state_dict  # read into the arena (PAGEDKV_GGUF_MMAP=0)
    # the share of what was last faulted in (the sample, or the whole file: a pair gives each)
    # that the page cache maps with 2 MiB pages; None: the page size cannot be read (not
    # Linux): the copy
    share = {"now": huge_share, "faulted": None}

    def huge_mapped_bytes(mapped):
        if share["now"] is None:
            return None
        ranges = share["faulted"]
        whole = ranges is None
        extent = mapped.shape[0] if whole else sum(length for _, length in ranges)
        now = share["now"]
        return int((now if isinstance(now, float) else now[whole]) * extent)

    monkeypatch.setattr(gguf_loader, "huge_mapped_bytes", huge_mapped_bytes)
    dropped = []

    def drop(path, ranges=None):
        assert os.path.samefile(path, gguf_path)
        dropped.append(ranges)
        if read_back is not None:  # what reads back after the sample is dropped
            share["now"] = read_back[0]

    monkeypatch.setattr(gguf_loader, "drop_cached_pages", drop)
    if read_back is not None:
        rate = 0 if read_back[1] == "fast" else float("inf")
        monkeypatch.setattr(gguf_loader, "READ_BACK_MIN_RATE", rate)
    released = []
    real_release = gguf_loader.release_mapped_pages
    monkeypatch.setattr(
        gguf_loader,
        "release_mapped_pages",
        lambda mapped: (released.append(mapped.shape[0]), real_release(mapped)),
    )
    populated = []
    real_populate = gguf_loader.populate_mapped_pages
    monkeypatch.setattr(
        gguf_loader,
        "populate_mapped_pages",
        lambda mapped, ranges=None: (
            populated.append(ranges),
            share.update(faulted=ranges),
            real_populate(mapped, ranges),
        ),
    )
    if setting is None:
        monkeypatch.delenv(MMAP_ENV, raising=False)
    else:
        monkeypatch.setenv(MMAP_ENV, setting)
    sampled_at = []  # on_sampled: once, after the sample's reads, before the whole file's
    kept = load_gguf(
        gguf_path,
        quantized=True,
        kernels=kernels,
        on_sampled=lambda: sampled_at.append(len(populated)),
    ).state_dict
    assert len(sampled_at) == 1
    if setting is None:
        assert populated[sampled_at[0] :] in ([], [None])
    weights = {n: w for n, w in kept.items() if isinstance(w, GGUFWeight)}
    reordered = {n for n in weights if ".q_proj." in n or ".k_proj." in n}
    assert reordered and len(weights) > len(reordered)
    for name, weight in weights.items():
        on_file = mapping_of(weight.data.data_ptr()) == os.path.realpath(gguf_path)
        assert on_file == (in_place and name not in reordered), name
        assert torch.equal(weight.data, copied[name].data), name
    # what was faulted in released where the weights are copied; before a sample is read
    # back; and a sample that read back slowly, before it is dropped again
    tried = read_back is not None
    probed = tried and read_back[0] >= gguf_loader.IN_PLACE_SHARE  # the first window passed
    slow = probed and read_back[1] == "slow"
    mixed = isinstance(huge_share, tuple)  # the sample passed, the whole file did not
    copied_after = not in_place and setting != "0"
    assert len(released) == copied_after + tried + slow + mixed
    if setting is None:  # a sample of 2 MiB windows first
        windows = populated[0]
        assert 1 <= len(windows) <= gguf_loader.SAMPLE_WINDOWS
        assert all(start % (2 << 20) == 0 and length <= 2 << 20 for start, length in windows)
        # read back: the first window alone, then the rest where it came back in 2 MiB
        # pages; then the whole file dropped where the sample read back fast, the sample
        # dropped again where slowly
        first, rest = windows[:1], windows[1:]
        back = ([first] if tried else []) + ([rest] if probed else [])
        assert dropped == back + ([windows] if slow or mixed else [None] if probed else [])
        # the whole file faulted in only where the sample passed
        whole = in_place or isinstance(huge_share, tuple)
        assert populated[1:] == back + ([None] if whole else [])
    else:
        assert populated == ([None] if setting == "1" else []) and dropped == []


def test_a_bad_pagedkv_gguf_mmap_is_refused(gguf_path, kernels, monkeypatch, tmp_path):
    """Before anything is read: a missing file gets the same error."""
    monkeypatch.setenv(MMAP_ENV, "yes")
    for path, quantized in ((gguf_path, True), (gguf_path, False), (tmp_path / "no.gguf", True)):
        with pytest.raises(ConfigError, match=MMAP_ENV):
            load_gguf(path, quantized=quantized, kernels=kernels)


def test_embedding_lookup_equals_the_dequantized_rows(stored):
    kept, dense = stored
    table = kept.state_dict["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5], [49151, 17]])
    assert torch.equal(table.lookup(ids), dense.state_dict["model.embed_tokens.weight"][ids])


def test_stacked_parts_must_agree(stored):
    kept, _ = stored
    q = kept.state_dict["model.layers.0.self_attn.q_proj.weight"]
    down = kept.state_dict["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ConfigError, match="in_features"):
        GGUFMatmul([q, down])
    with pytest.raises(ConfigError, match="no kernels"):
        GGUFMatmul([q.with_(kernels=None)])
    with pytest.raises(ConfigError, match="uint8"):
        GGUFWeight("Q4_1", q.data[:, :-1], q.shape)


def test_a_model_that_cannot_fit_is_refused_before_loading(gguf_path, monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda: 50 << 20)
    with pytest.raises(ModelLoadError, match=r"needs about .* but only 50\.00 MiB"):
        loader.load_model(gguf_path, quantization="none")


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from pagedkv.model.loader import load_model, resolve_model_path
    from pagedkv.model.tokenizer import Tokenizer

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    from concurrent.futures import ThreadPoolExecutor

    path = resolve_model_path(None)
    # transformers and the tokenizer's own memory, counted before; read on a thread as
    # load_model reads it (its malloc arena then serves load_model's tokenizer thread)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(Tokenizer.from_gguf, path).result()
    torch.zeros(1) @ torch.zeros(1, 1)
    before = rss()
    loaded = load_model(path, dtype=getattr(torch, sys.argv[1]), quantization=sys.argv[2])
    model = loaded.model
    h = model.embed_tokens(torch.arange(64))
    for layer in model.layers:  # every stored weight read once, as a forward does
        for linear in (layer.qkv_proj, layer.o_proj.linear, layer.gate_proj, layer.up_proj,
                       layer.down_proj.linear):
            if linear.gguf is not None:
                linear(torch.zeros(9, linear.gguf.in_features, dtype=model.dtype))
    model.compute_logits(h[:1].to(model.dtype))
    print(json.dumps({"growth": rss() - before, "file": path.stat().st_size}))
    """
)


@pytest.mark.slow  # the default model loaded in a fresh interpreter
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_weights_stay_near_the_file_size(dtype):
    """The memory rule: loading the default model with its blocks kept as stored and reading
    every weight grows the process by at most 1.25x its file (the mapped file's pages, q / k
    rows reordered, small dense tensors) plus 48 MiB that do not grow with the model (the
    kernels' library and its threads, a large step's scratch the allocator keeps; measured
    about 30 MiB); dequantized (``none``) it grows by several times the file."""
    sizes = {}
    for quantization in ("gguf", "none"):
        out = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, dtype, quantization],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        sizes[quantization] = json.loads(out.stdout.strip().splitlines()[-1])
    file_bytes = sizes["gguf"]["file"]
    assert sizes["gguf"]["growth"] <= 1.25 * file_bytes + (48 << 20), sizes
    assert sizes["none"]["growth"] >= 2 * file_bytes, sizes


def test_unpermuted_rows_match_the_dense_loader(stored):
    """llama.cpp's q / k row order is undone on the stored blocks (a copy of their rows)."""
    kept, dense = stored
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(kept.state_dict[name].dequantize(), dense.state_dict[name])


@pytest.mark.parametrize("keep_mapped", ["0", "1"])
def test_a_truncated_file_is_refused_naming_the_tensor(
    gguf_path, kernels, tmp_path, monkeypatch, keep_mapped
):
    """A tensor that lies past the end of the file is refused by name, whether the weights are
    read into memory or kept mapped (one rule for both)."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(gguf_path).read_bytes()[: 60 << 20])
    monkeypatch.setenv(MMAP_ENV, keep_mapped)
    with pytest.raises(ModelLoadError, match=r"GGUF tensor '.+' lies outside the file"):
        load_gguf(cut, quantized=True, kernels=kernels)
