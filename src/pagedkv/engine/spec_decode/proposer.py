"""TEMPORARY stub (replaced by the spec-propose branch)."""

from __future__ import annotations

import numpy as np


class _Ngram:
    def __init__(self, k, nmin, nmax):
        self.k, self.nmin, self.nmax = k, nmin, nmax

    def propose(self, req_id, token_ids, max_num_tokens):
        n_tok = len(token_ids)
        for n in range(min(self.nmax, n_tok - 1), self.nmin - 1, -1):
            tail = token_ids[n_tok - n :]
            for start in range(n_tok - n - 1, -1, -1):
                if np.array_equal(token_ids[start : start + n], tail):
                    return token_ids[start + n : start + n + max_num_tokens]
        return token_ids[:0]

    def on_request_finished(self, req_id, prompt_len, token_ids):
        pass


def make_proposer(config):
    return _Ngram(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


Proposer = _Ngram
