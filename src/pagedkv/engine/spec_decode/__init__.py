"""Speculative decoding's draft tokens on the scheduler's side: how many of the workers' drafts a
request schedules, their KV slots and their rollback (:mod:`~pagedkv.engine.spec_decode.drafts`,
torch- and numpy-free like the scheduler). The drafts are made in the workers
(:mod:`pagedkv.worker.spec_decode`); the target model verifies them
(:mod:`pagedkv.worker.rejection_sampler`).
"""
