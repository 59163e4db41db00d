"""The worker layer, between the engine and the model (vLLM V1: ``vllm/v1/worker``).

It turns one scheduler step into one forward over the paged KV cache and samples:
:mod:`~pagedkv.worker.scheduler_output` (what the scheduler hands over, defined here so that the
scheduler imports it downward), :mod:`~pagedkv.worker.input_batch` (the step's flattened input
tensors), :mod:`~pagedkv.worker.model_runner` (the forward, the KV cache tensors) and
:mod:`~pagedkv.worker.sampler`.

This ``__init__`` imports nothing, so the torch-free scheduler can import
``pagedkv.worker.scheduler_output`` without pulling in torch.
"""
