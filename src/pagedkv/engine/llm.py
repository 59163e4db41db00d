"""LLM: offline batch generation (vLLM's ``LLM`` in spirit): give prompts, get outputs in order."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv.engine.beam_search import BeamSearchOutput, beam_search_output
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import EngineStats, LLMEngine, Prompt
from pagedkv.engine.outputs import RequestOutput
from pagedkv.errors import InvalidRequestError
from pagedkv.pooling_params import DEFAULT_POOLING, PoolingParams
from pagedkv.sampling_params import BeamSearchParams, SamplingParams

Conversation = Sequence[dict[str, Any]]


class LLM:
    """Generate text for many prompts at once with continuous batching over the paged KV cache.

    Args:
        model: GGUF file or Hugging Face folder; None = the default SmolLM2-135M-Instruct.
        dtype: "auto" (default: bfloat16 where the CPU computes bf16 natively, float32
            elsewhere; :func:`pagedkv.cpu_caps.resolve_dtype`), "bfloat16", "float32" (exact)
            or "float16".
        block_size: tokens per KV block; None = the attention backend's fastest.
        num_blocks: KV blocks in the pool (wins over kv_cache_memory).
        kv_cache_memory: bytes for the KV cache, or a size such as "1GiB" (as the
            --kv-cache-memory flag); None = a default budget (see EngineConfig).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget per step.
        max_model_len: most tokens (prompt + output) per request.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        **kwargs: other :class:`EngineConfig` fields (attention_backend, enable_chunked_prefill,
            policy, seed, ...; ``tensor_parallel_size=2`` splits the model over 2 processes),
            ``loaded_model`` (reuse an already loaded model) and ``model_loader`` (what each
            tensor-parallel rank calls to load its shard; see
            :class:`~pagedkv.engine.llm_engine.LLMEngine`).

    Example::

        llm = LLM()
        outs = llm.chat([[{"role": "user", "content": "What is paging?"}]],
                        SamplingParams(temperature=0, max_tokens=64))
        print(outs[0].text)
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int | None = None,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        **kwargs: Any,
    ) -> None:
        loaded_model = kwargs.pop("loaded_model", None)
        model_loader = kwargs.pop("model_loader", None)
        config = EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            **kwargs,
        )
        self.engine = LLMEngine(config, loaded_model=loaded_model, model_loader=model_loader)
        self._next_id = 0

    @property
    def tokenizer(self):
        """The model's tokenizer (:class:`pagedkv.model.tokenizer.Tokenizer`)."""
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (:class:`pagedkv.model.tokenizer.Tokenizer`; its Hugging Face
        tokenizer is ``.hf_tokenizer``), as vLLM's ``LLM.get_tokenizer()``."""
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block (e.g. to measure a cold cache). Returns False, changing
        nothing, while a request holds blocks (never between ``generate`` calls)."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for prompts.

        Args:
            prompts: one prompt or a list of them, in vLLM's forms: text, ``{"prompt":
                text}``, ``{"prompt_token_ids": [...]}``, or token ids (a list of ints).
                Conversations go to :meth:`chat`.
            sampling_params: one for all prompts or one per prompt; default ``SamplingParams()``.
            use_tqdm: show a progress bar.

        Returns:
            One finished :class:`RequestOutput` per prompt, in input order.

        Raises:
            InvalidRequestError: a prompt in no known form, or one that can never be served
                (nothing is generated then).
        """
        prompts = _as_prompt_list(prompts)
        if not prompts:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            if not isinstance(sampling_params, list | tuple) or not all(
                isinstance(params, SamplingParams) for params in sampling_params
            ):
                raise InvalidRequestError(
                    "sampling_params must be a SamplingParams or a list of them, got "
                    f"{type(sampling_params).__name__}"
                )
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        return self._run(prompts, params_list, use_tqdm)

    def beam_search(
        self,
        prompts: Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``), all prompts batched
        together in the engine; the beams of a prompt share their KV blocks (fork and
        copy-on-write) and never recompute them.

        Args:
            prompts: a list of prompts in :meth:`generate`'s forms (text, ``{"prompt": text}``,
                ``{"prompt_token_ids": [...]}``, or token ids).
            params: the beam-search parameters (width, max_tokens, length_penalty...).
            use_tqdm: show a progress bar.

        Returns:
            One :class:`BeamSearchOutput` per prompt, in input order: ``beam_width`` sequences,
            best first, each with the prompt's and the generated token ids, the text, the sum
            of the logprobs, and finish / stop reasons. The sequences and their order are
            transformers' ``generate(num_beams=beam_width, do_sample=False,
            length_penalty=..., early_stopping=False, num_return_sequences=beam_width)``.

        Raises:
            InvalidRequestError: params that are not a BeamSearchParams, a prompt in no known
                form, or one that can never be served (nothing is generated then).
        """
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(
                f"params must be a BeamSearchParams, got {type(params).__name__}"
            )
        prompts = _as_prompt_list(prompts)
        if not prompts:
            return []
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        return [beam_search_output(output) for output in outputs]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = DEFAULT_POOLING,
        *,
        normalize: bool = True,
        use_tqdm: bool = False,
    ) -> list[np.ndarray]:
        """Embed prompts with the loaded model (vLLM's ``LLM.embed``): each prompt is prefilled
        (batched and chunked like any prompt, its blocks left in the prefix cache) and its final
        hidden state pooled; nothing is generated.

        Args:
            prompts: one prompt or a list, in :meth:`generate`'s forms.
            pooling: "last" (the last prompt token's state; the default, as vLLM's for a
                decoder model), "mean" (over every prompt position) or "cls" (the first
                token's); see :mod:`pagedkv.pooling_params`.
            normalize: L2-normalize each vector (the default, as vLLM and llama.cpp).
            use_tqdm: show a progress bar.

        Returns:
            One float32 numpy array ``[hidden_size]`` per prompt, in input order (the final
            norm's output, before the LM head).

        Raises:
            InvalidRequestError: an unknown pooling, a prompt in no known form, or one that
                can never be served (nothing is computed then).
        """
        params = PoolingParams(pooling_type=pooling, normalize=normalize)
        prompts = _as_prompt_list(prompts)
        if not prompts:
            return []
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm)
        failed = [o for o in outputs if o.embedding is None]
        if failed:
            raise InvalidRequestError(
                f"request {failed[0].request_id!r} failed: {failed[0].outputs[0].error}"
            )
        return [o.embedding for o in outputs]

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Answer conversations (lists of ``{"role", "content"}`` messages) through the model's
        chat template; one conversation or a list. Returns outputs in input order.

        Args:
            add_generation_prompt: open the assistant's turn after the last message.
            continue_final_message: instead, leave the last message (a partly written
                assistant reply) open so the model continues it (vLLM's option).

        Raises:
            InvalidRequestError: messages the template cannot take, or both options true.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = []
        for messages in conversations:
            processed = self.engine.input_processor.process_chat(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            prompts.append({"prompt": processed.text, "prompt_token_ids": processed.token_ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_stats(self) -> EngineStats:
        """The engine's counters (preemptions, prefix-cache hits, peak KV usage...)."""
        return self.engine.get_stats()

    def _run(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams] | list[BeamSearchParams] | list[PoolingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        num_output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        if bar is not None:
                            num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix(out_tok_s=f"{num_output_tokens / elapsed:.0f}")
                            bar.update(1)
        except BaseException:
            # Leave the engine clean for the next call: drop what this call still has queued.
            # A cleanup that fails (a tensor-parallel engine interrupted mid-step is stopped and
            # raises WorkerError) does not hide what ended the call: that is raised.
            with contextlib.suppress(Exception):
                engine.abort_request(ids)
                while engine.has_unfinished_requests():
                    engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[request_id] for request_id in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, a prompt dict, or token ids) -> [prompt]; a list of prompts as is."""
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts
