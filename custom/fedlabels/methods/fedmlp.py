"""FedMLP (Sun et al., MICCAI 2024; docs/methods/fedmlp.md): sites recover their missing labels.

Two stages. The server owns the schedule and tells each site its stage in the
round's extras (``stage``), so one option (``warmup_rounds``, the paper's t1)
sets it for every site.

Stage 1 (rounds < ``warmup_rounds``): the WPC loss (Eq. 4) -- BCE over the
    site's annotated classes, summed and divided by C (all classes), on
    logits corrected by the multi-label logit adjustment (Eq. 3,
    ``logit_adjustment``): p' = p pi1 / (p pi1 + (1 - p) pi0), i.e. the
    logit plus log(pi1 / pi0), pi1 = the class's positive rate among the
    site's labeled cases. Predictions use the raw logit, as in logit-adjusted
    losses. Aggregation is FedAvg by n_k.
Prototypes (from round ``warmup_rounds - 1`` on, every round): after local
    training each site passes over its training cases once (eval mode, first
    view) and sends, per class it annotates, the mean feature of its
    negatives and of its positives (``prototypes``), and per class its
    learning degree d_c^k = the fraction of its cases with p < ``degree_low``
    or p > ``degree_high`` (``degree``, Eq. 10). The server averages each
    class's prototypes over the sites that annotate it (Eq. 6; by site size
    with ``prototype_weighting="size"``, the released code) and broadcasts them.
Stage 2: missing-label detection (Eqs. 7-9). At the start of the round the
    site scores every case not yet tagged for each class it does not annotate
    with the received global model: Z = cos(P0, F) - cos(P1, F). Among the n0
    cases with Z >= 0 the top floor(tau0 x n0) by Z become pseudo-negatives,
    among the n1 with Z < 0 the top floor(tau1 x n1) by -Z pseudo-positives
    (the released code's ``int()``; ties by case order). Tags are permanent and accumulate over
    rounds; they are part of the site's saved state, so they survive a
    resume. With ``adaptive_threshold`` (Eq. 10) tau = d_c^G x T, d_c^G the
    size-weighted mean of d_c^k; else tau = T.
    Training: WPC over annotated and tagged entries, and the consistency
    regulariser on the missing entries not yet tagged: the mean squared
    difference between the local and the received global model's sigmoid
    outputs (``stage2_consistency``; ``warmup_consistency`` in stage 1).
Two views: the loss is the mean over the case's two augmented views
    (``image`` and the bundle's ``image_strong``; ``two_views``), each view
    against the global model on the same view.

What leaves a site, per round, besides the model and its label summary:
    from round ``warmup_rounds - 1`` on, ``prototypes`` = {class index: 2 x D
    floats} for the classes it annotates (D: the network's feature size) and
    ``degree`` = C floats. Logged once per run at the site.

Released code (``fedmlp_code``): no logit adjustment, no adaptive threshold
(tau = T), consistency in stage 1 only, prototypes weighted by site size. Not
reproduced: its stage 2 trains on the first view only and averages the BCE
over the labeled entries, and its stage 1 divides by batch x annotated
classes; here both stages use both views and divide by batch x C.
Table 3's ablation switches: ``mld`` (server: no prototypes, no tags),
``wpc`` (False: both halves of WPC go, as in the paper's cumulative rows:
the untagged missing entries count as negatives, as in FedAvg's loss, and
there is no logit adjustment; the consistency term stays when it is on),
``warmup_consistency`` / ``stage2_consistency`` (CR) and
``adaptive_threshold`` (ST).

Where the paper is silent or contradicts itself (docs/methods/fedmlp.md):
    * d_c^G: Eq. 10 sums over S_c, the sites that annotate c, while the text
      calls it the difficulty of the *missing* class and the released code
      averages over the sites that lack c. ``degree_sites="missing"``
      (default) follows the text and the code; ``"annotating"`` Eq. 10.
    * pi for a class the site does not annotate: the positive rate among its
      tags; no adjustment (shift 0) while it has no tags, or when a rate is 0
      or 1 (the log would be infinite). With tau1 = 2 tau0 this rate
      overstates the prevalence (the released code divides the tagged
      positives by all cases instead).
    * the consistency term is averaged over the entries it covers (the
      released code divides by batch x missing classes).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from ..losses import masked_mse, partial_bce
from .base import LABELED_MASK, ClientRule, ServerRule, frozen_copy
from .fedavg import FedAvgServer
from .semisup import _strong_views
from .surgical import HeadMetaMixin

log = logging.getLogger(__name__)

# Extras keys (server -> sites, sites -> server).
STAGE, COLLECT, PROTOTYPES, DEGREE, TAU0, TAU1 = "stage", "collect", "prototypes", "degree", "tau0", "tau1"
WEIGHTINGS, DEGREE_SITES = ("mean", "size"), ("missing", "annotating")


# ---------------------------------------------------------------- the maths (pure, tested by hand)

def logit_shift(positives, labeled) -> np.ndarray:
    """Per class log(pi1 / pi0), pi1 = positives / labeled; 0 where the rate is undefined, 0 or 1."""
    pos, lab = np.asarray(positives, np.float64), np.asarray(labeled, np.float64)
    ok = (lab > 0) & (pos > 0) & (pos < lab)
    safe_pos, safe_neg = np.where(ok, pos, 1.0), np.where(ok, lab - pos, 1.0)
    return np.where(ok, np.log(safe_pos / safe_neg), 0.0).astype(np.float32)


def wpc_loss(logits, target, shift=None, pos_weight=None) -> torch.Tensor:
    """Eq. 4: BCE over entries with a label (target >= 0), summed and divided by batch x C, on
    logit-adjusted logits (``shift`` = ``logit_shift``; None: no adjustment); ``pos_weight`` per class
    (not the paper's: the shared weighting when a run turns it on)."""
    if shift is not None:
        logits = logits + torch.as_tensor(shift, dtype=logits.dtype, device=logits.device)
    return partial_bce(logits, target, pos_weight=pos_weight, divisor=logits.shape[1])


def average_prototypes(sent: dict, sizes: dict, weighting: str = "mean") -> dict:
    """Eq. 6: ``sent`` = {site: {class: (2, D) array}} -> {class: (2, D)}, averaged over the sites that
    sent the class, unweighted (``mean``) or by ``sizes[site]`` (``size``). A class nobody sent is absent."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"prototype_weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    out = {}
    for c in sorted({c for protos in sent.values() for c in protos}):
        have = [(np.asarray(p[c], np.float64), float(sizes[s]) if weighting == "size" else 1.0)
                for s, p in sent.items() if c in p]
        w = np.array([x for _, x in have])
        out[c] = sum(wi * a for (a, _), wi in zip(have, w)) / w.sum()
    return out


def feature_size(weights: dict, num_classes: int):
    """The size of the features the network's head sees: the input size of its last linear layer (the head,
    ``fedlabels.nets``: the last 2-D weight with one row per class), read from the global model, so that no
    site's prototypes set the size the others' are checked against. None when there is no such weight."""
    dims = [np.shape(v)[1] for v in weights.values() if np.ndim(v) == 2 and np.shape(v)[0] == num_classes]
    return int(dims[-1]) if dims else None


def z_scores(features, p0, p1) -> np.ndarray:
    """Eq. 7: cos(P0, F_i) - cos(P1, F_i) per case (rows of ``features``); > 0 leans negative."""
    f = torch.as_tensor(np.asarray(features), dtype=torch.float64)
    cos = lambda p: F.cosine_similarity(f, torch.as_tensor(np.asarray(p), dtype=torch.float64)[None], dim=1)
    return (cos(p0) - cos(p1)).numpy()


def select_tags(z, tau0: float, tau1: float) -> tuple:
    """Eqs. 8-9 on one class's pool (the cases not yet tagged): (negatives, positives) as positions in ``z``.

    Among z >= 0 the floor(tau0 x count) largest z; among z < 0 the floor(tau1 x count) most negative.
    Ties keep the pool's order (a stable sort)."""
    z = np.asarray(z, dtype=np.float64)
    nonneg, neg = np.flatnonzero(z >= 0), np.flatnonzero(z < 0)
    k0, k1 = int(tau0 * len(nonneg)), int(tau1 * len(neg))
    top0 = nonneg[np.argsort(-z[nonneg], kind="stable")[:k0]]
    top1 = neg[np.argsort(z[neg], kind="stable")[:k1]]
    return top0, top1


def learning_degree(probs, low: float, high: float) -> np.ndarray:
    """Eq. 10, d_c^k: per class the fraction of cases with p < low or p > high."""
    p = np.asarray(probs, dtype=np.float64)
    return ((p < low) | (p > high)).mean(0) if len(p) else np.zeros(p.shape[1:])


def global_degree(degrees: dict, sizes: dict, sites_for: dict) -> np.ndarray:
    """d_c^G: per class the size-weighted mean of ``degrees[site][c]`` over ``sites_for[c]`` (those that
    sent a degree); 1 where no such site (tau = T)."""
    c_count = len(next(iter(degrees.values())))
    out = np.ones(c_count)
    for c in range(c_count):
        have = [s for s in sites_for.get(c, ()) if s in degrees]
        if have:
            w = np.array([float(sizes[s]) for s in have])
            out[c] = float(np.dot(w, [degrees[s][c] for s in have]) / w.sum()) if w.sum() > 0 else 1.0
    return out


# ---------------------------------------------------------------- client

class FedMLPClient(HeadMetaMixin, ClientRule):
    """WPC training, tags for missing labels from the global prototypes, consistency to the global model."""

    def __init__(self, net, ctx, *, logit_adjustment=True, wpc=True, warmup_consistency=False,
                 stage2_consistency=True, consistency_weight=1.0, degree_low=0.3, degree_high=0.7, two_views=True,
                 **kw):
        super().__init__(net, ctx, **kw)
        if self.profile.task != "multilabel":
            raise ValueError(f"FedMLP is for multi-label tasks, not {self.profile.task!r}")
        if not 0 <= degree_low <= degree_high <= 1:
            raise ValueError(f"degree_low and degree_high must satisfy 0 <= degree_low <= degree_high <= 1, got "
                             f"{degree_low}, {degree_high}")
        if consistency_weight < 0:
            raise ValueError(f"consistency_weight must be >= 0, got {consistency_weight}")
        # Table 3's rows are cumulative: "w/o WPC" drops both halves of WPC, the partial masking and the
        # weighting (logit adjustment), not the masking alone.
        self.wpc = bool(wpc)
        self.logit_adjustment = bool(logit_adjustment) and self.wpc
        self.consistency = {1: bool(warmup_consistency), 2: bool(stage2_consistency)}
        self.consistency_weight = float(consistency_weight)
        self.low, self.high, self.two_views = float(degree_low), float(degree_high), bool(two_views)
        _strong_views(ctx, self.two_views)
        self.labeled = np.asarray(ctx.summary[LABELED_MASK], dtype=bool)
        dataset = getattr(ctx.train, "dataset", None)
        n = len(dataset) if dataset is not None else int(ctx.summary["cases"])
        # tags[i, c]: 0 / 1 once case i is tagged for missing class c, -1 before (permanent once set)
        self.tags = np.full((n, len(self.labeled)), -1, dtype=np.int8)
        self.tagged_at = np.full(self.tags.shape, -1, dtype=np.int32)  # the round a tag was made (for analysis)
        self.round = -1
        self.stage, self.collect, self.teacher, self.round_stats, self.announced = 1, False, None, {}, False

    # ---------------------------------------------------------------- labels
    def shift(self) -> np.ndarray | None:
        """Logit adjustment per class: annotated classes from the label summary, missing ones from the tags."""
        if not self.logit_adjustment:
            return None
        pos = np.where(self.labeled, self.ctx.summary["positives"], (self.tags == 1).sum(0))
        lab = np.where(self.labeled, self.ctx.summary["annotated"], (self.tags >= 0).sum(0))
        return logit_shift(pos, lab)

    def targets(self, labels, index):
        """(training target, consistency mask): tags fill missing entries; untagged missing entries are
        -1 under WPC (or 0 without it) and covered by the consistency mask."""
        tags = torch.as_tensor(self.tags[np.asarray(index)], dtype=labels.dtype, device=labels.device)
        missing = labels < 0
        target = torch.where(missing, tags, labels)
        untagged = missing & (tags < 0)
        if not self.wpc:
            target = target.clamp(min=0)
        return target, untagged.to(torch.float32)

    # ---------------------------------------------------------------- round
    def begin_round(self, round, extras):
        self.round = int(round)
        self.stage = int(extras.get(STAGE, 1))
        self.collect = bool(extras.get(COLLECT, False))
        self.round_stats = {}
        uses_teacher = self.consistency[self.stage] and self.consistency_weight > 0 and not self.labeled.all()
        self.teacher = None
        if uses_teacher:
            self.teacher = frozen_copy(self.net)
        if self.stage == 2 and extras.get(PROTOTYPES):
            self.detect(extras)
        elif self.stage == 2:  # no prototypes (mld off, or none reached the server): nothing new is tagged
            self.round_stats = {"tagged_negatives": 0, "tagged_positives": 0, "tags_total": int((self.tags >= 0).sum())}
        self.set_train_mode()
        self._shift = self.shift()

    @torch.no_grad()
    def features(self):
        """(case index, features, probabilities, labels) over the training cases, eval mode, first view."""
        self.net.eval()
        idx, feats, probs, labels = [], [], [], []
        _strong_views(self.ctx, False)
        try:
            for batch in self.ctx.train:
                x = batch["image"].to(self.device)
                f = self.net.extract(x)
                idx.append(np.asarray(batch["index"]))
                feats.append(f.cpu().numpy())
                probs.append(torch.sigmoid(self.net.head(f)).cpu().numpy())
                labels.append(np.asarray(batch["label"]))
        finally:
            _strong_views(self.ctx, self.two_views)
            self.set_train_mode()
        c = len(self.labeled)
        if not idx:
            return np.zeros(0, int), np.zeros((0, 0)), np.zeros((0, c)), np.zeros((0, c))
        order = np.argsort(np.concatenate(idx))
        return tuple(np.concatenate(a)[order] for a in (idx, feats, probs, labels))

    def detect(self, extras):
        """Tag missing labels with the received global model (Eqs. 7-9)."""
        protos = {int(c): np.asarray(p, dtype=np.float64) for c, p in extras[PROTOTYPES].items()}
        tau0, tau1 = np.asarray(extras[TAU0], np.float64), np.asarray(extras[TAU1], np.float64)
        index, feats, _, _ = self.features()
        new = {0: 0, 1: 0}
        for c in np.flatnonzero(~self.labeled):
            if c not in protos or not len(index):
                continue
            pool = index[self.tags[index, c] < 0]
            if not len(pool):
                continue
            z = z_scores(feats[np.searchsorted(index, pool)], protos[c][0], protos[c][1])
            negs, poss = select_tags(z, tau0[c], tau1[c])
            self.tags[pool[negs], c] = 0
            self.tags[pool[poss], c] = 1
            self.tagged_at[pool[negs], c] = self.tagged_at[pool[poss], c] = self.round
            new[0] += len(negs)
            new[1] += len(poss)
        self.round_stats = {"tagged_negatives": new[0], "tagged_positives": new[1],
                            "tags_total": int((self.tags >= 0).sum())}

    def train_step(self, batch):
        labels = batch["label"].to(self.device)
        target, untagged = self.targets(labels, batch["index"])
        views = [batch["image"]] + ([batch["image_strong"]] if self.two_views and "image_strong" in batch else [])
        loss = 0.0
        for view in views:
            x = view.to(self.device)
            logits = self.net(x)
            term = wpc_loss(logits, target, self._shift, self.pos_weight)
            if self.teacher is not None:
                with torch.no_grad():
                    teacher = torch.sigmoid(self.teacher(x))
                term = term + self.consistency_weight * masked_mse(torch.sigmoid(logits), teacher, untagged)
            loss = loss + term / len(views)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def make_update(self, n, metrics):
        update = super().make_update(n, {**metrics, **self.round_stats})
        if self.collect:
            update.extras = self.summarise()
        return update

    def summarise(self) -> dict:
        """Prototypes of the annotated classes and the learning degree of every class, from the local model."""
        index, feats, probs, labels = self.features()
        protos = {}
        for c in np.flatnonzero(self.labeled):
            neg, pos = feats[labels[:, c] == 0], feats[labels[:, c] == 1]
            if len(neg) and len(pos):  # a class with no negative or no positive here has no prototype pair
                protos[str(c)] = np.stack([neg.mean(0), pos.mean(0)]).tolist()
        degree = learning_degree(probs, self.low, self.high) if len(index) else np.ones(len(self.labeled))
        if not self.announced:
            d = feats.shape[1] if feats.ndim == 2 else 0
            log.info("%s sends with each update from now on: prototypes for classes %s (2 x %d floats each: the "
                     "mean feature of its negatives and of its positives) and degree (%d floats)",
                     self.profile.site, sorted(int(c) for c in protos), d, len(self.labeled))
            self.announced = True
        return {PROTOTYPES: protos, DEGREE: [float(v) for v in degree]}

    # ---------------------------------------------------------------- state
    def state_dict(self):
        return {**super().state_dict(), "tags": self.tags.copy(), "tagged_at": self.tagged_at.copy(),
                "announced": self.announced}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if state["tags"].shape != self.tags.shape:
            raise ValueError(f"saved tags have shape {state['tags'].shape}, this site's training cases "
                             f"{self.tags.shape}: the site's data changed since the state was saved")
        self.tags, self.announced = state["tags"].copy(), bool(state["announced"])
        self.tagged_at = state["tagged_at"].copy()


# ---------------------------------------------------------------- server

class FedMLPServer(FedAvgServer):
    """FedAvg by n_k, the stage schedule, the global prototypes and the selection ratios."""

    def __init__(self, warmup_rounds=50, mld=True, tau0=0.005, tau1=0.01, adaptive_threshold=True,
                 prototype_weighting="mean", degree_sites="missing", weighted=True):
        super().__init__(weighted=weighted)
        if int(warmup_rounds) < 1:
            raise ValueError(f"warmup_rounds must be >= 1 (prototypes come from a warmed-up model), got {warmup_rounds}")
        for name, v in (("tau0", tau0), ("tau1", tau1)):
            if not 0 <= float(v) <= 1:
                raise ValueError(f"{name} must be in [0, 1] (a fraction of the pool), got {v}")
        if prototype_weighting not in WEIGHTINGS:
            raise ValueError(f"prototype_weighting must be one of {WEIGHTINGS}, got {prototype_weighting!r}")
        if degree_sites not in DEGREE_SITES:
            raise ValueError(f"degree_sites must be one of {DEGREE_SITES}, got {degree_sites!r}")
        self.warmup_rounds, self.mld = int(warmup_rounds), bool(mld)
        self.T0, self.T1, self.adaptive = float(tau0), float(tau1), bool(adaptive_threshold)
        self.weighting, self.degree_sites = prototype_weighting, degree_sites
        self.prototypes, self.degree, self.notes = {}, None, []

    def setup(self, summaries):
        super().setup(summaries)
        masks = {s: np.asarray(v[LABELED_MASK], bool) for s, v in summaries.items()}
        self.num_classes = len(next(iter(masks.values())))
        self.annotators = {c: sorted(s for s, m in masks.items() if m[c]) for c in range(self.num_classes)}
        self.sizes = {s: int(v.get("cases", 0)) for s, v in summaries.items()}
        orphans = [c for c, s in self.annotators.items() if not s]
        lines = [f"FedMLP: stage 1 (warm-up) for rounds 0-{self.warmup_rounds - 1}, missing-label detection "
                 f"{'from round ' + str(self.warmup_rounds) if self.mld else 'off (mld=False)'}"]
        if orphans and self.mld:
            lines.append(f"FedMLP: classes {orphans} are annotated by no site: they have no prototype and no case "
                         "is ever tagged for them")
        return lines

    def take_notes(self) -> list:
        notes, self.notes = self.notes, []
        return notes

    def extras(self, round, step):
        stage = 1 if round < self.warmup_rounds else 2
        out = {STAGE: stage, COLLECT: self.mld and round >= self.warmup_rounds - 1}
        if stage == 2 and self.mld:
            lacking = sorted(c for c, s in self.annotators.items() if s and c not in self.prototypes)
            if lacking:
                self.notes.append(f"stage 2 without prototypes for classes {lacking} (no usable update sent them "
                                  "yet): no case is tagged for them this round")
        if stage == 2 and self.mld and self.prototypes:
            out[PROTOTYPES] = {str(c): p.tolist() for c, p in self.prototypes.items()}
            d = self.degree if (self.adaptive and self.degree is not None) else np.ones(self.num_classes)
            out[TAU0], out[TAU1] = (d * self.T0).tolist(), (d * self.T1).tolist()
        return out

    def aggregate(self, updates, global_weights, round):
        new = super().aggregate(updates, global_weights, round)
        if self.mld and round >= self.warmup_rounds - 1:
            self.collect_prototypes(updates, feature_size(global_weights, self.num_classes))
        return new

    def screen(self, update, global_weights, round, step):
        # prototypes are read class by class (collect_prototypes drops a bad one with a note); the
        # container itself must be a mapping
        protos = (update.extras or {}).get(PROTOTYPES)
        if protos is not None and not isinstance(protos, dict):
            return f"extra {PROTOTYPES!r} is a {type(protos).__name__}, not a mapping of class -> prototypes"
        return None

    def collect_prototypes(self, updates, dim=None):
        """Average the sites' prototypes into ``self.prototypes``. ``dim``: the network's feature size, which
        every prototype must have (``feature_size``); None: the first usable prototype's (a rule run without
        the global model's weights)."""
        sent, degrees = {}, {}
        dim = dim if dim is not None else next((p.shape[1] for p in self.prototypes.values()), None)
        for u in updates:
            protos = (u.extras or {}).get(PROTOTYPES)
            if protos is None:
                self.notes.append(f"{u.site}: sent no prototypes")
                continue
            mine = {}
            for key, value in protos.items():
                why, arr = self._check_prototype(u.site, key, value, dim)
                if why:
                    self.notes.append(f"{u.site}: prototype for class {key!r} dropped: {why}")
                    continue
                dim = arr.shape[1]
                mine[int(key)] = arr
            sent[u.site] = mine
            d = np.asarray((u.extras or {}).get(DEGREE, []), dtype=np.float64)
            if d.shape == (self.num_classes,) and np.isfinite(d).all():
                degrees[u.site] = d
            else:
                self.notes.append(f"{u.site}: degree dropped: shape {d.shape}, expected ({self.num_classes},), finite")
        if any(sent.values()):  # a class no update sent this round keeps its previous prototypes
            self.prototypes = {**self.prototypes, **average_prototypes(sent, self.sizes, self.weighting)}
        if degrees:
            if self.degree_sites == "missing":
                sites_for = {c: [s for s in self.sizes if s not in self.annotators[c]] for c in range(self.num_classes)}
            else:
                sites_for = self.annotators
            self.degree = global_degree(degrees, self.sizes, sites_for)

    def _check_prototype(self, site, key, value, dim):
        try:
            c = int(key)
        except (TypeError, ValueError):
            return f"{key!r} is not a class index", None
        if not 0 <= c < self.num_classes:
            return f"class index {c} outside 0..{self.num_classes - 1}", None
        if site not in self.annotators[c]:
            return "the site does not annotate this class", None
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            return "not a numeric array", None
        if arr.ndim != 2 or arr.shape[0] != 2 or (dim is not None and arr.shape[1] != dim):
            return f"shape {arr.shape}, expected (2, {dim if dim is not None else 'D'})", None
        if not np.isfinite(arr).all():
            return "non-finite values", None
        return None, arr

    def state_dict(self):
        return {"prototypes": {c: p.copy() for c, p in self.prototypes.items()},
                "degree": None if self.degree is None else self.degree.copy()}

    def load_state_dict(self, state):
        self.prototypes = {int(c): np.asarray(p) for c, p in state["prototypes"].items()}
        self.degree = None if state["degree"] is None else np.asarray(state["degree"])


def _register():
    from . import FROM_MODEL, Method, register

    ml = ("multilabel",)
    # Logit adjustment replaces the shared per-class positive weighting (both correct the imbalance).
    register(Method("fedmlp", FedMLPClient, FedMLPServer, ml, {"pos_weighted": False}, strong_view=True,
                    partial_site=FROM_MODEL, doc="FedMLP: prototype-based missing-label tagging, WPC loss, consistency (the paper)"))
    register(Method("fedmlp_code", FedMLPClient, FedMLPServer, ml,
                    {"pos_weighted": False, "logit_adjustment": False, "warmup_consistency": True,
                     "stage2_consistency": False},
                    {"adaptive_threshold": False, "prototype_weighting": "size"}, strong_view=True,
                    partial_site=FROM_MODEL, doc="FedMLP as the released code runs it (no LA, no adaptive threshold, CR in stage 1 only)"))


_register()
