"""The Triton kernels under Triton's interpreter (CPU tensors), against the torch reference and
dense attention, on small shapes.

Triton decides at decoration time whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``. So that setting it never leaks into other tests (or turns the real-GPU
tests of test_triton_gpu.py into interpreted ones), this module runs itself in a child pytest
with ``TRITON_INTERPRET=1``: in the parent there is one test, ``test_kernels_under_interpreter``;
in the child (or when the whole run has ``TRITON_INTERPRET=1``) the real tests. For one case's
detail run the child directly::

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/ops/test_triton_interpreter.py -q

Interpreter gaps designed around (docs/gpu.md): ``tl.dot`` on bf16 is wrong there, so the
wrapper computes dots in fp32 on CPU tensors (bf16/fp16 loads, stores and the output rounding are
still exercised); its fp32 -> fp8 rounding drops the carry into the exponent (1.99 -> 1.0 instead
of 2.0), so the fp8 write test uses values that need no rounding; out-of-bounds loads that a mask
misses are silent, so the caches are full of large garbage and block tables have stale entries
past each request's blocks, where a wrong mask shows up as a wrong value.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

if not IN_INTERPRETER:

    @pytest.mark.slow  # a subprocess running every kernel test under the interpreter
    def test_kernels_under_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, (
            f"interpreter tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        )

    @pytest.mark.slow
    def test_triton_copy_blocks_under_interpreter():
        """test_copy_blocks.py's triton cases: the backend's block copies (torch on its
        layout), then its interpreted kernels attending the copied blocks."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        other = os.path.join(os.path.dirname(__file__), "test_copy_blocks.py")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", other, "-k", "triton"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0 and " passed" in proc.stdout, (
            f"triton copy_blocks tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
        )
        assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]

else:
    # (paged_attention_cases is importable through pytest's pythonpath setting, pyproject.toml.)
    import torch
    from paged_attention_cases import dense_attention, make_case, torch_reference

    # The kernels themselves (private to the triton backend; tests may import them).
    from pagedkv.ops.backends import TritonAttentionConfig
    from pagedkv.ops.backends._torch.write import write_kv_torch
    from pagedkv.ops.backends._triton.attention import paged_attention_triton
    from pagedkv.ops.backends._triton.cache import write_kv_triton
    from pagedkv.ops.backends.hnd_layout import allocate_kv_cache

    # Small tiles keep the grids (and the interpreter's time) small and make short contexts span
    # several partitions, tiles and q blocks.
    SMALL = TritonAttentionConfig(
        partition_size=32, decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16
    )

    def _run(case, config=SMALL, sliding_window=None, **kwargs):
        head_size = case.query.shape[-1]
        return paged_attention_triton(
            case.query,
            case.kv_cache,
            case.block_tables,
            case.seq_lens,
            case.query_start_loc,
            head_size**-0.5,
            sliding_window,
            config=config,
            **kwargs,
        )

    # --- write_kv: the triton backend's writer equals the torch backend's -------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("block_size", [1, 16])
    def test_write_kv_equals_torch(dtype, block_size):
        gen = torch.Generator().manual_seed(block_size)
        num_blocks, num_kv_heads, head_size, num_tokens = 10, 3, 64, 9
        cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
        cache.copy_(torch.randn(cache.shape, generator=gen) * 50)
        expected = cache.clone()
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[3] = -1
        # key and value as views of one fused QKV output: non-contiguous token stride.
        qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=gen).to(dtype)
        key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
        write_kv_torch(key, value, expected, slots)
        write_kv_triton(key, value, cache, slots.to(torch.int32))
        assert torch.equal(cache, expected)

    @pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
    def test_write_kv_fp8_scales(fp8_dtype):
        gen = torch.Generator().manual_seed(1)
        cache = allocate_kv_cache(4, 8, 2, 64, fp8_dtype)
        expected = cache.clone()
        slots = torch.tensor([5, -1, 0, 31, 12])
        k_scale, v_scale = 0.5, 4.0
        # Values exactly representable after dividing by the scale (see module docs).
        key = torch.randn(5, 2, 64, generator=gen).to(fp8_dtype).float() * k_scale
        value = torch.randn(5, 2, 64, generator=gen).to(fp8_dtype).float() * v_scale
        write_kv_torch(key, value, expected, slots, k_scale=k_scale, v_scale=v_scale)
        write_kv_triton(key, value, cache, slots, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))

    # --- attention, fp32: equal to dense attention --------------------------------------------

    DECODE_CASES = [
        # (seq_q_lens, block_size, num_kv_heads, group, head_size)
        ([(17, 1), (16, 1), (15, 1), (1, 1)], 16, 2, 3, 64),  # block boundaries
        ([(33, 1), (100, 1), (64, 1)], 16, 1, 8, 64),  # several partitions; GQA 8
        ([(9, 1), (8, 1), (31, 1)], 1, 2, 1, 64),  # block_size 1, MHA
        ([(40, 1), (7, 1)], 8, 1, 4, 128),  # head 128
        ([(20, 1), (5, 1)], 32, 2, 2, 80),  # head 80: padded to 128
    ]

    @pytest.mark.parametrize("seq_q_lens, block_size, num_kv_heads, group, head_size", DECODE_CASES)
    def test_decode_matches_dense(seq_q_lens, block_size, num_kv_heads, group, head_size):
        case = make_case(
            seq_q_lens,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
            head_size=head_size,
        )
        expected = dense_attention(case, head_size**-0.5)
        out = _run(case)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        # max_seq_len from the host (as the dispatcher passes it) sizes a smaller grid.
        out = _run(case, max_seq_len=max(s for s, _ in seq_q_lens))
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    def test_decode_single_partition_and_prefill_kernel_agree():
        case = make_case(
            [(50, 1), (3, 1), (16, 1)], block_size=4, num_kv_heads=2, group=3, head_size=64
        )
        expected = dense_attention(case, 64**-0.5)
        big = TritonAttentionConfig(
            partition_size=64, decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16
        )
        for out in (_run(case, big), _run(case, decode_only=False)):
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    PREFILL_CASES = [
        ([(40, 40), (33, 9)], 16, 1, 3, 64),  # prefill; prefill after a prefix hit
        ([(17, 1), (40, 7), (5, 1), (32, 32)], 16, 3, 3, 64),  # mixed batch
        ([(21, 21), (70, 30)], 8, 2, 8, 64),  # GQA 8 (BLOCK_Q 2); chunk of a long prompt
        ([(12, 12), (30, 5)], 1, 2, 2, 128),  # block_size 1, head 128
        ([(3, 2), (64, 64)], 32, 1, 1, 64),  # MHA, BLOCK_Q 16
    ]

    @pytest.mark.parametrize(
        "seq_q_lens, block_size, num_kv_heads, group, head_size", PREFILL_CASES
    )
    def test_prefill_matches_dense(seq_q_lens, block_size, num_kv_heads, group, head_size):
        case = make_case(
            seq_q_lens,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
            head_size=head_size,
        )
        out = _run(case)
        expected = dense_attention(case, head_size**-0.5)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("sliding_window", [1, 5, 16, 37])
    def test_sliding_window_matches_dense(sliding_window):
        decode = make_case(
            [(70, 1), (16, 1), (38, 1)],
            block_size=8,
            num_kv_heads=2,
            group=2,
            head_size=64,
            seed=sliding_window,
        )
        mixed = make_case(
            [(70, 30), (16, 1), (38, 9)],
            block_size=8,
            num_kv_heads=2,
            group=2,
            head_size=64,
            seed=sliding_window,
        )
        for case in (decode, mixed):
            out = _run(case, sliding_window=sliding_window)
            expected = dense_attention(case, 64**-0.5, sliding_window)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    def test_smaller_batch_reusing_table_buffer():
        first = make_case(
            [(40, 1), (17, 1), (70, 1)], block_size=16, num_kv_heads=1, group=3, head_size=64
        )
        buffer = first.block_tables.clone()
        second = make_case(
            [(23, 1), (5, 1)],
            block_size=16,
            num_kv_heads=1,
            group=3,
            head_size=64,
            kv_cache=first.kv_cache,
            block_tables_buffer=buffer,
            seed=7,
        )
        torch.testing.assert_close(
            _run(second).double(), dense_attention(second, 64**-0.5), atol=1e-5, rtol=1e-5
        )

    # --- bf16 / fp16 / fp8 ----------------------------------------------------------------

    # Dots run in fp32 under the interpreter, so the error is the rounding of inputs (already in
    # the dense reference, which reads the same bf16/fp16 values) and of the output: |out| <= max|v|
    # (about 4 for randn values), half an ulp of 4 is 2^-7 in bf16 and 2^-10 in fp16.
    @pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
    @pytest.mark.parametrize("seq_q_lens", [[(40, 1), (9, 1)], [(40, 6), (9, 1)]])
    def test_half_dtypes(dtype, atol, seq_q_lens):
        case = make_case(
            seq_q_lens, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype
        )
        out = _run(case)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), dense_attention(case, 64**-0.5), atol=atol, rtol=0)

    @pytest.mark.parametrize("seq_q_lens", [[(40, 1), (9, 1)], [(40, 6), (9, 1)]])
    def test_fp8_cache_matches_reference(seq_q_lens):
        case = make_case(seq_q_lens, block_size=8, num_kv_heads=2, group=3, head_size=64)
        k_scale, v_scale = 0.75, 2.0  # garbage up to ~250 stays below fp8 e4m3's max 448
        fp8 = torch.empty_like(case.kv_cache, dtype=torch.float8_e4m3fn)
        fp8[0] = (case.kv_cache[0] / k_scale).to(fp8.dtype)
        fp8[1] = (case.kv_cache[1] / v_scale).to(fp8.dtype)
        case.kv_cache = fp8
        expected = torch_reference(case, 64**-0.5, k_scale=k_scale, v_scale=v_scale)
        out = _run(case, k_scale=k_scale, v_scale=v_scale)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    # --- through the attention backend interface ------------------------------------------

    from backend_cases import make_backend_case

    from pagedkv.ops.backends import TritonBackend, select_backend

    BACKEND_CASES = {
        "decode": [(17, 1), (40, 1), (1, 1), (33, 1)],
        "mixed": [(17, 1), (40, 7), (5, 1), (32, 32)],
    }

    @pytest.mark.parametrize("window", [None, 5])
    @pytest.mark.parametrize("scenario", list(BACKEND_CASES))
    def test_triton_backend_matches_dense(scenario, window):
        # available on CPU tensors under the interpreter; small tiles: several partitions
        backend = TritonBackend("cpu", config=SMALL)
        case = make_backend_case(
            backend,
            BACKEND_CASES[scenario],
            block_size=16,
            num_kv_heads=2,
            group=3,
            head_size=64,
            sliding_window=window,
        )
        out = case.forward()
        expected = dense_attention(case, 64**-0.5, window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    def test_select_triton_under_the_interpreter():
        # (fp8 through the backend is not compared here: the interpreter's fp32 -> fp8 rounding
        # drops carries, see the module docs; test_fp8_cache_matches_reference covers the read)
        choice = select_backend("triton", "cpu", torch.float32, 64)
        assert isinstance(choice.backend, TritonBackend) and choice.block_size == 16

    # --- inside the engine ----------------------------------------------------------------------

    def test_engine_with_triton_gives_the_torch_backends_tokens_and_logprobs():
        # The whole engine on the triton backend (its cache layout, metadata and kernels, on CPU
        # tensors under the interpreter): the same greedy tokens and logprobs as the torch
        # backend, through mixed prefill / decode steps, a prefix cache hit and block boundaries.
        from _tiny_model import tiny_loaded_model

        from pagedkv.engine.llm import LLM
        from pagedkv.sampling_params import SamplingParams

        prompts = [[5 + i % 50 for i in range(n)] for n in (3, 20, 33)]
        prompts.append(prompts[1] + [60, 61])  # shares 16 tokens (one block) with prompt 1
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
        results = {}
        for name in ("torch", "triton"):
            llm = LLM(
                dtype="float32",
                loaded_model=tiny_loaded_model(),
                attention_backend=name,
                block_size=16,
                num_blocks=32,
                max_model_len=64,
                num_threads=1,
            )
            assert llm.engine.attention_backend.name == name
            first = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)
            second = llm.generate([{"prompt_token_ids": prompts[3]}], params)
            assert second[0].num_cached_tokens == 16  # prompt 1's first block
            results[name] = [o.outputs[0] for o in first + second]
        for ours, ref in zip(results["triton"], results["torch"], strict=True):
            assert ours.token_ids == ref.token_ids
            for got, want in zip(ours.logprobs, ref.logprobs, strict=True):
                assert got.keys() == want.keys()
                for token_id, logprob in want.items():
                    assert got[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)
