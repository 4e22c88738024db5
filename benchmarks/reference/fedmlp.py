"""FedMLP (Sun et al., MICCAI 2024, ../shared/papers/001_*) in plain PyTorch: no fedlabels, no MONAI.

Written from the paper's Sec. 2 and 3.1.3, and from the authors' released code
(github.com/szbonaldo/FedMLP, ``utils/local_training.py``) where the paper prints nothing. Rounds
count from 0; stage 1 is rounds 0 .. t1 - 1.

* **Stage 1** (Sec. 2.2): each site trains the WPC loss (Eq. 4: BCE over the classes it annotates,
  summed and divided by C) on logits corrected by the multi-label logit adjustment (Eq. 3:
  p' = p pi1 / (p pi1 + (1 - p) pi0), i.e. the logit plus log(pi1 / pi0)), averaged over two
  augmented views of each case (the released code's ``image_aug_1`` and ``image_aug_2``; the paper says
  only that it augments); the server runs FedAvg (by case counts).
* **Prototypes** (Eqs. 5-6), from round t1 - 1 on, at the end of each round: per class a site annotates,
  the mean feature of its negatives and of its positives under its trained local model (inference mode,
  one augmented view); the server averages each over the sites that annotate the class (1 / |S_c|).
* **Learning degree** (Eq. 10): d_c^k = the fraction of a site's cases with p < L or p > R; d_c^G its
  size-weighted mean over the sites that lack c (the text: "negative class difficulty"; the released
  code's ``FedAvg_tao`` averages it over the clients lacking c by size; Eq. 10 prints S_c,
  ``degree_sites="annotating"``);
  tau0 = d_c^G T0, tau1 = d_c^G T1 (``adaptive_threshold``; else tau = T).
* **Stage 2** (Sec. 2.3.2): at the start of a round the site scores each case not yet tagged for each
  class it lacks with the received global model, Z = cos(P0, F) - cos(P1, F) (Eq. 7); among the n0 with
  Z >= 0 the int(tau0 n0) largest become negatives, among the n1 with Z < 0 the int(tau1 n1) most negative
  become positives (Eqs. 8-9, the released code's ``int``); tags are permanent. It trains WPC over
  annotated and tagged entries plus the consistency term (Sec. 2.4): the mean squared difference of the
  local and the received model's sigmoid outputs over the missing entries not yet tagged.

Readings of what the paper leaves open, where they are the project's (the check cannot tell them apart):
for a class a site lacks, pi1 in Eq. 3 is the positive rate among its tags (``missing_prior="tags"``; the
paper defines pi for labeled classes only; the released code divides the tagged positives by all the site's
cases, ``missing_prior="cases"``, which the project cannot run); no adjustment while a rate is 0, 1 or
undefined; the consistency MSE is averaged over the entries it covers (the released code divides by batch x
missing classes); both stages train on both views (the released code's stage 2 on the first only).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from .fedavg_multilabel import UNANNOTATED
from .surgical import features

# (value, source): the paper's, or the released code's where the paper prints none.
PAPER = {
    "lr": (3e-5, "paper Sec. 3.1.3: Adam with a learning rate of 3e-5"),
    "batch_size": (32, "paper Sec. 3.1.3: a batch size of 32"),
    "weight_decay": (5e-4, "released code utils/local_training.py train_FedMLP: Adam(weight_decay=5e-4) (the paper "
                           "prints 'L2 regularization on model parameters' and no value)"),
    "carry_optimizer": (False, "released code utils/local_training.py train_FedMLP: a new Adam every round"),
    "epochs": (1, "paper Sec. 3.1.3: one local training round before each communication round"),
    "warmup_rounds": (50, "paper Sec. 3.1.3: t1 = 50"),
    "rounds": (500, "paper Sec. 3.1.3: 500 rounds"),
    "low": (0.3, "paper Sec. 3.1.3: L = 0.3"),
    "high": (0.7, "paper Sec. 3.1.3: R = 0.7"),
    "tau0": (0.005, "paper Sec. 3.1.3: T0 = 0.5 %"),
    "tau1": (0.01, "paper Sec. 3.1.3: T1 = 1 %"),
    "logit_adjustment": (True, "paper Eq. 3-4"),
    "adaptive_threshold": (True, "paper Sec. 2.3.3"),
    "degree_sites": ("missing", "paper Sec. 2.3.3 text ('negative class difficulty'); released code: the client's "
                                "negative classes (Eq. 10 prints S_c)"),
    "consistency_weight": (1.0, "paper Sec. 2.4: WPC for labels and tags, MSE for the soft labels (no weight "
                                "printed), in stage 2 (stage 1 trains WPC alone, Sec. 2.2; the released code runs "
                                "the MSE in stage 1 and not in stage 2)"),
    "two_views": (True, "released code: image_aug_1 and image_aug_2, the loss their mean, in stage 1 (its stage 2 "
                        "trains on the first view only); the paper (Sec. 2.2) says only that it augments, as "
                        "semi-supervised learning does; both stages use both views here (the project's reading)"),
    "missing_prior": ("tags", "not printed (the paper defines pi for labeled classes): the positive rate among a "
                              "site's tags, the project's reading; the released code's rule is 'cases' (tagged "
                              "positives over all the site's cases)"),
}
# What both sides train with in benchmarks/reference_check.py --rows fedmlp: the paper's values; the network,
# the input and the augmentation are the check's preset's.
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {
    "network": "the preset's ResNet-18 from scratch at the width and size the section names, not an ImageNet ResNet-18 at 224 px",
    "input": "the preset's scaling (the section names it) of grey images at the section's size, not the released "
             "code's ImageNet normalisation at 224 px",
    "views": "the bundle's two views (the weak affine and contrast change; the strong view adds a contrast change, "
             "Gaussian noise and a dropped square), not the released code's transforms",
    "rounds": "the check's budget",
    **UNANNOTATED,
}


# ---------------------------------------------------------------- the rules, each by its equation

def logit_shift(positives, labeled) -> torch.Tensor:
    """Eq. 3 as a logit shift: log(pi1 / pi0) per class, pi1 = positives / labeled; 0 where undefined, 0 or 1."""
    pos, lab = torch.as_tensor(positives, dtype=torch.float64), torch.as_tensor(labeled, dtype=torch.float64)
    ok = (lab > 0) & (pos > 0) & (pos < lab)
    return torch.where(ok, torch.log(pos.clamp(min=1) / (lab - pos).clamp(min=1)), torch.zeros_like(pos)).float()


def wpc(logits, target, shift) -> torch.Tensor:
    """Eq. 4: BCE over the entries with a label (>= 0), summed, divided by batch x C."""
    mask = (target >= 0).float()
    bce = F.binary_cross_entropy_with_logits(logits + shift, target.clamp(min=0), reduction="none")
    return (bce * mask).sum() / logits.numel()


def consistency(probs, teacher_probs, mask) -> torch.Tensor:
    """Sec. 2.4: the mean squared difference over the entries of ``mask`` (0 when there are none)."""
    return (((probs - teacher_probs) ** 2) * mask).sum() / mask.sum().clamp(min=1)


def z_scores(feats, p0, p1) -> torch.Tensor:
    """Eq. 7."""
    feats = feats.double()
    return (F.cosine_similarity(feats, torch.as_tensor(p0).double()[None], dim=1)
            - F.cosine_similarity(feats, torch.as_tensor(p1).double()[None], dim=1))


def select(z, tau0: float, tau1: float) -> tuple:
    """Eqs. 8-9: (negatives, positives) as positions in ``z``: the int(tau0 n0) largest of the n0 with z >= 0,
    the int(tau1 n1) smallest of the n1 with z < 0 (ties: the earlier position first)."""
    z = torch.as_tensor(z, dtype=torch.float64)
    pos_side, neg_side = torch.nonzero(z < 0).flatten(), torch.nonzero(z >= 0).flatten()
    k0, k1 = int(tau0 * len(neg_side)), int(tau1 * len(pos_side))
    negatives = neg_side[torch.sort(-z[neg_side], stable=True).indices[:k0]]
    positives = pos_side[torch.sort(z[pos_side], stable=True).indices[:k1]]
    return negatives, positives


def class_means(feats, y, classes) -> dict:
    """Eq. 5: per class c in ``classes`` (with both a negative and a positive) the (2, D) means of F over y_c = 0, 1."""
    return {c: torch.stack([feats[y[:, c] == 0].mean(0), feats[y[:, c] == 1].mean(0)]).double()
            for c in classes if (y[:, c] == 0).any() and (y[:, c] == 1).any()}


def global_prototypes(sent: list) -> dict:
    """Eq. 6: each class's prototypes averaged over the sites that sent it."""
    out = {}
    for c in sorted({c for p in sent for c in p}):
        have = [p[c] for p in sent if c in p]
        out[c] = sum(have) / len(have)
    return out


def global_degree(degrees: list, sizes: list, sites_for: list) -> torch.Tensor:
    """d_c^G: per class the size-weighted mean of the sites' d_c^k over ``sites_for[c]``; 1 where none."""
    out = torch.ones(len(degrees[0]), dtype=torch.float64)
    for c, have in enumerate(sites_for):
        if have:
            w = torch.tensor([float(sizes[k]) for k in have], dtype=torch.float64)
            out[c] = sum(w[i] * degrees[k][c] for i, k in enumerate(have)) / w.sum()
    return out


def fedavg(states: list, sizes: list) -> dict:
    w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    out = {}
    for key, v in states[0].items():
        mean = sum(wi * s[key].double() for wi, s in zip(w, states))
        out[key] = mean.round().to(v.dtype) if not v.dtype.is_floating_point else mean.to(v.dtype)
    return out


# ---------------------------------------------------------------- one site

class Site:
    """A site's cases, its permanent tags and its round. ``y``: labels, -1 where the site does not annotate."""

    def __init__(self, x, y, logit_adjustment: bool = True, missing_prior: str = "tags"):
        if missing_prior not in ("tags", "cases"):
            raise ValueError(f"missing_prior {missing_prior!r}: 'tags' or 'cases'")
        self.x, self.y, self.logit_adjustment, self.missing_prior = x, y, logit_adjustment, missing_prior
        self.annotated = (y >= 0).any(0)
        self.tags = torch.full_like(y, -1.0)
        self.optimizer = None

    def shift(self) -> torch.Tensor:
        if not self.logit_adjustment:
            return torch.zeros(self.y.shape[1])
        n = len(self.y)
        tagged = (self.tags >= 0).sum(0) if self.missing_prior == "tags" else torch.full((self.y.shape[1],), n)
        lab = torch.where(self.annotated, (self.y >= 0).sum(0), tagged)
        pos = torch.where(self.annotated, (self.y == 1).sum(0), (self.tags == 1).sum(0))
        return logit_shift(pos, lab)

    @torch.no_grad()
    def embed(self, net, view):
        """Features and probabilities of every case, inference mode, on ``view(x)``."""
        net.eval()
        f = features(net, view(self.x))
        return f, torch.sigmoid(net.fc(f))

    def tag(self, global_net, protos: dict, tau0, tau1, view) -> tuple:
        """Stage 2's missing-label detection with the received model: (new negatives, new positives)."""
        f, _ = self.embed(global_net, view)
        new = [0, 0]
        for c in torch.nonzero(~self.annotated).flatten().tolist():
            if c not in protos:
                continue
            pool = torch.nonzero(self.tags[:, c] < 0).flatten()
            if not len(pool):
                continue
            negatives, positives = select(z_scores(f[pool], *protos[c]), float(tau0[c]), float(tau1[c]))
            self.tags[pool[negatives], c] = 0.0
            self.tags[pool[positives], c] = 1.0
            new[0], new[1] = new[0] + len(negatives), new[1] + len(positives)
        return tuple(new)

    def train(self, net, teacher, batches, epochs: int, views, weight: float, make_optimizer, carry: bool):
        """WPC (+ the consistency term when ``teacher``), the mean over the views ``views(x)`` of each batch;
        returns the last loss."""
        if self.optimizer is None or not carry:
            self.optimizer = make_optimizer(net)
        shift = self.shift()
        target = torch.where(self.y >= 0, self.y, self.tags)
        untagged = ((self.y < 0) & (self.tags < 0)).float()
        net.train()
        loss = None
        for _ in range(epochs):
            for idx in batches(len(self.y)):
                xs = views(self.x[idx])
                loss = 0.0
                for x in xs:
                    logits = net(x)
                    term = wpc(logits, target[idx], shift)
                    if teacher is not None:
                        with torch.no_grad():
                            t = torch.sigmoid(teacher(x))
                        term = term + weight * consistency(torch.sigmoid(logits), t, untagged[idx])
                    loss = loss + term / len(xs)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
        return None if loss is None else float(loss.detach())

    def summary(self, net, view, low: float, high: float):
        """After training: the prototypes of the classes it annotates (Eq. 5) and d_c^k (Eq. 10)."""
        f, p = self.embed(net, view)
        return class_means(f, self.y, torch.nonzero(self.annotated).flatten().tolist()), \
            ((p < low) | (p > high)).double().mean(0)


def teacher_of(net):
    """The received model as the consistency target: a frozen copy in inference mode (the released code's
    ``glob_model.eval()``)."""
    t = copy.deepcopy(net).eval()
    for p in t.parameters():
        p.requires_grad_(False)
    return t


# ---------------------------------------------------------------- the federation

def strong_augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The bundle's strong view of an augmented batch, per case: with probability 0.8 a gamma contrast change in
    [0.5, 2], with probability 0.8 Gaussian noise of a standard deviation drawn in [0, 0.1], with probability
    0.5 one square of a quarter of the side set to 0 at a random place."""
    n, size = len(x), x.shape[-1]
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=gen)  # noqa: E731
    gamma, on = u(0.5, 2.0), torch.rand(n, generator=gen) < 0.8
    lo = x.amin(dim=(1, 2, 3), keepdim=True)
    rng = x.amax(dim=(1, 2, 3), keepdim=True) - lo
    x = torch.where(on[:, None, None, None], ((x - lo) / (rng + 1e-7)) ** gamma[:, None, None, None] * rng + lo, x)
    std, on = u(0.0, 0.1), torch.rand(n, generator=gen) < 0.8
    noise = torch.randn(x.shape, generator=gen) * std[:, None, None, None]
    x = torch.where(on[:, None, None, None], x + noise, x)
    side, on = size // 4, torch.rand(n, generator=gen) < 0.5
    out = x.clone()
    for i in torch.nonzero(on).flatten().tolist():
        r, c = (int(torch.randint(0, size - side + 1, (1,), generator=gen)) for _ in range(2))
        out[i, :, r:r + side, c:c + side] = 0.0
    return out


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 3e-5, batch_size: int = 32,
        weight_decay: float = 5e-4, carry_optimizer: bool = False, epochs: int = 1, warmup_rounds: int = 50,
        low: float = 0.3, high: float = 0.7, tau0: float = 0.005, tau1: float = 0.01, logit_adjustment: bool = True,
        adaptive_threshold: bool = True, degree_sites: str = "missing", consistency_weight: float = 1.0,
        two_views: bool = True, missing_prior: str = "tags", widen: float = 0.25, scaling: str = "fixed", grey: str = "mean",
        log=print) -> dict:
    """FedMLP over a prepared partial-label scenario (label -1: not annotated). Test metric: the mean
    one-vs-rest AUROC of the global model on the pooled test split."""
    from .fedavg_multilabel import ResNet18, augment, batcher, load_scenario, macro_auroc

    if degree_sites not in ("missing", "annotating"):
        raise ValueError(f"degree_sites {degree_sites!r}: 'missing' or 'annotating'")
    classes, loaded, test = load_scenario(Path(data), scaling, grey_rule=grey)
    n_classes = len(classes)
    sites = [Site(x, y, logit_adjustment, missing_prior) for x, y in loaded]
    sizes = [len(s.y) for s in sites]
    annotators = [[k for k, s in enumerate(sites) if s.annotated[c]] for c in range(n_classes)]
    sites_for = annotators if degree_sites == "annotating" else \
        [[k for k in range(len(sites)) if k not in annotators[c]] for c in range(n_classes)]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = batcher(gen, batch_size)

    def weak(x):
        return augment(x, gen)

    def views(x):  # the strong view transforms the weak one further, as the bundle's
        first = weak(x)
        return [first, strong_augment(first, gen)] if two_views else [first]

    def make_optimizer(net):
        return torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)

    global_net = ResNet18(1, n_classes, widen)
    nets = [ResNet18(1, n_classes, widen) for _ in sites]
    protos, degree = {}, None
    out, seconds = {}, []
    for rnd in range(rounds):
        t0 = time.perf_counter()
        stage = 1 if rnd < warmup_rounds else 2
        d = degree if (adaptive_threshold and degree is not None) else torch.ones(n_classes, dtype=torch.float64)
        states, sent, degrees = [], [], []
        for site, net in zip(sites, nets):
            net.load_state_dict(global_net.state_dict())
            if stage == 2 and protos:
                site.tag(global_net, protos, d * tau0, d * tau1, weak)
            teacher = teacher_of(global_net) if stage == 2 and consistency_weight > 0 else None
            site.train(net, teacher, batches, epochs, views, consistency_weight, make_optimizer, carry_optimizer)
            states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
            if rnd >= warmup_rounds - 1:
                p, dk = site.summary(net, weak, low, high)
                sent.append(p)
                degrees.append(dk)
        global_net.load_state_dict(fedavg(states, sizes))
        if degrees:  # a class no site sent prototypes for this round keeps its old ones
            protos = {**protos, **global_prototypes(sent)}
            degree = global_degree(degrees, sizes, sites_for)
        seconds.append(time.perf_counter() - t0)
        if rnd + 1 in eval_rounds:
            out[rnd + 1] = {"auroc": macro_auroc(global_net, *test),
                            # (negatives, positives) tagged so far, all sites
                            "tags": [sum(int((s.tags == v).sum()) for s in sites) for v in (0, 1)]}
            log(f"[reference] fedmlp seed {seed} round {rnd + 1}: {out[rnd + 1]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds}
