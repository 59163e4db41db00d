"""SuffixDecoding: draft from suffix trees of the request's own tokens and of earlier outputs.

Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"
(arXiv 2411.04975); vLLM's ``method="suffix"`` (which runs Arctic Inference's implementation).
Own implementation, linear drafts only (one path, no tree attention).

Two trees of the same kind (:class:`SuffixTrie`):

- a per-request tree over the request's prompt + output, extended as its tokens are verified;
- a global tree over the outputs of finished requests, at most
  ``suffix_decoding_max_cached_requests`` of them (the oldest is evicted first).

Each tree is a trie of every substring of length <= D (``suffix_decoding_max_tree_depth``) of
its sequences; a node's ``count`` is how often its substring occurs, so the children of the node
reached by a context give the empirical distribution of the token that followed it::

    sequence  a b a b c   (D = 3)        root
                                          ├─ a (2) ─ b (2) ─┬─ a (1)
                                          │                 └─ c (1)
                                          ├─ b (2) ─┬─ a (1) ─ b (1)
                                          │         └─ c (1)
                                          └─ c (1)

Appending a token extends the <= D substrings that end at the sequence's last token (the
"active" nodes): O(D) dict steps per token.

Speculation, for each match length m = 1, 2, ... while the context's last m tokens are a path
of the tree: from that node, follow the most frequent child while the path's estimated
probability (the product of ``child.count / sum of the node's children's counts``) stays
>= ``suffix_decoding_min_token_prob``, for at most ``min(max_num_tokens,
num_speculative_tokens, floor(suffix_decoding_max_spec_factor * m), D - m)`` tokens (the
paper's adaptive draft length: a longer match earns a longer draft). The draft scored highest
(the sum of its tokens' path probabilities: the expected number of accepted tokens), over every
m and both trees, wins; a tie goes to the longer match.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pagedkv.config import SpeculativeConfig

_EMPTY = np.empty(0, dtype=np.int64)


class _Node:
    """A trie node: how often its substring occurs, and its children by next token."""

    __slots__ = ("children", "count", "num_next")

    def __init__(self) -> None:
        self.count = 0
        self.num_next = 0  # sum of the children's counts: occurrences followed by a token
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of length <= ``max_depth`` of the sequences added.

    Args:
        max_depth: D, the longest substring counted (tokens, >= 1).
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, active: list[_Node], token_ids: Sequence[int]) -> list[_Node]:
        """Append ``token_ids`` to a sequence whose active nodes (those of its substrings that
        end at its last token, shortest first, lengths 1..D-1; [] for a new sequence) are
        ``active``; returns the new active nodes."""
        root, max_depth = self.root, self.max_depth
        for token in token_ids:
            grown = []
            for node in (root, *active):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                node.num_next += 1
                grown.append(child)
            active = grown[: max_depth - 1]  # a depth-D node is never extended
        return active

    def remove(self, token_ids: Sequence[int]) -> None:
        """Take back one earlier :meth:`extend` of the whole sequence ``token_ids`` (its counts;
        nodes no other sequence reaches are deleted)."""
        root, max_depth = self.root, self.max_depth
        for start in range(len(token_ids)):
            node = root
            for token in token_ids[start : start + max_depth]:
                child = node.children[token]
                node.num_next -= 1
                child.count -= 1
                if child.count == 0:  # only this occurrence reached it: drop its whole subtree
                    del node.children[token]
                    break
                node = child

    def speculate(
        self, context: Sequence[int], max_num_tokens: int, spec_factor: float, min_prob: float
    ) -> tuple[list[int], float, int]:
        """The best draft after ``context`` (module docstring).

        Args:
            context: the last <= D tokens of the request.
            max_num_tokens: most drafts.
            spec_factor: draft length <= spec_factor x match length.
            min_prob: the least path probability of a draft token.

        Returns:
            ``(draft token ids, score, match length)``; ``([], 0.0, 0)`` when nothing matches.
        """
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        num_context = len(context)
        for match_len in range(1, min(num_context, self.max_depth - 1) + 1):
            node = self.root
            for token in context[num_context - match_len :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is None:  # a longer suffix of the context is no path either
                break
            limit = min(max_num_tokens, int(spec_factor * match_len), self.max_depth - match_len)
            draft: list[int] = []
            score, prob = 0.0, 1.0
            while len(draft) < limit and node.children:
                token, child = max(node.children.items(), key=lambda item: item[1].count)
                prob *= child.count / node.num_next
                if prob < min_prob:
                    break
                draft.append(token)
                score += prob
                node = child
            if draft and score >= best[1]:
                best = (draft, score, match_len)
        return best


class _RequestTree:
    """A request's own trie and how far it has read the request's tokens."""

    __slots__ = ("active", "num_tokens", "trie")

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.active: list[_Node] = []
        self.num_tokens = 0


class SuffixDecodingProposer:
    """:class:`~pagedkv.engine.spec_decode.proposer.Proposer` by SuffixDecoding (module
    docstring). Holds one trie per request in flight and the global trie of finished outputs.

    Args:
        config: ``method="suffix"``; reads ``num_speculative_tokens`` and the
            ``suffix_decoding_*`` fields.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.global_trie = SuffixTrie(self.max_depth)
        self._cached_outputs: OrderedDict[str, list[int]] = OrderedDict()
        self._requests: dict[str, _RequestTree] = {}

    @property
    def num_cached_requests(self) -> int:
        """Finished requests whose outputs the global tree holds."""
        return len(self._cached_outputs)

    def propose(self, req_id: str, token_ids: np.ndarray, max_num_tokens: int) -> np.ndarray:
        """Extend the request's trie with its tokens not seen yet, then draft from the better of
        its trie and the global one (``[0..min(max_num_tokens, num_speculative_tokens)]``
        int64)."""
        tree = self._requests.get(req_id)
        num_tokens = len(token_ids)
        if tree is None or num_tokens < tree.num_tokens:  # new (or its tokens were reset)
            tree = self._requests[req_id] = _RequestTree(self.max_depth)
        if num_tokens > tree.num_tokens:
            new = np.asarray(token_ids[tree.num_tokens :]).tolist()
            tree.active = tree.trie.extend(tree.active, new)
            tree.num_tokens = num_tokens
        limit = min(max_num_tokens, self.num_speculative_tokens)
        if limit <= 0 or num_tokens == 0:
            return _EMPTY
        context = np.asarray(token_ids[-(self.max_depth - 1) :]).tolist()
        args = (context, limit, self.spec_factor, self.min_prob)
        draft, score, _ = tree.trie.speculate(*args)
        if self._cached_outputs:
            global_draft, global_score, _ = self.global_trie.speculate(*args)
            if global_score > score:
                draft = global_draft
        return np.asarray(draft, dtype=np.int64)

    def on_request_finished(self, req_id: str, prompt_len: int, token_ids: np.ndarray) -> None:
        """Drop the request's trie and add its output (``token_ids[prompt_len:]``) to the global
        trie, evicting the oldest cached outputs beyond ``suffix_decoding_max_cached_requests``.
        A request id already cached replaces its older output."""
        self._requests.pop(req_id, None)
        if self.max_cached_requests == 0:
            return
        output = np.asarray(token_ids[prompt_len:]).tolist()
        old = self._cached_outputs.pop(req_id, None)
        if old is not None:
            self.global_trie.remove(old)
        if not output:
            return
        self.global_trie.extend([], output)
        self._cached_outputs[req_id] = output
        while len(self._cached_outputs) > self.max_cached_requests:
            _, evicted = self._cached_outputs.popitem(last=False)
            self.global_trie.remove(evicted)
