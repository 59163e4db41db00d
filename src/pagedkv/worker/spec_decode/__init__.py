"""Speculative decoding's drafters, in the worker as in vLLM V1: after each step the model runner
asks one :class:`~pagedkv.worker.spec_decode.proposer.DraftProposer` for the next drafts of every
request that sampled and may draft, and returns them in ``ModelRunnerOutput.draft_token_ids``;
the scheduler only decides how many of them to schedule, their KV slots and their rollback
(:mod:`pagedkv.engine.spec_decode.drafts`).

- :mod:`~pagedkv.worker.spec_decode.eligibility`: which requests may draft (torch- and
  numpy-free: the scheduler imports it too);
- :mod:`~pagedkv.worker.spec_decode.proposer`: the Protocol, its plain-data input, the
  token proposers' base class;
- :mod:`~pagedkv.worker.spec_decode.selector`: ``make_proposer``, the proposer of a
  config's method;
- the proposers: :mod:`~pagedkv.worker.spec_decode.ngram` (prompt lookup),
  :mod:`~pagedkv.worker.spec_decode.suffix` (SuffixDecoding) and
  :mod:`~pagedkv.worker.spec_decode.draft_model` (a second, smaller model).

The package imports nothing itself, so that the scheduler's import of ``eligibility`` brings
no numpy or torch.
"""
