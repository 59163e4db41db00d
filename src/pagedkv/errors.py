"""pagedkv's exception hierarchy.

Every error pagedkv raises on bad input derives from :class:`PagedKVError`, and a call that raises
leaves every structure exactly as it was (check, then mutate). The classes also derive from the
built-in exception a Python user would expect (``ValueError``, ``LookupError``...), so generic
handlers keep working.

    PagedKVError
    ├── ConfigError            invalid configuration (block_size < 1, unknown hash algorithm, ...)
    │   ├── CacheSizingError   the KV cache does not fit in the memory budget
    │   └── ModelConfigError   a model's config.json / GGUF metadata lacks a key or names a model
    │                          pagedkv cannot size or run (also a ModelLoadError)
    ├── InvalidRequestError    a request that can never be served (too long, bad sampling params)
    ├── CacheStateError        an operation the cache's current state forbids
    ├── OpsInputError          tensors of the wrong shape/dtype/range given to an op
    ├── HostMemoryError        a host buffer (weights, KV cache) the system would not map
    └── ModelLoadError         a model file that is missing or cannot be read
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error raised by pagedkv."""


class ConfigError(PagedKVError, ValueError):
    """An invalid configuration value; the message names the value and the valid range."""


class CacheSizingError(ConfigError):
    """The KV cache cannot be sized from the given memory budget (zero blocks, or max_model_len
    does not fit even once); the message says the largest max_model_len that would fit."""


class InvalidRequestError(PagedKVError, ValueError):
    """A request that can never be served as given (prompt + max_tokens beyond max_model_len,
    more blocks than the whole pool, invalid sampling parameters, ...).

    Args:
        message: what is wrong, naming the field and its valid range.
        param: the request field at fault (``"top_k"``, ``"prompt"``...), when one is; the server
            returns it as the OpenAI error body's ``param``.
    """

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CacheStateError(PagedKVError, RuntimeError):
    """An operation that the KV cache's current state does not allow."""


class OpsInputError(PagedKVError, ValueError):
    """Tensors of the wrong shape, dtype or value range given to a paged-attention op."""


class HostMemoryError(PagedKVError, MemoryError):
    """The system refused a host buffer (an anonymous mapping for the weights or the KV cache:
    out of memory under strict overcommit, an address-space limit); the message gives the size
    asked for."""


class ModelLoadError(PagedKVError, OSError):
    """A model that cannot be found or read; the message says how to get it."""


class ModelConfigError(ConfigError, ModelLoadError):
    """A model's own configuration (config.json keys, GGUF metadata) is missing a required key or
    describes a model pagedkv cannot size or run. Both a :class:`ConfigError` (the configuration is
    invalid) and a :class:`ModelLoadError` (the model cannot be read as given), so handlers of
    either catch it; the message names the key or the unsupported feature."""


class WorkerError(PagedKVError, RuntimeError):
    """A tensor-parallel worker process failed or exited: the engine cannot run another step
    (its ranks no longer hold the same state); the message names the rank, its pid and exit code
    and, when it reported one, its error."""
