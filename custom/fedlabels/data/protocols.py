"""The papers' experimental setups as protocols: sources + options -> a SplitPlan.

=================  ==========================================================
protocol           what it builds
=================  ==========================================================
fedpsl-6           FedPSL Table I: NIH batches 2-5 -> 4 sites x 1000 cases,
                   6 classes, per-site label sets; balanced test 300+300/class
fedpsl-8           FedPSL Table III: + Tuberculosis and COVID-19 one-class sites
fedmlp             FedMLP: ICH (5 subtypes) or NIH (8 most frequent, PA view);
                   equal patient-level shares, ``--missing`` k classes per site
surgical-sim       Surgical Aggregation ablation: NIH IID over K sites,
                   ``--shared`` S classes at every site, the rest dealt out
surgical-real      NIH + CheXpert as two sites over their 20-class union;
                   MIMIC-CXR as external test
isofed             IsoFed: a multi-class set, Dirichlet(``--gamma``) label skew,
                   ``--labeled`` sites keep labels, the others are unlabeled;
                   ``--partition rscfed``: RSCFed's released split instead
                   (each labeled site a random block of ``--labeled-fraction``
                   of the cases, the rest Dirichlet-split over the unlabeled
                   sites with a cap, ``partition.rscfed_split``)
partial            any multi-class set as one-vs-rest multi-label, each site
                   annotating a chosen or random subset of the classes
mixed              one-vs-rest multi-label as ``partial``, sites labeling
                   differently at once: site 1 every class, the last site
                   none (``supervision: none``), the ``--sites`` (4) - 2 sites
                   between them a random partition of the classes drawn from
                   the seed (each class at site 1 and exactly one of them;
                   ``--site-classes`` fixes the sets, ``*`` = all, ``-`` = none)
fedmix             FedMix: segmentation sites, each with a supervision level
                   (``--supervision`` L/B/I/U), test = one CV fold per site
=================  ==========================================================

Every split is patient-level where the dataset has patient ids, and every
random choice comes from one ``numpy.random.Generator`` seeded by ``--seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import partition as P
from .build import Entry, ExtraTest, SplitPlan, SitePlan
from .chestxray import CHEXPERT_CLASSES, NIH_CLASSES, UNION20
from .common import PrepareError, warn


@dataclass
class Options:
    seed: int = 0
    sites: int | None = None
    size: int | None = None
    val_fraction: float = 0.15
    limit: int | None = None
    cases: int | None = None
    test_cases: int | None = None
    test_per_class: int = 300
    test_fraction: float | None = None
    missing: int | None = None
    gamma: float | None = None
    labeled: str | None = None
    partition: str = "dirichlet"
    labeled_fraction: float | None = None
    supervision: str | None = None
    shared: int | None = None
    site_classes: str | None = None
    folds: int = 5
    fold: int = 0
    test_split: str = "paper"
    sample: str = "first"
    subset: int = 180000
    keep_normal: bool = False
    name: str | None = None


def site_names(k: int) -> list:
    return [f"site-{i + 1}" for i in range(k)]


def _subsample(idx, n, rng) -> list:
    idx = list(idx)
    if n is None or len(idx) <= n:
        return idx
    return sorted(int(i) for i in rng.choice(idx, size=n, replace=False))


def _vec(case, src_classes, classes, fill) -> list:
    """The case's source labels mapped onto ``classes`` (``fill`` where the source has none)."""
    pos = {c: i for i, c in enumerate(src_classes)}
    return [int(case.labels[pos[c]]) if c in pos else fill for c in classes]


def _masked(full, classes, annotated) -> list:
    return [v if c in annotated else -1 for v, c in zip(full, classes)]


def _split_site(cases, idx, rng, val_fraction, make):
    """(training, validation) entries of one site, patient-level."""
    groups = [cases[i].patient for i in idx]
    tr, va = P.train_val_split(groups, val_fraction, rng)
    return [make(cases[idx[j]]) for j in tr], [make(cases[idx[j]]) for j in va]


def _pool_and_test(src, o: Options, rng):
    """Training pool and test indices: the official split if the source has one, else patient-level."""
    cases = src.cases
    splits = {c.meta.get("split") for c in cases}
    if {"train", "test"} <= splits:
        pool = [i for i, c in enumerate(cases) if c.meta["split"] == "train"]
        test = [i for i, c in enumerate(cases) if c.meta["split"] == "test"]
        how = "official train split for the sites, official test split for testing"
    else:
        frac = o.test_fraction if o.test_fraction is not None else 0.2
        rest, test = P.group_split([c.patient for c in cases], [1 - frac, frac], rng)
        pool = rest
        how = f"patient-level split, {frac:.0%} test"
    pool = _subsample(pool, o.limit, rng)
    test = _subsample(test, o.test_cases, rng)
    return pool, test, how


def _classes_for(src, o):
    if src.task != "multiclass":
        raise PrepareError(f"{src.name} is a {src.task} dataset; this protocol needs a multi-class one")
    return list(src.classes)


# ------------------------------------------------------------------ isofed


def parse_labeled(text, k: int) -> list:
    if text is None:
        return [0]
    text = str(text).strip()
    if "," not in text:
        n = int(text)
        if not 0 <= n <= k:
            raise PrepareError(f"--labeled {n}: must be between 0 and the {k} sites")
        return list(range(n))
    idx = [int(t) - 1 for t in text.split(",") if t.strip()]
    if any(not 0 <= i < k for i in idx):
        raise PrepareError(f"--labeled {text}: site numbers must be in 1..{k}")
    return sorted(set(idx))


def isofed(sources, o: Options, rng, say=print) -> SplitPlan:
    src = sources["main"]
    classes = _classes_for(src, o)
    k = o.sites or 4
    gamma = 0.8 if o.gamma is None else o.gamma
    labeled = parse_labeled(o.labeled, k)
    pool, test, how = _pool_and_test(src, o, rng)
    cases = src.cases
    # Dirichlet over patients (each patient takes its first case's class).
    by_patient = P.group_index([cases[i].patient for i in pool])
    patients = list(by_patient)
    plabels = [cases[pool[by_patient[p][0]]].labels for p in patients]
    if o.partition == "rscfed":
        frac = 0.1 if o.labeled_fraction is None else o.labeled_fraction
        unl = [s for s in range(k) if s not in labeled]
        # RSCFed's min_require_size 10, relaxed where a --limit run has too few cases to reach it
        min_size = 10 if len(patients) >= 20 * k else 2
        drawn = P.rscfed_split(plabels, len(labeled), k, gamma, rng, labeled_fraction=frac, min_size=min_size)
        parts = [None] * k
        for s, part in zip(labeled + unl, drawn):  # the labeled blocks first, then the unlabeled shares
            parts[s] = part
        split_name = f"RSCFed split (labeled block {frac:g}, capped Dirichlet(gamma={gamma}) over the unlabeled sites)"
    elif o.partition == "dirichlet":
        if o.labeled_fraction is not None:
            raise PrepareError("--labeled-fraction applies to --partition rscfed only")
        min_size = 4 if len(patients) >= 8 * k else 2
        parts = P.dirichlet_split(plabels, k, gamma, rng, min_size=min_size)
        split_name = f"Dirichlet(gamma={gamma})"
    else:
        raise PrepareError(f"--partition {o.partition!r}: use 'dirichlet' or 'rscfed'")
    sites = []
    for s, name in enumerate(site_names(k)):
        idx = sorted(pool[j] for p in parts[s] for j in by_patient[patients[p]])
        is_lab = s in labeled

        def make(c, is_lab=is_lab):
            return Entry(c, c.labels if is_lab else -1, c.labels)

        tr, va = _split_site(cases, idx, rng, o.val_fraction, make)
        sites.append(SitePlan(name, classes if is_lab else [], "image" if is_lab else "none", tr, va,
                              f"{src.name} {split_name} share, {'labeled' if is_lab else 'unlabeled'}"))
    test_entries = [Entry(cases[i], cases[i].labels, cases[i].labels) for i in test]
    return SplitPlan(o.name or f"{src.name}-isofed", "multiclass", classes, src.channels, None, sites, test_entries,
                protocol={"name": "isofed", "sites": k, "gamma": gamma, "labeled_sites": [n + 1 for n in labeled],
                          "partition": o.partition,
                          **({"labeled_fraction": frac} if o.partition == "rscfed" else {}),
                          "val_fraction": o.val_fraction, "limit": o.limit, "test_cases": len(test), "split": how},
                sources=[src])


# ------------------------------------------------------------------ partial


def _site_shares(cases, pool, k: int, gamma, rng) -> tuple:
    """The pool's cases dealt to k sites by patient: Dirichlet(gamma) label skew, or IID equal shares
    (gamma None); returns (per-site case indices, how, in words)."""
    if gamma is not None:
        by_patient = P.group_index([cases[i].patient for i in pool])
        patients = list(by_patient)
        parts = P.dirichlet_split([cases[pool[by_patient[p][0]]].labels for p in patients], k, gamma, rng)
        return ([sorted(pool[j] for p in part for j in by_patient[patients[p]]) for part in parts],
                f"Dirichlet(gamma={gamma})")
    parts = P.split_groups_equal([cases[i].patient for i in pool], k, rng)
    return [[pool[j] for j in part] for part in parts], "IID, equal patient-level shares"


def _onehot(y, c: int) -> list:
    v = [0] * c
    v[int(y)] = 1
    return v


def partial(sources, o: Options, rng, say=print) -> SplitPlan:
    src = sources["main"]
    classes = _classes_for(src, o)
    c = len(classes)
    k = o.sites or 4
    pool, test, how = _pool_and_test(src, o, rng)
    cases = src.cases
    if o.site_classes:
        sets = P.parse_site_classes(o.site_classes, classes)
        if len(sets) != k:
            if o.sites is not None:
                raise PrepareError(f"--site-classes lists {len(sets)} sites but --sites is {k}")
            k = len(sets)
        uncovered = [classes[j] for j in range(c) if not any(j in s for s in sets)]
        if uncovered:
            warn(f"--site-classes: no site annotates {uncovered}")
    else:
        missing = o.missing if o.missing is not None else min(c // 2, c - math.ceil(c / k))
        sets = P.missing_class_sets(c, k, missing, rng)
    site_idx, split_how = _site_shares(cases, pool, k, o.gamma, rng)

    sites = []
    for s, name in enumerate(site_names(k)):
        annotated = [classes[j] for j in sets[s]]

        def make(cs, annotated=annotated):
            full = _onehot(cs.labels, c)
            return Entry(cs, _masked(full, classes, annotated), full)

        tr, va = _split_site(cases, site_idx[s], rng, o.val_fraction, make)
        sites.append(SitePlan(name, annotated, "image", tr, va, f"{src.name} {split_how}; annotates {annotated}"))
    test_entries = [Entry(cases[i], _onehot(cases[i].labels, c), _onehot(cases[i].labels, c)) for i in test]
    return SplitPlan(o.name or f"{src.name}-partial", "multilabel", classes, src.channels, None, sites, test_entries,
                protocol={"name": "partial", "sites": k, "site_classes": [[classes[j] for j in s] for s in sets],
                          "split": split_how, "test": how, "val_fraction": o.val_fraction, "limit": o.limit},
                sources=[src], notes=["multi-class labels viewed as one-vs-rest multi-label targets"])


# ------------------------------------------------------------------ mixed


def mixed(sources, o: Options, rng, say=print) -> SplitPlan:
    """Sites that label differently in one federation: site 1 annotates every class, the last site
    none (``supervision: none``, every label entry -1, true labels only in ``oracle.json``), and the
    sites between them a partition of the classes, ``partition.mixed_class_sets`` with the seed's
    generator (its first draw: one permutation of the classes, cut into near-equal contiguous
    blocks), so each class is annotated by site 1 and exactly one partial site. ``--site-classes``
    fixes the sets instead (``*`` every class, ``-`` none; the roles follow from the sets). The
    cases are split as ``partial`` splits them: IID equal patient-level shares, or
    Dirichlet(``--gamma``) label skew."""
    src = sources["main"]
    classes = _classes_for(src, o)
    c = len(classes)
    if o.missing is not None:
        raise PrepareError("--missing applies to fedmlp and partial; mixed deals the classes out itself "
                           "(or give --site-classes)")
    if o.site_classes:
        sets = P.parse_site_classes(o.site_classes, classes, allow_none=True)
        if o.sites is not None and len(sets) != o.sites:
            raise PrepareError(f"--site-classes lists {len(sets)} sites but --sites is {o.sites}")
        if not any(sets):
            raise PrepareError("--site-classes: no site annotates any class")
        uncovered = [classes[j] for j in range(c) if not any(j in s for s in sets)]
        if uncovered:
            warn(f"--site-classes: no site annotates {uncovered}")
        how_sets = "given (--site-classes)"
    else:
        k = 4 if o.sites is None else o.sites
        if k < 3:
            raise PrepareError(f"--sites {k}: mixed needs at least 3 sites (site 1 annotating every class, one or "
                               f"more sites a share of the classes, the last site none)")
        if k > c + 2:
            raise PrepareError(f"--sites {k}: mixed gives each of the {k - 2} sites between the first and the last "
                               f"its own share of the {c} classes, so at most {c + 2} sites")
        sets = P.mixed_class_sets(c, k, rng)
        how_sets = "random partition of the classes over the partial sites, drawn from the seed"
    k = len(sets)
    roles = P.mixed_roles(sets, c)
    pool, test, how = _pool_and_test(src, o, rng)
    cases = src.cases
    site_idx, split_how = _site_shares(cases, pool, k, o.gamma, rng)

    sites = []
    for s, name in enumerate(site_names(k)):
        annotated = [classes[j] for j in sets[s]]

        def make(cs, annotated=annotated):
            full = _onehot(cs.labels, c)
            return Entry(cs, _masked(full, classes, annotated), full)

        tr, va = _split_site(cases, site_idx[s], rng, o.val_fraction, make)
        what = {"full": "annotates every class", "none": "annotates no class (unlabeled)"}.get(
            roles[s], f"annotates {annotated}")
        sites.append(SitePlan(name, annotated, "none" if roles[s] == "none" else "image", tr, va,
                              f"{src.name} {split_how}; {roles[s]}: {what}"))
    test_entries = [Entry(cases[i], _onehot(cases[i].labels, c), _onehot(cases[i].labels, c)) for i in test]
    return SplitPlan(o.name or f"{src.name}-mixed", "multilabel", classes, src.channels, None, sites, test_entries,
                protocol={"name": "mixed", "sites": k, "site_classes": [[classes[j] for j in s] for s in sets],
                          "site_roles": roles, "class_sets": how_sets, "gamma": o.gamma, "split": split_how,
                          "test": how, "val_fraction": o.val_fraction, "limit": o.limit},
                sources=[src], notes=["multi-class labels viewed as one-vs-rest multi-label targets",
                                      f"site roles: {', '.join(f'{n} {r}' for n, r in zip(site_names(k), roles))}"])


# ------------------------------------------------------------------ fedmix


def fedmix(sources, o: Options, rng, say=print) -> SplitPlan:
    src = sources["main"]
    if not src.meta.get("seg_classes") or not any(c.mask is not None for c in src.cases):
        raise PrepareError(f"{src.name} has no segmentation masks; fedmix needs breast, ham10000, ph2 or retouch")
    classes = list(src.meta["seg_classes"])
    cases = src.cases
    natural = src.meta.get("sites") or []
    if natural:
        if o.sites is not None and o.sites != len(natural):
            raise PrepareError(f"{src.name} has {len(natural)} natural sites ({[s[0] for s in natural]}); "
                               f"--sites {o.sites} does not match")
        k = len(natural)
        site_idx = [[i for i, c in enumerate(cases) if c.meta.get("site") == key] for key, _ in natural]
        descs = [d for _, d in natural]
        if src.name == "breast" and not o.keep_normal:
            # FedMix: half of BUS's healthy images go to BUSIS so both have image-level negatives.
            normal = [i for i in site_idx[0] if cases[i].meta.get("category") == "normal"]
            moved = set(_subsample(normal, len(normal) // 2, rng))
            site_idx[0] = [i for i in site_idx[0] if i not in moved]
            site_idx[1] = sorted(site_idx[1] + sorted(moved))
            descs[1] += f" + {len(moved)} healthy BUS images"
    else:
        k = o.sites or 3
        parts = P.split_groups_equal([c.patient for c in cases], k, rng)
        site_idx = parts
        descs = [f"{src.name} random patient-level share {s + 1}/{k}" for s in range(k)]
    site_idx = [_subsample(idx, o.limit, rng) for idx in site_idx]
    levels = P.parse_supervision(o.supervision, k)
    if o.folds == 1 or o.folds < 0:
        raise PrepareError("--folds must be 0 (no test split) or >= 2")
    if o.folds and not 0 <= o.fold < o.folds:
        raise PrepareError(f"--fold must be in 0..{o.folds - 1}")
    sites, test = [], []
    for s, name in enumerate(site_names(k)):
        idx = site_idx[s]
        if not idx:
            raise PrepareError(f"{src.name}: {name} ({descs[s]}) has no cases")
        if o.folds:
            folds = P.group_split([cases[i].patient for i in idx], [1.0] * o.folds, rng)
            test_idx = [idx[j] for j in folds[o.fold]]
            rest = [idx[j] for f, part in enumerate(folds) if f != o.fold for j in part]
        else:
            test_idx, rest = [], list(idx)
        level = levels[s]
        tr, va = _split_site(cases, rest, rng, o.val_fraction, lambda c, level=level: Entry(c, supervision=level))
        test += [Entry(cases[i], extra={"site": name}) for i in test_idx]
        sites.append(SitePlan(name, classes if level != "none" else [], level, tr, va, descs[s]))
    test = _subsample_entries(test, o.test_cases, rng)
    letters = {v: kk for kk, v in P.SUPERVISION_LETTERS.items()}
    return SplitPlan(o.name or f"{src.name}-fedmix", "segmentation", classes, src.channels, None, sites, test or None,
                mask_mode=src.mask_mode,
                protocol={"name": "fedmix", "sites": k, "supervision": [letters[v] for v in levels],
                          "folds": o.folds, "fold": o.fold, "val_fraction": o.val_fraction, "limit": o.limit,
                          "box_margin_px": [1, 10]},
                sources=[src], notes=["boxes: tightest box around each class's mask + independent random 1-10 px "
                                      "margin per side, clamped; test items carry their site"])


def _subsample_entries(entries, n, rng):
    if n is None or len(entries) <= n:
        return entries
    keep = set(_subsample(range(len(entries)), n, rng))
    return [e for j, e in enumerate(entries) if j in keep]


# ------------------------------------------------------------------ fedmlp


def fedmlp(sources, o: Options, rng, say=print) -> SplitPlan:
    src = sources["main"]
    cases = src.cases
    notes = []
    if src.name == "nih":
        pool_all = [i for i, c in enumerate(cases) if c.meta.get("view", "").upper() == "PA"]
        if not pool_all:
            raise PrepareError(f"{src.root}: no PA-view images (View Position column) for fedmlp")
        counts = np.array([cases[i].labels for i in pool_all]).sum(0)
        order = sorted(range(len(NIH_CLASSES)), key=lambda j: (-counts[j], j))[:8]
        classes = [NIH_CLASSES[j] for j in sorted(order)]
        pool_all = _subsample(pool_all, o.limit, rng)
        if o.test_split == "official":
            train = [i for i in pool_all if cases[i].meta.get("official") == "train"]
            test = [i for i in pool_all if cases[i].meta.get("official") == "test"]
            if not train or not test:
                raise PrepareError(f"{src.root}: --test-split official needs train_val_list.txt and test_list.txt")
            how = "official train_val/test lists, PA view"
        else:
            frac = o.test_fraction if o.test_fraction is not None else 0.3
            tr, te = P.group_split([cases[i].patient for i in pool_all], [1 - frac, frac], rng)
            train, test = [pool_all[j] for j in tr], [pool_all[j] for j in te]
            how = f"PA view, patient-level {1 - frac:.0%}/{frac:.0%} train/test"
        if o.cases:
            train = _subsample(train, o.cases, rng)
    elif src.name == "ich":
        from .ich import fill_patients

        classes = list(src.classes)
        pos = [i for i, c in enumerate(cases) if max(c.labels) == 1]
        neg = [i for i, c in enumerate(cases) if max(c.labels) == 0]
        subset = o.limit or o.subset
        if len(pos) >= subset:
            chosen = _subsample(pos, subset, rng)
        else:
            chosen = sorted(pos + _subsample(neg, subset - len(pos), rng))
        pool_cases = [cases[i] for i in chosen]
        mode = fill_patients(pool_cases, say)
        if mode == "image":
            notes.append("no patient ids available: ICH split per image")
        n_train = min(o.cases or 25000, int(len(chosen) * 0.9))
        tr, te = P.group_split([cases[i].patient for i in chosen], [n_train, len(chosen) - n_train], rng)
        train, test = [chosen[j] for j in tr], [chosen[j] for j in te]
        how = (f"all hemorrhage images + healthy ones up to {subset}; {len(train)} for the sites, "
               f"the rest for testing (patient-level)")
    else:
        raise PrepareError(f"fedmlp is defined on nih and ich, not {src.name}")
    test = _subsample(test, o.test_cases, rng)
    c = len(classes)
    k = o.sites or c
    missing = 1 if o.missing is None else o.missing
    if missing < 1:
        raise PrepareError("fedmlp: --missing must be >= 1 (no site may hold all labels)")
    sets = P.missing_class_sets(c, k, missing, rng)
    parts = P.split_groups_equal([cases[i].patient for i in train], k, rng)
    sites = []
    for s, name in enumerate(site_names(k)):
        annotated = [classes[j] for j in sets[s]]

        def make(cs, annotated=annotated):
            full = _vec(cs, src.classes, classes, 0)
            return Entry(cs, _masked(full, classes, annotated), full)

        tr_e, va_e = _split_site(cases, [train[j] for j in parts[s]], rng, o.val_fraction, make)
        sites.append(SitePlan(name, annotated, "image", tr_e, va_e, f"{src.name} equal share {s + 1}/{k}"))
    test_entries = [Entry(cases[i], None, _vec(cases[i], src.classes, classes, 0)) for i in test]
    return SplitPlan(o.name or f"{src.name}-fedmlp-missing{missing}", "multilabel", classes, 1, None, sites,
                test_entries,
                protocol={"name": "fedmlp", "sites": k, "missing": missing, "classes": classes, "split": how,
                          "site_classes": [[classes[j] for j in s_] for s_ in sets], "val_fraction": o.val_fraction},
                sources=[src], notes=notes)


# ------------------------------------------------------------------ surgical aggregation


def surgical_sim(sources, o: Options, rng, say=print) -> SplitPlan:
    src = sources["main"]
    if src.task != "multilabel":
        raise PrepareError(f"surgical-sim needs a multi-label dataset (nih), not {src.name}")
    cases = src.cases
    classes = list(src.classes)
    pool = _subsample(range(len(cases)), o.limit, rng)
    if o.test_split == "official":
        train = [i for i in pool if cases[i].meta.get("official") == "train"]
        test = [i for i in pool if cases[i].meta.get("official") == "test"]
        if not train or not test:
            raise PrepareError(f"{src.root}: --test-split official needs train_val_list.txt and test_list.txt")
        how = "official lists"
    else:
        frac = o.test_fraction if o.test_fraction is not None else 0.2
        tr, te = P.group_split([cases[i].patient for i in pool], [1 - frac, frac], rng)
        train, test = [pool[j] for j in tr], [pool[j] for j in te]
        how = f"patient-level, {frac:.0%} test"
    k = o.sites or 4
    if o.cases:
        train = _subsample(train, o.cases * k, rng)
    test = _subsample(test, o.test_cases, rng)
    shared = 0 if o.shared is None else o.shared
    sets = P.shared_class_sets(len(classes), k, shared, rng)
    parts = P.split_groups_equal([cases[i].patient for i in train], k, rng)
    sites = []
    for s, name in enumerate(site_names(k)):
        annotated = [classes[j] for j in sets[s]]

        def make(cs, annotated=annotated):
            full = list(cs.labels)
            return Entry(cs, _masked(full, classes, annotated), full)

        tr_e, va_e = _split_site(cases, [train[j] for j in parts[s]], rng, o.val_fraction, make)
        sites.append(SitePlan(name, annotated, "image", tr_e, va_e, f"{src.name} IID patient-level share {s + 1}/{k}"))
    test_entries = [Entry(cases[i], None, list(cases[i].labels)) for i in test]
    common = set.intersection(*[set(s_) for s_ in sets])
    return SplitPlan(o.name or f"{src.name}-surgical-sim", "multilabel", classes, 1, None, sites, test_entries,
                protocol={"name": "surgical-sim", "sites": k, "shared": shared, "split": how,
                          "shared_classes": [classes[j] for j in sorted(common)],
                          "site_classes": [[classes[j] for j in s_] for s_ in sets], "val_fraction": o.val_fraction},
                sources=[src])


def surgical_real(sources, o: Options, rng, say=print) -> SplitPlan:
    nih = sources["main"]
    if nih.name != "nih" or "chexpert" not in sources:
        raise PrepareError("surgical-real: prepare nih --src NIH_DIR --src chexpert=CHEXPERT_DIR [--src mimic=MIMIC_DIR]")
    chex = sources["chexpert"]
    mimic = sources.get("mimic")
    classes = list(UNION20)
    frac = o.test_fraction if o.test_fraction is not None else 0.2
    sites, extra = [], []
    for s, (src, own) in enumerate(((nih, NIH_CLASSES), (chex, CHEXPERT_CLASSES))):
        cases = src.cases
        pool = _subsample(range(len(cases)), o.limit, rng)
        if src.name == "nih" and o.test_split == "official":
            rest = [i for i in pool if cases[i].meta.get("official") == "train"]
            test = [i for i in pool if cases[i].meta.get("official") == "test"]
        else:
            tr, te = P.group_split([cases[i].patient for i in pool], [1 - frac, frac], rng)
            rest, test = [pool[j] for j in tr], [pool[j] for j in te]
        test = _subsample(test, o.test_cases, rng)

        def make(cs, src=src):
            return Entry(cs, _vec(cs, src.classes, classes, -1), None)

        # validation = 10 % of all cases, i.e. 1/8 of the non-test pool, as in the paper
        tr_e, va_e = _split_site(cases, rest, rng, o.val_fraction, make)
        name = f"site-{s + 1}"
        sites.append(SitePlan(name, list(own), "image", tr_e, va_e,
                              "NIH ChestX-ray14" if src.name == "nih" else "CheXpert (frontal)"))
        extra.append(ExtraTest(f"test-{src.name}", list(own), [make(cases[i]) for i in test],
                               f"held-out {src.name} patients; labels only for its own classes"))
    test_entries = None
    notes = []
    if mimic is not None:
        mcases = _subsample(range(len(mimic.cases)), o.test_cases, rng)
        labeled = [c for c in classes if c in mimic.classes]
        entries = [Entry(mimic.cases[i], _vec(mimic.cases[i], mimic.classes, classes, -1), None) for i in mcases]
        full = len(labeled) == len(classes) and all(min(e.label) >= 0 for e in entries)
        if full:
            test_entries = [Entry(e.case, None, e.label, extra={"source": "mimic"}) for e in entries]
        else:
            extra.append(ExtraTest("test-mimic", labeled, entries, "external MIMIC-CXR-JPG test (frontal)"))
            notes.append(f"MIMIC labels {len(labeled)} of the {len(classes)} classes: written as extra test "
                         f"'test-mimic' (add a CXR-LT label file for a fully labeled test/)")
    else:
        notes.append("no MIMIC-CXR given (--src mimic=DIR): no external test set")
    return SplitPlan(o.name or "nih-chexpert-surgical-real", "multilabel", classes, 1, None, sites, test_entries,
                oracle=False, extra_tests=extra,
                protocol={"name": "surgical-real", "sites": 2, "shared": sorted(set(NIH_CLASSES) & set(CHEXPERT_CLASSES)),
                          "test_fraction": frac, "val_fraction": o.val_fraction, "uncertain": chex.meta.get("uncertain")},
                sources=[s for s in (nih, chex, mimic) if s is not None], notes=notes)


# ------------------------------------------------------------------ FedPSL


def _fedpsl(sources, o: Options, rng, eight: bool, say=print) -> SplitPlan:
    nih = sources["main"]
    if nih.name != "nih":
        raise PrepareError("fedpsl protocols use NIH ChestX-ray14 (prepare nih ...)")
    classes = P.FEDPSL_CLASSES_8 if eight else P.FEDPSL_CLASSES_6
    site_sets = P.FEDPSL_SITE_CLASSES_8 if eight else P.FEDPSL_SITE_CLASSES_6
    n = o.cases or 1000
    cases = nih.cases
    if any(c.meta.get("batch") is None for c in cases):
        raise PrepareError(f"{nih.root}: the image batch of some images is unknown; keep the images in their "
                           f"images_0XX/ folders or use the complete Data_Entry_2017.csv (112,120 rows)")
    notes = []
    sites, used_patients = [], set()
    for k in range(4):
        batch = k + 2
        in_batch = sorted((i for i, c in enumerate(cases) if c.meta["batch"] == batch), key=lambda i: cases[i].meta["rank"])
        if not in_batch:
            raise PrepareError(f"{nih.root}: no images of batch {batch} (images_{batch:03d})")
        idx = in_batch[:n] if o.sample == "first" else _subsample(in_batch, n, rng)
        if len(idx) < n:
            notes.append(f"site-{k + 1}: batch {batch} has only {len(idx)} images (asked {n})")
        annotated = site_sets[k]
        used_patients |= {cases[i].patient for i in idx}

        def make(cs, annotated=annotated):
            full = _vec(cs, nih.classes, classes, 0)
            return Entry(cs, _masked(full, classes, annotated), full)

        tr, va = _split_site(cases, idx, rng, o.val_fraction, make)
        sites.append(SitePlan(f"site-{k + 1}", annotated, "image", tr, va,
                              f"NIH batch {batch} (images_{batch:03d}), {'first' if o.sample == 'first' else 'random'} {len(idx)}"))
    # Balanced test from the other batches, no patient shared with a site.
    pool = [i for i, c in enumerate(cases) if c.meta["batch"] not in (2, 3, 4, 5) and c.patient not in used_patients]
    nih_classes = P.FEDPSL_CLASSES_6
    lab = np.array([_vec(cases[i], nih.classes, nih_classes, 0) for i in pool]).reshape(len(pool), len(nih_classes))
    chosen, got = P.balanced_test(lab, o.test_per_class, rng)
    short = [f"{c} ({got[j, 0]}+/{got[j, 1]}-)" for j, c in enumerate(nih_classes)
             if got[j, 0] < o.test_per_class or got[j, 1] < o.test_per_class]
    if short:
        notes.append(f"test: fewer than {o.test_per_class} positives/negatives available for {short}")
    test = [Entry(cases[pool[j]], None, _vec(cases[pool[j]], nih.classes, classes, 0), extra={"source": "nih"})
            for j in chosen]
    srcs = [nih]
    if eight:
        for k, key in ((4, "tb"), (5, "covid")):
            if key not in sources:
                raise PrepareError(f"fedpsl-8 needs --src {key}=DIR (the {'Tuberculosis' if key == 'tb' else 'COVID-19'} "
                                   f"radiography database)")
            one = sources[key]
            srcs.append(one)
            cls = one.classes[0]
            y = np.array([c.labels[0] for c in one.cases])[:, None]
            t_idx, got = P.balanced_test(y, o.test_per_class, rng)
            if got[0, 0] < o.test_per_class or got[0, 1] < o.test_per_class:
                notes.append(f"test: {cls}: {got[0, 0]} positives / {got[0, 1]} negatives available")
            t_set = set(t_idx)
            rest = [i for i in range(len(one.cases)) if i not in t_set]
            idx = _subsample(rest, n, rng)

            def make(cs, cls=cls):
                full = [0] * len(classes)
                full[classes.index(cls)] = int(cs.labels[0])
                return Entry(cs, _masked(full, classes, [cls]), full)

            tr, va = _split_site(one.cases, idx, rng, o.val_fraction, make)
            sites.append(SitePlan(f"site-{k + 1}", [cls], "image", tr, va, f"{one.name}: random {len(idx)} images"))
            test += [Entry(one.cases[i], None, make(one.cases[i]).oracle, extra={"source": one.name}) for i in t_idx]
        notes.append("oracle/test labels: the one-class datasets are taken as negative for the NIH findings and "
                     "NIH images as negative for tuberculosis/COVID-19 (test items carry their 'source')")
    name = "fedpsl-8" if eight else "fedpsl-6"
    return SplitPlan(o.name or f"nih-{name}", "multilabel", classes, 1, None, sites, test,
                protocol={"name": name, "cases_per_site": n, "sample": o.sample, "test_per_class": o.test_per_class,
                          "site_classes": site_sets, "val_fraction": o.val_fraction},
                sources=srcs, notes=notes)


def fedpsl6(sources, o, rng, say=print):
    return _fedpsl(sources, o, rng, False, say)


def fedpsl8(sources, o, rng, say=print):
    return _fedpsl(sources, o, rng, True, say)


PROTOCOLS = {
    "fedpsl-6": (fedpsl6, {"nih"}),
    "fedpsl-8": (fedpsl8, {"nih"}),
    "fedmlp": (fedmlp, {"nih", "ich"}),
    "surgical-sim": (surgical_sim, {"nih"}),
    "surgical-real": (surgical_real, {"nih"}),
    "isofed": (isofed, {"medmnist", "ph2", "ham10000"}),
    "partial": (partial, {"medmnist", "ph2", "ham10000"}),
    "mixed": (mixed, {"medmnist", "ph2", "ham10000"}),
    "fedmix": (fedmix, {"breast", "ham10000", "ph2", "retouch"}),
}
