"""Draft-token proposers of speculative decoding (numpy, torch-free): prompt lookup (n-gram) and
SuffixDecoding. The target model verifies the drafts (:mod:`pagedkv.worker.rejection_sampler`).
"""

from pagedkv.engine.spec_decode.proposer import Proposer, make_proposer

__all__ = ["Proposer", "make_proposer"]
