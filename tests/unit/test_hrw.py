"""Weighted rendezvous (HRW) placement (memkv.client.hrw), with pinned numbers.

Behaviour under test (as pymemcache's test_rendezvous.py pins its ring):
* placements of a fixed key set are pinned: a change to the hash, the seed derivation or the
  scoring silently re-homes every cached block of every deployment, so it must fail here;
* adding a 4th node to 3 moves exactly the keys the new node wins, and nothing else; removing a
  node moves exactly that node's keys, and nothing else (exact, deterministic counts);
* weights: a node of weight 2 owns about twice the keys of a node of weight 1 (exact count);
* ties go to the lower index, deterministically, on both the uniform and the weighted path;
* the owner's *name* does not depend on the order in which servers are listed.
"""

from __future__ import annotations

import itertools
import math

import pytest
import xxhash

from memkv.client.hrw import RendezvousRing

pytestmark = pytest.mark.unit

NAMES3 = ["10.0.0.1:9900", "10.0.0.2:9900", "10.0.0.3:9900"]
NAMES4 = [*NAMES3, "10.0.0.4:9900"]
PIN_KEYS = [f"key-{i}".encode() for i in range(10)]
KEYS_10K = [f"block/{i:05d}".encode() for i in range(10_000)]


def test_placements_of_a_fixed_key_set_are_pinned() -> None:
    assert RendezvousRing(NAMES3).owners(PIN_KEYS) == [2, 0, 0, 0, 0, 2, 0, 2, 1, 2]
    assert RendezvousRing(NAMES4).owners(PIN_KEYS) == [2, 0, 3, 0, 0, 2, 0, 2, 1, 2]
    assert RendezvousRing(NAMES3, [1, 2, 1]).owners(PIN_KEYS) == [2, 0, 0, 0, 0, 2, 0, 1, 1, 1]


def test_placement_counts_over_10k_keys_are_pinned() -> None:
    owners = RendezvousRing(NAMES3).owners(KEYS_10K)
    assert [owners.count(i) for i in range(3)] == [3295, 3336, 3369]


def test_uniform_score_is_xxh3_64_of_the_key_seeded_by_the_node_name() -> None:
    ring = RendezvousRing(NAMES3)
    for i, name in enumerate(NAMES3):
        node_seed = xxhash.xxh3_64_intdigest(name.encode(), seed=0)
        assert ring.score(i, b"k") == float(xxhash.xxh3_64_intdigest(b"k", seed=node_seed))


def test_weighted_score_is_the_logarithmic_method() -> None:
    ring = RendezvousRing(NAMES3, [1.0, 2.0, 0.5])
    for i, name in enumerate(NAMES3):
        h = xxhash.xxh3_64_intdigest(b"k", seed=xxhash.xxh3_64_intdigest(name.encode()))
        u = (h + 0.5) / 2**64
        assert ring.score(i, b"k") == pytest.approx(-ring.weights[i] / math.log(u), rel=1e-12)


def test_adding_a_fourth_node_moves_only_keys_to_the_new_node() -> None:
    before = RendezvousRing(NAMES3).owners(KEYS_10K)
    after = RendezvousRing(NAMES4).owners(KEYS_10K)
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert all(after[i] == 3 for i in moved)  # every moved key went to the new node
    assert after.count(3) == len(moved)  # and the new node took nothing else
    assert len(moved) == 2488  # ~1/4 of 10k, exact because placement is deterministic


def test_removing_a_node_moves_only_that_nodes_keys() -> None:
    before = RendezvousRing(NAMES3).owners(KEYS_10K)
    survivors = [NAMES3[0], NAMES3[2]]
    after_names = [survivors[o] for o in RendezvousRing(survivors).owners(KEYS_10K)]
    before_names = [NAMES3[o] for o in before]
    moved = [i for i in range(len(KEYS_10K)) if before_names[i] != after_names[i]]
    assert all(before_names[i] == NAMES3[1] for i in moved)
    assert len(moved) == before.count(1) == 3336
    # The removed node's keys spread over both survivors, not onto one.
    spread = {after_names[i] for i in moved}
    assert spread == set(survivors)


def _owner_names(names: list[str], keys: list[bytes]) -> list[str]:
    return [names[o] for o in RendezvousRing(names).owners(keys)]


def test_removing_and_re_adding_a_node_restores_every_placement() -> None:
    keys = KEYS_10K[:2000]
    before = _owner_names(NAMES4, keys)
    without = NAMES4[:2] + NAMES4[3:]
    assert _owner_names(without, keys) != before
    assert _owner_names([*without, NAMES4[2]], keys) == before  # re-added at the end of the list


def test_weight_two_node_owns_about_two_thirds_of_the_keys() -> None:
    owners = RendezvousRing(NAMES3[:2], [2.0, 1.0]).owners(KEYS_10K)
    assert owners.count(0) == 6606  # 2/3 of 10k is 6667
    assert owners.count(1) == 3394


def test_weights_1_2_1_split_keys_in_proportion() -> None:
    owners = RendezvousRing(NAMES3, [1, 2, 1]).owners(KEYS_10K)
    assert [owners.count(i) for i in range(3)] == [2515, 5004, 2481]


def test_raising_a_weight_moves_keys_only_towards_that_node() -> None:
    before = RendezvousRing(NAMES3, [1.0, 1.0, 1.01]).owners(KEYS_10K)
    after = RendezvousRing(NAMES3, [1.0, 2.0, 1.01]).owners(KEYS_10K)
    moved = [i for i in range(len(KEYS_10K)) if before[i] != after[i]]
    assert moved and all(after[i] == 1 for i in moved)


def test_owner_name_does_not_depend_on_server_list_order() -> None:
    reference = [NAMES4[o] for o in RendezvousRing(NAMES4).owners(KEYS_10K[:1000])]
    for perm in itertools.islice(itertools.permutations(NAMES4), 1, 24, 5):
        assert [perm[o] for o in RendezvousRing(perm).owners(KEYS_10K[:1000])] == reference


def test_ties_go_to_the_lower_index_on_the_uniform_path() -> None:
    # Two entries with the same name hash identically for every key: a guaranteed tie.
    ring = RendezvousRing(["same", "same"])
    assert set(ring.owners(KEYS_10K[:500])) == {0}
    ring3 = RendezvousRing(["other", "same", "same"])
    owners = ring3.owners(KEYS_10K[:500])
    assert 2 not in owners and set(owners) == {0, 1}


def test_ties_go_to_the_lower_index_on_the_weighted_path() -> None:
    ring = RendezvousRing(["same", "same", "other"], [1.5, 1.5, 1.0])
    owners = ring.owners(KEYS_10K[:500])
    assert 1 not in owners and set(owners) == {0, 2}


def test_placement_is_deterministic_across_instances() -> None:
    assert RendezvousRing(NAMES4).owners(KEYS_10K) == RendezvousRing(list(NAMES4)).owners(KEYS_10K)


def test_seed_is_injectable_and_changes_placement() -> None:
    default = RendezvousRing(NAMES3).owners(KEYS_10K[:1000])
    seeded = RendezvousRing(NAMES3, seed=1).owners(KEYS_10K[:1000])
    assert seeded != default
    assert seeded == RendezvousRing(NAMES3, seed=1).owners(KEYS_10K[:1000])


def test_single_node_owns_everything() -> None:
    assert set(RendezvousRing(["only"]).owners(KEYS_10K[:100])) == {0}


@pytest.mark.parametrize("names,weights", [([], None), (["a", "b"], [1.0]), (["a"], [0.0]), (["a"], [-1.0])])
def test_bad_rings_are_value_errors(names, weights) -> None:
    with pytest.raises(ValueError):
        RendezvousRing(names, weights)
