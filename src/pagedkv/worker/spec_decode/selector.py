"""The proposer of a speculative config's method (as :mod:`pagedkv.ops.backends.selector` picks
an attention backend): its own module, so that the proposers import their base class
(:mod:`~pagedkv.worker.spec_decode.proposer`) and nothing imports them back."""

from __future__ import annotations

from pagedkv.config import SpeculativeConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.spec_decode.ngram import NgramProposer
from pagedkv.worker.spec_decode.proposer import TokenProposer
from pagedkv.worker.spec_decode.suffix import SuffixDecodingProposer


def make_proposer(config: SpeculativeConfig) -> TokenProposer:
    """The proposer of ``config.method`` "ngram" or "suffix" (the draft model's is built by the
    model runner, which holds its KV cache).

    Raises:
        ConfigError: a method that drafts with a model.
    """
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixDecodingProposer(config)
    raise ConfigError(f"make_proposer: method {config.method!r} drafts with a model")
