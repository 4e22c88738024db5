"""The split math behind the protocols: pure functions, checked over many seeds."""

from __future__ import annotations

import numpy as np
import pytest

from fedlabels.data import partition as P
from fedlabels.data.chestxray import NIH_BATCH_SIZES, batch_of_rank
from fedlabels.data.common import PrepareError


def test_group_split_keeps_patients_whole_and_hits_fractions():
    rng = np.random.default_rng(0)
    groups = [f"p{int(i)}" for i in rng.integers(0, 300, 1000)]
    parts = P.group_split(groups, [0.7, 0.1, 0.2], np.random.default_rng(1))
    assert sorted(i for p in parts for i in p) == list(range(1000))
    owners = [{groups[i] for i in p} for p in parts]
    assert not (owners[0] & owners[1]) and not (owners[0] & owners[2]) and not (owners[1] & owners[2])
    sizes = np.array([len(p) for p in parts]) / 1000
    assert np.abs(sizes - [0.7, 0.1, 0.2]).max() < 0.02
    assert P.group_split(groups, [0.7, 0.1, 0.2], np.random.default_rng(1)) == parts  # seeded


def test_train_val_split_tiny_sites_still_get_validation():
    tr, va = P.train_val_split(["a", "a", "b", "c"], 0.1, np.random.default_rng(0))
    assert va and tr and not set(tr) & set(va)
    assert P.train_val_split(["a"], 0.2, np.random.default_rng(0)) == ([0], [])


@pytest.mark.parametrize("c,k", [(5, 5), (8, 8), (14, 4), (7, 3)])
def test_missing_class_sets_cover_every_class_and_no_site_has_all(c, k):
    for seed in range(30):
        for missing in range(1, c):
            if (c - missing) * k < c:
                with pytest.raises(PrepareError):
                    P.missing_class_sets(c, k, missing, np.random.default_rng(seed))
                continue
            sets = P.missing_class_sets(c, k, missing, np.random.default_rng(seed))
            assert all(len(s) == c - missing for s in sets)
            assert set().union(*map(set, sets)) == set(range(c))


def test_missing_class_sets_extreme_case_is_a_permutation():
    sets = P.missing_class_sets(8, 8, 7, np.random.default_rng(3))
    assert sorted(s[0] for s in sets) == list(range(8))


def test_shared_class_sets():
    for shared in (0, 1, 2, 4, 8, 12, 14):
        sets = P.shared_class_sets(14, 4, shared, np.random.default_rng(shared))
        assert len(set.intersection(*map(set, sets))) == (shared if shared < 14 else 14)
        assert set().union(*map(set, sets)) == set(range(14))
    with pytest.raises(PrepareError):
        P.shared_class_sets(3, 5, 0, np.random.default_rng(0))


def test_dirichlet_split_partitions_and_guards_empty_sites():
    y = np.random.default_rng(0).integers(0, 8, 2000)
    parts = P.dirichlet_split(y, 4, 0.5, np.random.default_rng(1), min_size=10)
    assert sorted(i for p in parts for i in p) == list(range(2000)) and min(map(len, parts)) >= 10
    with pytest.raises(PrepareError):
        P.dirichlet_split(y[:6], 4, 0.5, np.random.default_rng(1), min_size=2)


def test_balanced_test_reaches_per_class_counts():
    rng = np.random.default_rng(0)
    labels = (rng.random((3000, 6)) < [0.3, 0.2, 0.1, 0.08, 0.05, 0.04]).astype(int)
    idx, got = P.balanced_test(labels, 50, np.random.default_rng(1))
    assert len(set(idx)) == len(idx) and (got >= 50).all()
    sub = labels[idx]
    assert ((sub == 1).sum(0) >= 50).all() and ((sub == 0).sum(0) >= 50).all()


def test_parse_supervision_letters_and_names():
    assert P.parse_supervision("U,B,L", 3) == ["none", "bbox", "pixel"]
    assert P.parse_supervision("LBIU", 4) == ["pixel", "bbox", "image", "none"]
    assert P.parse_supervision("pixel,image", 2) == ["pixel", "image"]
    assert P.parse_supervision(None, 2) == ["pixel", "pixel"]
    with pytest.raises(PrepareError, match="3 sites"):
        P.parse_supervision("L,B", 3)
    with pytest.raises(PrepareError, match="unknown level"):
        P.parse_supervision("L,Q", 2)


def test_parse_site_classes():
    assert P.parse_site_classes("a,b;c;0", ["a", "b", "c"]) == [[0, 1], [2], [0]]
    with pytest.raises(PrepareError, match="unknown class"):
        P.parse_site_classes("a;zz", ["a", "b"])


def test_nih_batch_boundaries_from_official_order():
    assert batch_of_rank(0) == 1 and batch_of_rank(4998) == 1 and batch_of_rank(4999) == 2
    assert batch_of_rank(14998) == 2 and batch_of_rank(14999) == 3
    assert batch_of_rank(sum(NIH_BATCH_SIZES) - 1) == 12 and sum(NIH_BATCH_SIZES) == 112120


class ScriptedDraws:
    """numpy Generator's two draws the RSCFed split makes, scripted so the split can be worked out by hand:
    ``permutation(n)`` returns ``order``, ``permutation(array)`` the array unchanged, ``dirichlet`` the
    next listed proportions (checking that ``num_sites`` proportions are drawn, as the released code does)."""

    def __init__(self, order, proportions, num_sites):
        self.order, self.proportions, self.num_sites = order, list(proportions), num_sites

    def permutation(self, x):
        return np.array(self.order) if isinstance(x, int) else np.asarray(x)

    def dirichlet(self, alpha):
        assert len(alpha) == self.num_sites
        return np.array(self.proportions.pop(0))


def test_rscfed_split_by_hand():
    """24 cases: class 0 at 0-9, class 1 at 10-15, class 2 at 16-23; 1 labeled + 2 unlabeled sites,
    labeled fraction 0.2, order = 23, 22, ..., 0.

    block B = int(24 x 0.2) = 4: the labeled site takes 23, 22, 21, 20. The pool is 19..0, N = 20,
    cap N / U = 10.
    class 0 (9..0), p = (.3, .5 | .2) -> (.375, .625): cut at int(3.75) = 3 -> u1 9, 8, 7; u2 6..0 (3, 7)
    class 1 (15..10), p = (.1, .6 | .3) -> (1/7, 6/7): cut at int(6/7) = 0 -> u2 takes all six (3, 13)
    class 2 (19..16), p = (.2, .7 | .1): u2 holds 13 >= 10, capped to 0 -> (1, 0): u1 takes all four (7, 13).
    Without the cap, class 2 would go to u2 (cut at int(.2/.9 x 4) = 0)."""
    labels = [0] * 10 + [1] * 6 + [2] * 8
    draws = ScriptedDraws(list(range(23, -1, -1)), [(.3, .5, .2), (.1, .6, .3), (.2, .7, .1)], 3)
    parts = P.rscfed_split(labels, 1, 3, 0.5, draws, labeled_fraction=0.2, min_size=2)
    assert parts == [[20, 21, 22, 23], [7, 8, 9, 16, 17, 18, 19], [0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15]]
    assert draws.proportions == []
    # min_size 8 is not met by the first draw (7 < 8): the Dirichlet part is drawn again, the block kept
    draws = ScriptedDraws(list(range(23, -1, -1)), [(.3, .5, .2), (.1, .6, .3), (.2, .7, .1),
                                                      (.5, .5, 0), (.5, .5, 0), (.5, .5, 0)], 3)
    parts = P.rscfed_split(labels, 1, 3, 0.5, draws, labeled_fraction=0.2, min_size=8)
    # second draw: class 0 cut at 5 (9..5 | 4..0), class 1 at 3 (15..13 | 12..10), class 2 at 2 (19, 18 | 17, 16)
    assert parts == [[20, 21, 22, 23], [5, 6, 7, 8, 9, 13, 14, 15, 18, 19], [0, 1, 2, 3, 4, 10, 11, 12, 16, 17]]


def test_rscfed_split_two_labeled_blocks_and_the_rest_for_the_unlabeled_sites():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 4, 500)
    parts = P.rscfed_split(labels, 2, 4, 0.5, np.random.default_rng(0))
    assert [len(p) for p in parts[:2]] == [50, 50]  # int(500 x 0.1) each
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(500))  # a partition: every case once, blocks disjoint
    assert min(len(p) for p in parts[2:]) >= 10
    assert parts == P.rscfed_split(labels, 2, 4, 0.5, np.random.default_rng(0))  # the seed decides
    with pytest.raises(PrepareError, match="at least one unlabeled site"):
        P.rscfed_split(labels, 4, 4, 0.5, np.random.default_rng(0))
    with pytest.raises(PrepareError, match="labeled fraction"):
        P.rscfed_split(labels, 2, 4, 0.5, np.random.default_rng(0), labeled_fraction=0.5)
