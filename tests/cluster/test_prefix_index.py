"""The routing index over several replicas' prefix caches, and the replica ranking."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedkv.cluster.prefix_index import PrefixIndex, rank_replicas
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.errors import ConfigError


def stored(*hashes, group=0):
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=None,
        token_ids=(0,) * len(hashes),
        block_size=1,
        kv_cache_group_id=group,
    )


def test_match_counts_leading_blocks_per_replica():
    index = PrefixIndex()
    index.apply("a", [stored("h0", "h1", "h2")])
    index.apply("b", [stored("h0"), stored("x1")])
    chain = ["h0", "h1", "h2", "h3"]
    assert index.match(chain) == {"a": 3, "b": 1}
    assert index.match(chain, ["b", "c"]) == {"b": 1, "c": 0}
    # A hole stops the walk: h1 missing on b means h2 does not count even if held.
    index.apply("b", [stored("h2")])
    assert index.match(chain, ["b"]) == {"b": 1}
    assert index.match([], ["a"]) == {"a": 0}


def test_removal_clear_and_replica_death():
    index = PrefixIndex()
    index.apply("a", [stored("h0", "h1")])
    index.apply("b", [stored("h0", "h1")])
    index.apply("a", [BlockRemoved(("h1",)), BlockRemoved(("never-stored",))])
    assert index.match(["h0", "h1"]) == {"a": 1, "b": 2}
    index.apply("b", [AllBlocksCleared()])
    assert index.match(["h0"]) == {"a": 1, "b": 0}
    index.apply("b", [stored("h0")])
    assert index.remove_replica("a") == 1
    assert index.replicas == ["b"]
    assert index.match(["h0"]) == {"b": 1}
    assert index.remove_replica("gone") == 0


def test_a_hash_held_by_two_groups_stays_until_both_remove_it():
    index = PrefixIndex()
    index.apply("a", [stored("h", group=0), stored("h", group=1)])
    index.apply("a", [BlockRemoved(("h",), kv_cache_group_id=0)])
    assert index.match(["h"]) == {"a": 1}
    index.apply("a", [BlockRemoved(("h",), kv_cache_group_id=1)])
    assert index.match(["h"]) == {"a": 0}
    assert index.num_cached_blocks("a") == 0


def test_routed_hashes_count_until_they_expire():
    index = PrefixIndex()
    index.add_replica("b")
    index.note_routed("a", ["h0", "h1"], expires_at=10.0)
    assert index.match(["h0", "h1"], now=5.0) == {"b": 0, "a": 2}
    assert index.match(["h0", "h1"], now=10.0) == {"b": 0, "a": 0}
    assert index.match(["h0", "h1"]) == {"b": 0, "a": 0}  # no clock: events only
    # Stored (from events) and routed combine along one chain.
    index.apply("a", [stored("h0")])
    index.note_routed("a", ["h0", "h1", "h2"], expires_at=20.0)
    assert index.match(["h0", "h1", "h2"], ["a"], now=15.0) == {"a": 3}
    assert index.expire(now=15.0) == 0
    assert index.expire(now=25.0) == 3
    assert index.match(["h0", "h1"], ["a"], now=25.0) == {"a": 1}
    index.note_routed("b", ["h9"], expires_at=30.0)
    index.remove_replica("b")
    assert index.match(["h9"], ["b"], now=0.0) == {"b": 0}


def test_apply_refuses_non_events():
    with pytest.raises(ConfigError, match="not a KV-cache event"):
        PrefixIndex().apply("a", ["h0"])


# ---- the index against a model: per replica, a set of hashes ------------------------------------

HASHES = [f"h{i}" for i in range(6)]
_event = st.one_of(
    st.builds(lambda hs: ("store", tuple(hs)), st.lists(st.sampled_from(HASHES), max_size=3)),
    st.builds(lambda hs: ("remove", tuple(hs)), st.lists(st.sampled_from(HASHES), max_size=3)),
    st.just(("clear", ())),
    st.just(("die", ())),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), _event), max_size=30),
    st.lists(st.sampled_from(HASHES), max_size=6),
)
@example([("a", ("store", ("h0", "h1"))), ("a", ("die", ()))], ["h0"])
def test_index_matches_a_set_model(ops, chain):
    """In pagedkv one hash lives in one block per group, so with one group a replica's events
    never store a hash it holds: the model skips such stores, as the engine never sends them."""
    index = PrefixIndex()
    model: dict[str, set[str]] = {}
    for replica, (kind, hashes) in ops:
        held = model.setdefault(replica, set())
        if kind == "store":
            new = tuple(dict.fromkeys(h for h in hashes if h not in held))
            if new:
                index.apply(replica, [stored(*new)])
                held.update(new)
        elif kind == "remove":
            index.apply(replica, [BlockRemoved(hashes)])
            held.difference_update(hashes)
        elif kind == "clear":
            index.apply(replica, [AllBlocksCleared()])
            held.clear()
        else:
            index.remove_replica(replica)
            del model[replica]
    expected = {}
    for replica, held in model.items():
        depth = 0
        while depth < len(chain) and chain[depth] in held:
            depth += 1
        expected[replica] = depth
    assert index.match(chain, list(model)) == expected
    assert {r: index.num_cached_blocks(r) for r in model} == {r: len(h) for r, h in model.items()}


# ---- ranking ------------------------------------------------------------------------------------


def test_longest_prefix_first_then_queue_length():
    ranks = rank_replicas(
        ["a", "b", "c", "d"],
        {"a": 2, "b": 8, "c": 8, "d": 0},
        {"a": 0, "b": 3, "c": 1, "d": 0},
        num_prompt_blocks=10,
    )
    assert ranks == [["c", "b"], ["a"], ["d"]]


def test_hot_spot_goes_last_whatever_it_caches():
    ranks = rank_replicas(
        ["a", "b"], {"a": 10}, {"a": 9, "b": 0}, num_prompt_blocks=10, max_imbalance=8
    )
    assert ranks == [["b"], ["a"]]
    ranks = rank_replicas(
        ["a", "b"], {"a": 10}, {"a": 8, "b": 0}, num_prompt_blocks=10, max_imbalance=8
    )
    assert ranks == [["a"], ["b"]]


def test_a_tiny_shared_prefix_does_not_attract():
    """One block of 40 (the chat template's header) is below min_match_fraction: a tie."""
    ranks = rank_replicas(["a", "b"], {"a": 1}, {}, num_prompt_blocks=40, last_routed={"a": 1})
    assert ranks == [["b", "a"]]
    ranks = rank_replicas(["a", "b"], {"a": 4}, {}, num_prompt_blocks=40)
    assert ranks == [["a"], ["b"]]


def test_ties_go_to_the_least_recently_routed():
    last: dict[str, int] = {}
    picks = []
    for step in range(6):
        pick = rank_replicas(["a", "b", "c"], {}, {}, num_prompt_blocks=0, last_routed=last)[0][0]
        last[pick] = step
        picks.append(pick)
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_rank_refuses_bad_arguments():
    with pytest.raises(ConfigError, match="at least one"):
        rank_replicas([], {}, {}, num_prompt_blocks=1)
    with pytest.raises(ConfigError, match="max_imbalance"):
        rank_replicas(["a"], {}, {}, num_prompt_blocks=1, max_imbalance=-1)
    with pytest.raises(ConfigError, match="min_match_fraction"):
        rank_replicas(["a"], {}, {}, num_prompt_blocks=1, min_match_fraction=2.0)
