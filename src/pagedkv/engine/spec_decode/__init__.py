"""Speculative decoding's draft tokens: the scheduler's collaborator that schedules and rolls
them back (:mod:`~pagedkv.engine.spec_decode.drafts`, torch- and numpy-free like the scheduler),
and the proposers that make them (numpy): prompt lookup (n-gram) and SuffixDecoding. The target
model verifies the drafts (:mod:`pagedkv.worker.rejection_sampler`).

The package imports nothing itself, so that the scheduler's import of ``drafts`` brings no numpy.
"""
