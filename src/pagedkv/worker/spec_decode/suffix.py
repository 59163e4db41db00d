"""SuffixDecoding: draft from suffix trees of the request's own tokens and of earlier outputs.

Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"
(arXiv 2411.04975); vLLM's ``method="suffix"`` (which runs Arctic Inference's implementation).
Own implementation, linear drafts only (one path, no tree attention).

Two sources, as the paper's two suffix trees:

- the request's own prompt + output (the paper's per-request tree);
- a global tree over the outputs of finished requests, at most
  ``suffix_decoding_max_cached_requests`` of them (the oldest is evicted first).

The global tree is a :class:`SuffixTrie`. The request's own tree is not built: the same
counts are read off its token array with numpy at each call (:func:`speculate_own_tokens`: the
same drafts as a trie of its tokens, which a test checks), because a Python trie of depth 24
over a 4,096-token prompt takes ~25 MiB and ~0.2 s to build, per request.

A trie of every substring of length <= D (``suffix_decoding_max_tree_depth``) of
its sequences; a node's ``count`` is how often its substring occurs, so the children of the node
reached by a context give the empirical distribution of the token that followed it::

    sequence  a b a b c   (D = 3)        root
                                          ├─ a (2) ─ b (2) ─┬─ a (1)
                                          │                 └─ c (1)
                                          ├─ b (2) ─┬─ a (1) ─ b (1)
                                          │         └─ c (1)
                                          └─ c (1)

Appending a token extends the <= D substrings that end at the sequence's last token (the
"active" nodes): O(D) dict steps per token (~6 KB per output token of text that does not
repeat, in CPython).

Speculation, for each match length m = 1, 2, ... while the context's last m tokens are a path
of the tree: from that node, follow the most frequent child while the path's estimated
probability (the product of ``child.count / sum of the node's children's counts``) stays
>= ``suffix_decoding_min_token_prob``, for at most ``min(max_num_tokens,
num_speculative_tokens, floor(suffix_decoding_max_spec_factor * m), D - m)`` tokens (the
paper's adaptive draft length: a longer match earns a longer draft). The draft scored highest
(the sum of its tokens' path probabilities: the expected number of accepted tokens), over every
m and both sources, wins; a tie goes to the longer match, then to the request's own tokens.
At a node, a tie between children goes to the smallest token id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from pagedkv.config import SpeculativeConfig
from pagedkv.worker.spec_decode.proposer import TokenProposer

_EMPTY = np.empty(0, dtype=np.int64)
#: A trie node's :attr:`_Node.best` after a child's count fell: to be found again.
_STALE = -2


class _Node:
    """A trie node: how often its substring occurs, and its children by next token."""

    __slots__ = ("best", "children", "count", "num_next")

    def __init__(self) -> None:
        self.count = 0
        self.num_next = 0  # sum of the children's counts: occurrences followed by a token
        self.children: dict[int, _Node] = {}
        #: the most frequent child's token (a tie: the smallest id); -1: no child;
        #: :data:`_STALE`: a child's count fell since (remove), so speculation scans the
        #: children once. Kept by extend, so speculation reads it instead of scanning.
        self.best = -1

    def pick_best(self) -> None:
        """Set :attr:`best` from the children (a stale node, when speculation reaches it)."""
        children = self.children
        self.best = min(children, key=lambda t: (-children[t].count, t)) if children else -1


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
                best = node.best
                if best != token and best != _STALE:  # a rising count can only make it the best
                    rival = node.children[best].count if best >= 0 else 0
                    if child.count > rival or (child.count == rival and token < best):
                        node.best = token
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
                if node.best == token:  # another child may lead now: found when next read
                    node.best = _STALE
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
            while len(draft) < limit:
                # The most frequent child; a tie goes to the smallest token id.
                if node.best == _STALE:
                    node.pick_best()
                token = node.best
                if token < 0:
                    break
                child = node.children[token]
                prob *= child.count / node.num_next
                if prob < min_prob:
                    break
                draft.append(token)
                score += prob
                node = child
            if draft and score >= best[1]:
                best = (draft, score, match_len)
        return best


def speculate_own_tokens(
    token_ids: np.ndarray,
    max_depth: int,
    max_num_tokens: int,
    spec_factor: float,
    min_prob: float,
) -> tuple[list[int], float, int]:
    """:meth:`SuffixTrie.speculate` on the trie of the request's own tokens, computed on the
    token array itself (numpy), with no trie: the same drafts, scores and tie-breaks.

    The node a match of length m reaches in the trie stands for the earlier occurrences of the
    last m tokens; here they are the end positions ``ends`` whose last m tokens equal the
    sequence's, and a child's count is how many of them are followed by that token. So a
    request holds no tree (a trie of depth 24 over 4,096 random tokens is ~100k Python nodes,
    ~25 MiB, ~0.2 s to build) and a call costs one comparison over the array plus work on the
    matching positions only: each occurrence's match length (up to D - 1) from one
    ``[occurrences, D - 2]`` comparison, and one expansion per distinct set of occurrences
    (a set shrinks only where some occurrence's match ends), not numpy calls per m.

    Args:
        token_ids: ``[num_tokens]`` int ids, the request's prompt + output.
        max_depth, max_num_tokens, spec_factor, min_prob: as :meth:`SuffixTrie.speculate`.

    Returns:
        ``(draft token ids, score, match length)``; ``([], 0.0, 0)`` when nothing matches.
    """
    tokens = np.asarray(token_ids)
    num_tokens = len(tokens)
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    if num_tokens < 2:
        return best
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier occurrences of the last token
    if not len(ends):
        return best
    max_match = min(num_tokens - 1, max_depth - 1)
    # lengths[i]: how many of the last max_match tokens the occurrence ending at ends[i] repeats
    # (>= 1: its last token). d tokens back, tokens[end - d] == tokens[-1 - d] for all d < m.
    if max_match > 1:
        back = np.arange(1, max_match)
        positions = ends[:, None] - back
        same = (positions >= 0) & (tokens[np.maximum(positions, 0)] == tokens[-1 - back])
        lengths = 1 + np.cumprod(same, axis=1).sum(axis=1)
    else:
        lengths = np.ones(len(ends), dtype=np.int64)
    # alive[m]: the occurrences that match m tokens (lengths >= m), by count (a set only shrinks)
    alive = np.cumsum(np.bincount(lengths, minlength=max_match + 1)[::-1])[::-1].tolist()
    draft: list[int] = []
    scores: list[float] = []  # scores[i]: the sum of the first i path probabilities
    best_limit = 0
    for match_len in range(1, max_match + 1):
        if not alive[match_len]:
            break
        if match_len == 1 or alive[match_len] != alive[match_len - 1]:
            # The expansion of this set of occurrences, long enough for every later m with the
            # same set (limit <= D - m).
            matching = ends if alive[match_len] == len(ends) else ends[lengths >= match_len]
            draft, probs = _expand(
                tokens, matching, min(max_num_tokens, max_depth - match_len), min_prob
            )
            scores = [0.0, *accumulate(probs)]
        limit = min(max_num_tokens, int(spec_factor * match_len), max_depth - match_len, len(draft))
        if limit and scores[limit] >= best[1]:
            best, best_limit = (draft, scores[limit], match_len), limit
    return (best[0][:best_limit], best[1], best[2])


def _expand(
    tokens: np.ndarray, ends: np.ndarray, limit: int, min_prob: float
) -> tuple[list[int], list[float]]:
    """Follow the most frequent next token of the occurrences ending at ``ends`` for at most
    ``limit`` tokens; returns (the tokens, their path probabilities). Once one occurrence is
    left its tokens follow with the same probability (a slice, no step per token)."""
    num_tokens = len(tokens)
    draft: list[int] = []
    probs: list[float] = []
    prob = 1.0
    next_pos = ends + 1
    while len(draft) < limit:
        next_pos = next_pos[next_pos < num_tokens]
        if not len(next_pos):
            break
        if len(next_pos) == 1:
            start = int(next_pos[0])
            rest = tokens[start : start + limit - len(draft)].tolist()
            draft += rest
            probs += [prob] * len(rest)
            break
        values = tokens[next_pos]
        token = values[0]
        if (values != token).any():  # several continuations: the most frequent, then smallest
            unique, counts = np.unique(values, return_counts=True)
            best = int(np.argmax(counts))
            token = unique[best]
            prob *= counts[best] / len(values)
            if prob < min_prob:
                break
            next_pos = next_pos[values == token]
        draft.append(int(token))
        probs.append(prob)
        next_pos = next_pos + 1
    return draft, probs


class SuffixDecodingProposer(TokenProposer):
    """A :class:`~pagedkv.worker.spec_decode.proposer.DraftProposer` by SuffixDecoding (module
    docstring). Holds the global trie of finished outputs; nothing per request.

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

    @property
    def num_cached_requests(self) -> int:
        """Finished requests whose outputs the global tree holds."""
        return len(self._cached_outputs)

    def propose(self, req_id: str, token_ids: np.ndarray, max_num_tokens: int) -> np.ndarray:
        """Draft from the better of the request's own tokens (:func:`speculate_own_tokens`)
        and the global trie (``[0..min(max_num_tokens, num_speculative_tokens)]`` int64)."""
        limit = min(max_num_tokens, self.num_speculative_tokens)
        if limit <= 0 or len(token_ids) == 0:
            return _EMPTY
        draft, score, match_len = speculate_own_tokens(
            token_ids, self.max_depth, limit, self.spec_factor, self.min_prob
        )
        if self._cached_outputs:
            context = np.asarray(token_ids[-(self.max_depth - 1) :]).tolist()
            args = (context, limit, self.spec_factor, self.min_prob)
            global_draft, global_score, global_len = self.global_trie.speculate(*args)
            # A tie goes to the longer match: an earlier output that repeats the last tokens
            # further back than the prompt does (an agent loop's earlier answer) knows better.
            if (global_score, global_len) > (score, match_len):
                draft = global_draft
        return np.asarray(draft, dtype=np.int64)

    def finished(self, req_id: str, prompt_len: int, token_ids: np.ndarray) -> None:
        """Add the request's output (``token_ids[prompt_len:]``) to the global trie, evicting
        the oldest cached outputs beyond ``suffix_decoding_max_cached_requests``. A request id
        already cached replaces its older output."""
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
