"""The papers' site splits, as pure functions of labels, patients and a seed.

Nothing here reads or writes files: every function takes arrays (labels,
patient ids) and a ``numpy.random.Generator`` and returns index lists, so the
splits are unit-testable and identical for the same seed.

* ``group_split`` / ``split_groups_equal``  patient-level splits (no leakage)
* ``dirichlet_split``                       label skew, Dir(gamma) per class (IsoFed)
* ``rscfed_split``                          labeled blocks + capped Dirichlet over the unlabeled sites (RSCFed code)
* ``missing_class_sets``                    each site drops k classes, all covered (FedMLP)
* ``shared_class_sets``                     S shared classes + the rest dealt out (Surgical)
* ``mixed_class_sets``                      one site all classes, one none, the others a partition (mixed)
* ``balanced_test``                         n positives + n negatives per class (FedPSL)
* ``parse_supervision``                     FedMix letters L/B/I/U
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .common import PrepareError

# FedPSL Table I / III: the classes each site annotates.
FEDPSL_CLASSES_6 = ["infiltration", "effusion", "atelectasis", "nodule", "consolidation", "pneumothorax"]
FEDPSL_SITE_CLASSES_6 = [
    ["infiltration", "effusion", "atelectasis"],
    ["effusion", "atelectasis", "nodule"],
    ["atelectasis", "nodule", "consolidation"],
    ["nodule", "consolidation", "pneumothorax"],
]
FEDPSL_CLASSES_8 = FEDPSL_CLASSES_6 + ["tuberculosis", "covid19"]
FEDPSL_SITE_CLASSES_8 = FEDPSL_SITE_CLASSES_6 + [["tuberculosis"], ["covid19"]]

SUPERVISION_LETTERS = {"L": "pixel", "B": "bbox", "I": "image", "U": "none"}


def group_index(groups) -> "OrderedDict[str, list]":
    """Case indices per group (patient), groups in first-seen order."""
    out: OrderedDict = OrderedDict()
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def group_split(groups, fractions, rng) -> list:
    """Split case indices into len(fractions) parts at the group (patient) level.

    Groups are shuffled and dealt greedily so each part's *case* count is as
    close as possible to its fraction; no group is split across parts.
    """
    fractions = np.asarray(fractions, dtype=float)
    if (fractions < 0).any() or fractions.sum() <= 0:
        raise ValueError(f"bad split fractions {fractions.tolist()}")
    fractions = fractions / fractions.sum()
    by_group = group_index(groups)
    keys = list(by_group)
    order = rng.permutation(len(keys))
    total = sum(len(v) for v in by_group.values())
    target = fractions * total
    parts = [[] for _ in fractions]
    filled = np.zeros(len(fractions))
    for j in order:
        idx = by_group[keys[j]]
        # the part furthest below its target (relative) takes the next patient
        need = (target - filled) / np.maximum(target, 1e-9)
        need[target == 0] = -np.inf
        k = int(np.argmax(need))
        parts[k].extend(idx)
        filled[k] += len(idx)
    return [sorted(p) for p in parts]


def split_groups_equal(groups, k: int, rng) -> list:
    """k parts of (nearly) equal case counts, patient-level."""
    return group_split(groups, [1.0] * k, rng)


def train_val_split(groups, val_fraction: float, rng, min_train: int = 1) -> tuple:
    """(train, val) indices, patient-level; val gets at least one case when possible."""
    n = len(groups)
    if n == 0:
        return [], []
    if val_fraction <= 0 or n < 2:
        return list(range(n)), []
    train, val = group_split(groups, [1 - val_fraction, val_fraction], rng)
    if not val and len(group_index(groups)) > 1:
        # tiny sites: move one whole patient to validation
        by_group = group_index([groups[i] for i in train])
        first = next(iter(by_group.values()))
        moved = [train[i] for i in first]
        if len(train) - len(moved) >= min_train:
            val = sorted(moved)
            train = sorted(set(train) - set(moved))
    return train, val


def dirichlet_split(labels, num_sites: int, gamma: float, rng, min_size: int = 2, max_tries: int = 1000) -> list:
    """Per class, spread its cases over the sites by proportions ~ Dir(gamma).

    Resamples (up to ``max_tries``) until every site holds at least
    ``min_size`` cases -- the usual guard in the FL literature (RSCFed,
    IsoFed) so no site ends up empty. Smaller gamma = more label skew.
    """
    labels = np.asarray(labels)
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    classes = np.unique(labels)
    if len(labels) < num_sites * min_size:
        raise PrepareError(f"{len(labels)} cases cannot fill {num_sites} sites with at least {min_size} each")
    for _ in range(max_tries):
        owner = np.empty(len(labels), dtype=int)
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet([gamma] * num_sites)
            cuts = (np.cumsum(props)[:-1] * len(idx)).round().astype(int)
            for k, part in enumerate(np.split(idx, cuts)):
                owner[part] = k
        sizes = np.bincount(owner, minlength=num_sites)
        if sizes.min() >= min_size:
            return [np.flatnonzero(owner == k).tolist() for k in range(num_sites)]
    raise PrepareError(f"Dirichlet split with gamma={gamma} left a site with fewer than {min_size} cases "
                       f"after {max_tries} tries; use more cases, fewer sites or a larger gamma")


def rscfed_split(labels, num_labeled: int, num_sites: int, gamma: float, rng, labeled_fraction: float = 0.1,
                 min_size: int = 10, max_tries: int = 1000) -> list:
    """RSCFed's labeled-block + capped-Dirichlet split (released code, ``cifar_load.py``,
    ``partition_data`` with ``partition='noniid'``), as a rule on indices:

    1. one permutation of all cases (the code shuffles ``X_train`` and ``y_train`` together);
    2. labeled site i (i < ``num_labeled``) takes the block ``order[i*B:(i+1)*B]``,
       B = int(n * ``labeled_fraction``) (the code: ``sup_size = int(len(y_train) / 10)``);
    3. the rest of the order is the pool of the U = ``num_sites - num_labeled`` unlabeled sites,
       N cases. Per class c, in order of class value: its pool cases are permuted, proportions
       p ~ Dir(gamma) over ``num_sites`` entries of which the first U are used (the code draws
       ``n_parties`` proportions and zips them with the U unlabeled lists), an unlabeled site that
       already holds >= N / U cases gets p = 0 (the cap), p is renormalised and the class's cases
       are cut at floor(cumsum(p) * n_c) (``astype(int)``);
    4. redrawn (step 3 only) until every unlabeled site holds at least ``min_size`` cases
       (the code's ``min_require_size = 10``).

    Where the code differs, deliberately: its pool offset is one block whatever the number of
    labeled clients (``+ sup_size``), which overlaps the labeled blocks when there are more than
    one; here the pool is every case outside the labeled blocks. Its class loop runs over
    ``range(10)``; here over the classes present. Returns ``num_sites`` sorted index lists, the
    labeled sites first."""
    labels = np.asarray(labels)
    n = len(labels)
    unlabeled = num_sites - num_labeled
    if not 0 <= num_labeled <= num_sites or unlabeled < 1:
        raise PrepareError(f"the RSCFed split needs at least one unlabeled site: {num_labeled} labeled of {num_sites}")
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if not (0 < labeled_fraction and num_labeled * labeled_fraction < 1):
        raise PrepareError(f"labeled fraction {labeled_fraction}: must be > 0, and x {num_labeled} labeled sites < 1")
    block = int(n * labeled_fraction)
    order = np.asarray(rng.permutation(n))
    parts = [sorted(order[i * block:(i + 1) * block].tolist()) for i in range(num_labeled)]
    if num_labeled and block < 1:
        raise PrepareError(f"{n} cases x labeled fraction {labeled_fraction} leave the labeled sites no case")
    pool = order[num_labeled * block:]
    cap = len(pool) / unlabeled
    if len(pool) < unlabeled * min_size:
        raise PrepareError(f"{len(pool)} cases outside the labeled blocks cannot give {unlabeled} unlabeled sites "
                           f"at least {min_size} each")
    for _ in range(max_tries):
        batch = [[] for _ in range(unlabeled)]
        for c in np.unique(labels):
            idx = np.asarray(rng.permutation(pool[labels[pool] == c]))
            p = np.asarray(rng.dirichlet([gamma] * num_sites))[:unlabeled]
            p = p * np.array([len(b) < cap for b in batch])  # the cap: a site at its fair share takes no more
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for b, part in zip(batch, np.split(idx, cuts)):
                b.extend(part.tolist())
        if min(len(b) for b in batch) >= min_size:
            return parts + [sorted(b) for b in batch]
    raise PrepareError(f"RSCFed split with gamma={gamma} left an unlabeled site with fewer than {min_size} cases "
                       f"after {max_tries} tries; use more cases, fewer sites or a larger gamma")


def iid_split(n: int, num_sites: int, rng) -> list:
    idx = rng.permutation(n)
    return [sorted(p.tolist()) for p in np.array_split(idx, num_sites)]


def missing_class_sets(num_classes: int, num_sites: int, missing: int, rng) -> list:
    """Each site annotates num_classes - missing classes; every class is annotated
    somewhere; no site annotates all when missing >= 1 (FedMLP's setting).

    Classes are dealt round-robin from a random permutation so coverage holds,
    then each site is topped up with random extra classes.
    """
    keep = num_classes - missing
    if not 0 <= missing < num_classes:
        raise PrepareError(f"--missing must be in 0..{num_classes - 1} for {num_classes} classes, got {missing}")
    if keep * num_sites < num_classes:
        raise PrepareError(f"{num_sites} sites annotating {keep} class{'es' if keep != 1 else ''} each cannot cover "
                           f"all {num_classes} classes; "
                           f"use more sites or a smaller --missing")
    sets = [set() for _ in range(num_sites)]
    perm = rng.permutation(num_classes)
    site_order = rng.permutation(num_sites)
    for j, c in enumerate(perm):
        sets[site_order[j % num_sites]].add(int(c))
    for s in sets:
        rest = [c for c in rng.permutation(num_classes) if c not in s]
        while len(s) < keep:
            s.add(int(rest.pop(0)))
    return [sorted(s) for s in sets]


def shared_class_sets(num_classes: int, num_sites: int, shared: int, rng) -> list:
    """``shared`` random classes annotated by every site; the other classes are
    dealt out (random order, round-robin) so each appears at least once."""
    if not 0 <= shared <= num_classes:
        raise PrepareError(f"--shared must be in 0..{num_classes}, got {shared}")
    perm = [int(c) for c in rng.permutation(num_classes)]
    common, rest = perm[:shared], perm[shared:]
    sets = [set(common) for _ in range(num_sites)]
    for j, c in enumerate(rest):
        sets[j % num_sites].add(c)
    empty = [k for k, s in enumerate(sets) if not s]
    if empty:
        raise PrepareError(f"with --shared {shared} and {num_classes} classes, sites {[k + 1 for k in empty]} "
                           f"would annotate nothing; use fewer sites or more shared classes")
    return [sorted(s) for s in sets]


def mixed_class_sets(num_classes: int, num_sites: int, rng=None) -> list:
    """The classes each site of a "mixed" federation annotates, as index lists, one per site:
    site 1 every class, the last site none, and the ``num_sites - 2`` sites between them a
    partition of the classes (each class annotated by site 1 and exactly one of them) in
    contiguous near-equal blocks (``numpy.array_split``) of the classes in order, or, with ``rng``,
    of ``rng.permutation(num_classes)`` (the one draw made). 8 classes, 4 sites:
    [0..7], [0, 1, 2, 3], [4, 5, 6, 7], []. Needs 3 to ``num_classes + 2`` sites."""
    if not 3 <= num_sites <= num_classes + 2:
        raise PrepareError(f"a mixed federation needs 3 to {num_classes + 2} sites (site 1 annotates every class, "
                           f"the last site none, each site between them its own share of the {num_classes} "
                           f"classes), not {num_sites}")
    order = np.arange(num_classes) if rng is None else np.asarray(rng.permutation(num_classes))
    middle = [sorted(int(c) for c in block) for block in np.array_split(order, num_sites - 2)]
    return [list(range(num_classes))] + middle + [[]]


def mixed_roles(sets, num_classes: int) -> list:
    """Each site's role from the class indices it annotates: "full" (every class), "none" or "partial"."""
    return ["none" if not s else "full" if len(set(s)) == num_classes else "partial" for s in sets]


def balanced_test(labels, per_class: int, rng) -> tuple:
    """Indices of a test set with ``per_class`` positives and negatives per class.

    ``labels`` is [N, C] in {0, 1}. Classes are filled rarest first; a case is
    used once and its full label row counts for every class, so the set holds
    at least ``per_class`` of each where the pool allows. Returns (sorted
    indices, achieved [C, 2] counts of positives and negatives).
    """
    labels = np.asarray(labels)
    n, c = labels.shape
    chosen = np.zeros(n, bool)
    order = np.argsort(labels.sum(0), kind="stable")
    for k in order:
        for value in (1, 0):
            have = int((labels[chosen, k] == value).sum())
            need = per_class - have
            if need <= 0:
                continue
            pool = np.flatnonzero((labels[:, k] == value) & ~chosen)
            take = rng.permutation(pool)[:need]
            chosen[take] = True
    idx = np.flatnonzero(chosen)
    counts = np.stack([(labels[idx] == 1).sum(0), (labels[idx] == 0).sum(0)], 1)
    return idx.tolist(), counts


def parse_supervision(text, num_sites: int) -> list:
    """'U,B,L' (letters L/B/I/U or the level names) -> ['none', 'bbox', 'pixel']."""
    if text is None:
        return ["pixel"] * num_sites
    parts = [p.strip() for p in str(text).replace(" ", "").split(",") if p.strip()]
    if len(parts) == 1 and len(parts[0]) == num_sites and num_sites > 1 and set(parts[0].upper()) <= set(SUPERVISION_LETTERS):
        parts = list(parts[0])
    out = []
    for p in parts:
        if p.upper() in SUPERVISION_LETTERS:
            out.append(SUPERVISION_LETTERS[p.upper()])
        elif p.lower() in SUPERVISION_LETTERS.values():
            out.append(p.lower())
        else:
            raise PrepareError(f"--supervision: unknown level {p!r}; use L (pixel), B (bbox), I (image), U (unlabeled)")
    if len(out) != num_sites:
        raise PrepareError(f"--supervision lists {len(out)} levels ({text}) for {num_sites} sites")
    return out


def parse_site_classes(text, classes: list, allow_none: bool = False) -> list:
    """'a,b;c;d,e' (names or 0-based indices) -> list of index lists, one per site.

    A site's part may be ``*`` alone: every class; with ``allow_none`` (a protocol that writes
    unlabeled sites), ``-`` alone: no class (an empty list)."""
    out = []
    for k, part in enumerate(str(text).split(";")):
        toks = [t.strip() for t in part.split(",") if t.strip()]
        if any(t in ("*", "-") for t in toks) and len(toks) > 1:
            raise PrepareError(f"--site-classes: site {k + 1}: '*' (every class) and '-' (none) stand alone, "
                               f"not among class names ({part.strip()!r})")
        if toks == ["*"]:
            out.append(list(range(len(classes))))
            continue
        if toks == ["-"]:
            if not allow_none:
                raise PrepareError(f"--site-classes: site {k + 1}: '-' (no class) is for protocols with unlabeled "
                                   f"sites (mixed); here every site annotates at least one class")
            out.append([])
            continue
        idx = []
        for tok in toks:
            if tok.isdigit() and int(tok) < len(classes):
                idx.append(int(tok))
            elif tok in classes:
                idx.append(classes.index(tok))
            else:
                raise PrepareError(f"--site-classes: site {k + 1}: unknown class {tok!r}; classes are {classes}")
        if not idx:
            raise PrepareError(f"--site-classes: site {k + 1} annotates no class"
                               + (" (write '-' for a site that annotates none)" if allow_none else ""))
        out.append(sorted(set(idx)))
    return out
