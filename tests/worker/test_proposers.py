"""Draft proposers: prompt lookup (n-gram) and SuffixDecoding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pagedkv.config import SpeculativeConfig
from pagedkv.worker.spec_decode.ngram import NgramProposer, find_ngram_drafts
from pagedkv.worker.spec_decode.proposer import DraftProposer
from pagedkv.worker.spec_decode.selector import make_proposer
from pagedkv.worker.spec_decode.suffix import (
    _STALE,
    SuffixDecodingProposer,
    SuffixTrie,
    speculate_own_tokens,
)


def ngram(k=3, lo=1, hi=4) -> NgramProposer:
    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi
    )
    return make_proposer(config)


def suffix(k=8, depth=24, cached=10000, factor=1.0, min_prob=0.1) -> SuffixDecodingProposer:
    config = SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=k,
        suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=cached,
        suffix_decoding_max_spec_factor=factor,
        suffix_decoding_min_token_prob=min_prob,
    )
    return make_proposer(config)


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


# --- n-gram -------------------------------------------------------------------------------


def test_make_proposer_builds_the_method():
    assert isinstance(ngram(), NgramProposer)
    assert isinstance(suffix(), SuffixDecodingProposer)
    proposer: DraftProposer = ngram()  # both satisfy the Protocol
    proposer = suffix()
    assert proposer is not None


def test_ngram_drafts_what_followed_the_earliest_longest_match():
    tokens = ids(1, 2, 3, 4, 9, 8, 1, 2, 3, 4, 7, 1, 2, 3, 4)
    # "1 2 3 4" ends at 3 and at 9: the earliest is followed by 9 8 1 ...
    assert ngram(k=3).propose("r", tokens, 10).tolist() == [9, 8, 1]
    assert ngram(k=10).propose("r", tokens, 10).tolist() == [9, 8, 1, 2, 3, 4, 7, 1, 2, 3]
    # The scheduler's cap wins over num_speculative_tokens.
    assert ngram(k=3).propose("r", tokens, 2).tolist() == [9, 8]
    assert ngram(k=3).propose("r", tokens, 0).tolist() == []
    assert ngram(k=3).propose("r", tokens, 2).dtype == np.int64


def test_ngram_prefers_the_longest_n_over_an_earlier_shorter_match():
    # "4" alone occurs at 1 (followed by 5), "3 4" at 6 (followed by 7).
    tokens = ids(0, 4, 5, 0, 0, 3, 4, 7, 3, 4)
    assert ngram(k=1, lo=1, hi=2).propose("r", tokens, 5).tolist() == [7]
    assert ngram(k=1, lo=1, hi=1).propose("r", tokens, 5).tolist() == [5]


def test_ngram_min_n_and_no_match_give_nothing():
    tokens = ids(1, 2, 3, 9, 2, 3)  # only "2 3" recurs
    assert ngram(lo=2, hi=4).propose("r", tokens, 5).tolist() == [9, 2, 3]
    assert ngram(lo=3, hi=4).propose("r", tokens, 5).tolist() == []
    assert ngram().propose("r", ids(1, 2, 3, 4), 5).tolist() == []
    assert ngram().propose("r", ids(7), 5).tolist() == []
    assert ngram().propose("r", ids(), 5).tolist() == []


def test_ngram_overlapping_match_copies_up_to_the_end():
    assert ngram(k=5, lo=1, hi=3).propose("r", ids(1, 1, 1, 1), 5).tolist() == [1]
    assert ngram(k=5, lo=1, hi=3).propose("r", ids(5, 6, 5, 6, 5, 6), 5).tolist() == [5, 6]


def _reference_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Brute force: for n from hi down to lo, the first earlier occurrence of the last n."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix_ = tokens[size - n :]
        for start in range(size - n):
            if tokens[start : start + n] == suffix_:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matches_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        size = int(rng.integers(0, 40))
        tokens = rng.integers(0, 4, size).astype(np.int64)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        expected = _reference_ngram(tokens.tolist(), lo, hi, k)
        assert find_ngram_drafts(tokens, lo, hi, k).tolist() == expected, (tokens, lo, hi, k)


# --- suffix tree --------------------------------------------------------------------------


def _dump(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count."""
    paths, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            paths[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return paths


def _substring_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return dict(counts)


def test_trie_counts_every_substring_up_to_the_depth_incrementally():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 3, 50).tolist()
    trie = SuffixTrie(max_depth=4)
    active = []
    for chunk in (seq[:1], seq[1:17], seq[17:18], seq[18:]):
        active = trie.extend(active, chunk)
    assert _dump(trie) == _substring_counts([seq], 4)
    for node in [trie.root, *trie.root.children.values()]:  # num_next = sum of children
        assert node.num_next == sum(c.count for c in node.children.values())


def _assert_best_children(trie: SuffixTrie) -> None:
    """Every node's kept best child is the most frequent one (a tie: the smallest id), or the
    node is marked stale (a count fell: found again when read)."""
    stack = [trie.root]
    while stack:
        node = stack.pop()
        expected = (
            min(node.children, key=lambda t: (-node.children[t].count, t)) if node.children else -1
        )
        assert node.best in (expected, _STALE)
        stack.extend(node.children.values())


@pytest.mark.parametrize("seed", range(3))
def test_trie_keeps_each_nodes_best_child_through_extends_and_removes(seed):
    rng = np.random.default_rng(seed)
    trie = SuffixTrie(max_depth=4)
    kept: list[list[int]] = []
    for _ in range(40):
        if kept and rng.random() < 0.4:
            trie.remove(kept.pop(int(rng.integers(len(kept)))))
        else:
            seq = rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
            active: list = []
            for chunk in (seq[:3], seq[3:]):  # extended in two calls, as a running sequence
                active = trie.extend(active, chunk)
            kept.append(seq)
        _assert_best_children(trie)
        fresh = SuffixTrie(max_depth=4)  # the same sequences added anew: the same drafts
        for seq in kept:
            fresh.extend([], seq)
        for context in ([0], [1, 2], [3, 0, 1], rng.integers(0, 4, 3).tolist()):
            assert trie.speculate(context, 3, 2.0, 0.0) == fresh.speculate(context, 3, 2.0, 0.0)


def test_trie_remove_takes_back_exactly_one_sequence():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 3, int(n)).tolist() for n in (12, 7, 20)]
    trie = SuffixTrie(max_depth=5)
    for seq in seqs:
        trie.extend([], seq)
    trie.remove(seqs[1])
    assert _dump(trie) == _substring_counts([seqs[0], seqs[2]], 5)
    trie.remove(seqs[0])
    trie.remove(seqs[2])
    assert _dump(trie) == {}
    assert trie.root.num_next == 0


def test_suffix_drafts_the_repeating_pattern_of_the_request():
    tokens = ids(1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2)
    proposer = suffix(k=8)
    # Matches of length m draft at most m tokens (spec factor 1); the whole tail to the end of
    # the earlier occurrences (3 4 5 1 2) has probability 1 at every step.
    assert proposer.propose("r", tokens, 8).tolist() == [3, 4, 5, 1, 2]
    assert proposer.propose("r", tokens, 2).tolist() == [3, 4]


def test_suffix_tree_is_extended_with_each_calls_new_tokens():
    proposer = suffix(k=4)
    assert proposer.propose("r", ids(7, 8, 9), 4).tolist() == []
    # One more period: "7 8 9 7" now has "7" followed by "8 9" earlier.
    assert proposer.propose("r", ids(7, 8, 9, 7), 4).tolist() == [8]
    assert proposer.propose("r", ids(7, 8, 9, 7, 8), 4).tolist() == [9, 7]


def test_suffix_adaptive_length_follows_the_match_length():
    tokens = ids(1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 8, 0)  # "8 0" matches (m = 2), then 9 8 0
    assert suffix(k=8, factor=1.0).propose("r", tokens, 8).tolist() == [9, 8]
    assert suffix(k=8, factor=0.5).propose("r", tokens, 8).tolist() == [9]
    assert suffix(k=8, factor=2.0).propose("r", tokens, 8).tolist() == [9, 8, 0]
    # The depth caps match + draft: depth 2 allows a 1-token match and 1 draft only.
    assert suffix(k=8, factor=2.0, depth=2).propose("r", tokens, 8).tolist() == [9]


def test_suffix_min_token_prob_stops_at_an_unlikely_branch():
    # After "5" came 1 three times and 2 once: p(1) = 0.75.
    tokens = ids(5, 1, 5, 1, 5, 1, 5, 2, 5)
    assert suffix(k=1, min_prob=0.7).propose("r", tokens, 1).tolist() == [1]
    assert suffix(k=1, min_prob=0.8).propose("r", tokens, 1).tolist() == []


def test_suffix_global_tree_drafts_from_a_finished_requests_output():
    proposer = suffix(k=8)
    prompt = [100, 101]
    output = [40, 41, 42, 43, 44, 45]
    proposer.propose("a", ids(*prompt, *output[:3]), 8)
    proposer.finished("a", 2, ids(*prompt, *output))
    assert proposer.num_cached_requests == 1
    # A new request whose tokens end in "41 42" gets what followed in "a"'s output.
    assert proposer.propose("b", ids(7, 41, 42), 8).tolist() == [43, 44]
    # The prompt of "a" is not in the global tree (only outputs are).
    assert proposer.propose("c", ids(7, 100), 8).tolist() == []


def test_suffix_global_tree_evicts_the_oldest_output():
    proposer = suffix(k=4, cached=2)
    for req_id, output in (("a", [10, 11, 12]), ("b", [20, 21, 22]), ("c", [30, 31, 32])):
        proposer.finished(req_id, 1, ids(0, *output))
    assert proposer.num_cached_requests == 2
    assert proposer.propose("x", ids(10), 4).tolist() == []  # "a" was evicted
    assert proposer.propose("y", ids(20), 4).tolist() == [21]
    assert proposer.propose("z", ids(30), 4).tolist() == [31]
    assert _dump(proposer.global_trie) == _substring_counts([[20, 21, 22], [30, 31, 32]], 24)


def test_suffix_without_a_global_tree_caches_nothing():
    proposer = suffix(k=4, cached=0)
    proposer.finished("a", 1, ids(0, 10, 11, 12))
    assert proposer.num_cached_requests == 0
    assert proposer.propose("x", ids(10), 4).tolist() == []


def test_suffix_picks_the_tree_with_the_higher_score():
    proposer = suffix(k=4, min_prob=0.0)
    for req_id in ("a", "b", "c"):  # the global tree saw "1 -> 2" only: p = 1
        proposer.finished(req_id, 0, ids(1, 2))
    # The request saw 1 -> 3, 1 -> 2, 1 -> 4: p = 1/3 each; the global draft scores higher.
    assert proposer.propose("r", ids(1, 3, 1, 2, 1, 4, 1), 4).tolist() == [2]
    # A tie (both p = 1, both matching the last token only) goes to the request's own tree.
    assert proposer.propose("s", ids(1, 3, 1), 4).tolist() == [3]


def test_suffix_score_tie_goes_to_the_longer_match():
    proposer = suffix(k=4, min_prob=0.0)
    proposer.finished("a", 0, ids(5, 6, 7, 8))
    # Both draft one token with p = 1: the request's own tokens match "7" (-> 9), the global
    # tree "6 7" (-> 8): the longer match wins (an agent loop repeating an earlier answer).
    assert proposer.propose("r", ids(7, 9, 6, 7), 1).tolist() == [8]


def test_suffix_keeps_nothing_per_request():
    proposer = suffix(k=4, cached=0)
    assert proposer.propose("r", ids(5, 6, 5, 6), 4).tolist() == [5, 6]
    proposer.finished("r", 4, ids(5, 6, 5, 6))
    assert proposer.propose("r", ids(9, 9), 4).tolist() == [9]  # only the tokens given count


@pytest.mark.parametrize("seed", range(3))
def test_own_tokens_speculate_as_a_trie_of_them(seed):
    """speculate_own_tokens reads the trie's counts off the array: same drafts and scores."""
    rng = np.random.default_rng(seed)
    for _ in range(150):
        size = int(rng.integers(1, 60))
        tokens = rng.integers(0, int(rng.integers(2, 5)), size)
        depth = int(rng.integers(2, 9))
        limit = int(rng.integers(1, 8))
        factor = float(rng.choice([0.5, 1.0, 2.0, 3.0]))
        min_prob = float(rng.choice([0.0, 0.1, 0.4, 0.7]))
        trie = SuffixTrie(depth)
        trie.extend([], tokens.tolist())
        context = tokens[-(depth - 1) :].tolist()
        expected = trie.speculate(context, limit, factor, min_prob)
        draft, score, match_len = speculate_own_tokens(tokens, depth, limit, factor, min_prob)
        assert (draft, match_len) == (expected[0], expected[2]), (tokens, depth, limit, factor)
        assert score == pytest.approx(expected[1])


# --- who may draft ---------------------------------------------------------------------------


def test_may_draft_is_one_rule_for_the_scheduler_and_the_runner():
    from pagedkv.pooling_params import PoolingParams
    from pagedkv.sampling_params import SamplingParams
    from pagedkv.worker.spec_decode.eligibility import may_draft

    plain = SamplingParams(temperature=0.7, max_tokens=8)
    assert may_draft(plain, 0)
    assert not may_draft(SamplingParams(logprobs=0), 5)  # a beam's params ask for logprobs
    assert not may_draft(SamplingParams(repetition_penalty=1.2), 5)
    assert not may_draft(SamplingParams(presence_penalty=0.5), 5)
    assert not may_draft(SamplingParams(frequency_penalty=-0.5), 5)
    assert not may_draft(SamplingParams(min_tokens=3), 2)  # its stop ids are still masked
    assert may_draft(SamplingParams(min_tokens=3), 3)
    assert not may_draft(plain, 0, PoolingParams())  # samples nothing
