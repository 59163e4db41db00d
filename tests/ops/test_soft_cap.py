"""Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``, the spec's
``logits_soft_cap``): every backend that runs it against dense capped attention (fp64), the
ones that cannot refuse the spec, and ``auto`` passes over them."""

from __future__ import annotations

import pytest
import torch
from backend_cases import BACKEND_NAMES, make_backend, make_backend_case
from paged_attention_cases import dense_attention

from pagedkv.errors import OpsInputError
from pagedkv.ops.backends import AttentionLayerSpec, select_backend

#: Backends that apply the cap; the others must refuse it.
CAPPING_BACKENDS = ("torch", "torch-reference", "native")


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    made = make_backend(request.param)
    if isinstance(made, str):
        pytest.skip(made)
    return made


def _spec(cap):
    return AttentionLayerSpec(
        num_heads=4, num_kv_heads=2, head_size=64, block_size=16, logits_soft_cap=cap
    )


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capped_scores_match_dense(backend, window, dtype):
    """Decode, chunked-prefill and whole-prompt rows, GQA, a cap small enough to bend the
    scores (scale 1: unit-normal q.k over 64 dims reaches ~20, cap 5)."""
    name = backend.name + ("-reference" if getattr(backend, "impl", "") == "reference" else "")
    if name not in CAPPING_BACKENDS:
        assert backend.unsupported_reason(_spec(5.0)) is not None
        with pytest.raises(OpsInputError, match="soft-capping"):
            backend.check_layer(_spec(5.0))
        return
    block_size = 16
    if backend.unsupported_reason(
        AttentionLayerSpec(
            num_heads=1, num_kv_heads=1, head_size=64, block_size=block_size, dtype=dtype
        )
    ):
        pytest.skip(f"{backend.name} does not run {dtype}")
    case = make_backend_case(
        backend,
        [(40, 1), (17, 1), (50, 12), (33, 33), (3, 1), (100, 1)],
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=64,
        dtype=dtype,
        sliding_window=window,
        logits_soft_cap=5.0,
    )
    case.spec = AttentionLayerSpec(**{**_fields(case.spec), "scale": 1.0})
    out = case.forward()
    expected = dense_attention(case, 1.0, window, logits_soft_cap=5.0)
    tol = 1e-5 if dtype == torch.float32 else 6e-2  # bf16: scores of scale 1 reach ~20
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    uncapped = dense_attention(case, 1.0, window)
    assert (uncapped - expected).abs().max() > 0.1  # the cap mattered


def _fields(spec: AttentionLayerSpec) -> dict:
    return {
        name: getattr(spec, name)
        for name in (
            "num_heads",
            "num_kv_heads",
            "head_size",
            "block_size",
            "dtype",
            "kv_cache_dtype",
            "sliding_window",
            "scale",
            "logits_soft_cap",
        )
    }


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan"), True, "50"])
def test_spec_refuses_a_bad_cap(cap):
    with pytest.raises(OpsInputError, match="logits_soft_cap"):
        _spec(cap)


def test_auto_passes_over_backends_without_a_cap():
    """``auto`` picks a backend that applies the cap; a named one that cannot falls back."""
    choice = select_backend("auto", "cpu", torch.float32, 64, logits_soft_cap=50.0, log=False)
    assert choice.backend.unsupported_reason(_spec(50.0)) is None
    assert choice.backend.name in ("native", "torch")
    named = select_backend("vllm-cpu", "cpu", torch.float32, 64, logits_soft_cap=50.0, log=False)
    assert named.backend.name == "torch"
    assert named.fallback_reason is not None
