"""Independent references of IsoFed, MT+wFedAvg and dynamically weighted FedAvg, in plain PyTorch and NumPy.

Written from the papers (no fedlabels, no MONAI): IsoFed (Saha et al.,
MICCAI 2023, ../shared/papers/003_*) Sec. 2.2-2.4 and Eq. 1-4, and, where
IsoFed defers its training settings to RSCFed (Sec. 3.2: "We follow the
settings prescribed for a training RSCFed"), RSCFed's released code
(github.com/XMed-Lab/RSCFed; ``RSCFED`` below cites the file and option of
every value).

* ``dynamic_weights`` / ``wfedavg``: Eq. 2-3. W_avg = sum n_k W_k / sum n_k;
  c_k = n_k exp(-lambda ||W_k - W_avg||_2 / n_k); W = sum c_k W_k / sum c_k.
  ``distance="paper"`` is the printed norm of the whole flattened model;
  ``distance="rscfed"`` is RSCFed's ``FedAvg.py`` ``model_dist``: the sum over
  the state dict's tensors of each tensor's own norm.
* Labeled site: cross-entropy (Sec. 2.2). Unlabeled site: mean teacher
  (Sec. 2.2): the teacher starts as the received model (after pretraining), sees
  the weak view; the student sees the strong view; the loss is
  ``lambda_u`` x ||Sharpen(p_teacher, T) - p_student||_2^2 per case, averaged
  over the batch; after every step W_t <- alpha W_s + (1 - alpha) W_t (Eq. 1,
  alpha = 1 - RSCFed's ``ema_decay``).
* Client-adaptive pretraining (Sec. 2.4, Eq. 4, information maximisation):
  mean per-case entropy minus the entropy of the mean prediction, minimised on
  the unlabeled site's weak views before the teacher is made; the adapted model
  starts the teacher and the student.
* ``isofed`` (Sec. 2.3): the unlabeled sites train from W_glob and are
  aggregated into W_u (scale ``dist_scale``, RSCFed's rule for a group with no
  labeled site); the labeled sites train from W_u and are aggregated into the
  new W_glob (scale ``sup_scale``). ``mt_wfedavg``: every site trains from
  W_glob at once, one aggregation (the group holds a labeled site:
  ``sup_scale``). ``wfedavg``: labeled sites only (with ``oracle=True`` every
  site from its full labels: the paper's upper bound).
* ``rscfed`` (RSCFed, Liang et al., CVPR 2022, as its released ``train_main.py``
  runs it): each round ``subsets`` draws of ``subset_size`` distinct sites
  (``random.sample``, RSCFed's ``--meta_round`` and ``--meta_client_num``);
  every member of every subset trains from W_glob (a site drawn twice trains
  twice, its optimizer carried between them as RSCFed's per-client optimizer
  state is); each subset is aggregated by Eq. 2-3 (``sup_scale`` when it holds a
  labeled site, else ``dist_scale``); W_glob is the plain mean of the subset
  models.
* ``warmup_rounds`` (RSCFed's ``--resume --from_labeled``: its semi-supervised
  rounds start from a checkpoint "trained only on labeled client"; the code
  that made it is not released): the first rounds train the labeled sites only,
  their optimizers carried on, aggregated as the method's labeled group.
* Views: ``hflip`` (a left-right flip), ``crop_hflip`` (RSCFed's
  ``cifar_load.py``: the image resized to 5/4 of its size, a random crop back
  to its size, then the flip: 40 -> 32 px there, 35 -> 28 px on MedMNIST) and,
  for the student, ``hflip`` again (a second draw, RSCFed's second weak view)
  or ``photometric`` (a strong view of our own choosing, the bundle's: a random
  gamma contrast, Gaussian noise and one square hole on the weak view; IsoFed
  does not define its strong view).
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from .fedavg_classification import AUGMENT as FLIPS
from .fedavg_classification import IsoFedCNN, hflip, load_split, test_metrics

_README = "RSCFed README.md (run example)"
# RSCFed's released settings, each with where the code says it. (value, source)
RSCFED = {
    "optimizer": ("sgd", f"{_README}: --opt=sgd"),
    "lr_labeled": (0.03, f"{_README}: --base_lr=0.03 (local_supervised.py sets it every round)"),
    "lr_unlabeled": (0.021, f"{_README}: --unsup_lr=0.021; options.py --unsup_lr default 0.021"),
    "momentum": (0.9, "local_supervised.py and local_unsupervised.py: torch.optim.SGD(..., momentum=0.9, ...)"),
    "weight_decay": (5e-4, "local_supervised.py and local_unsupervised.py: torch.optim.SGD(..., weight_decay=5e-4)"),
    "max_grad_norm": (5.0, f"{_README}: --max_grad_norm=5; options.py default 5 (clip_grad_norm_ every step)"),
    "batch_size": (64, f"{_README}: --batch_size=64"),
    "local_epochs": (1, "options.py --local_ep default 1"),
    "lambda_u": (0.02, f"{_README}: --lambda_u=0.02"),
    "ramp_up": (None, "options.py --num-warmup-epochs default 0 (the README does not set it): local_unsupervised.py's "
                      "LinearRampUp(length=0) returns 1.0 every round, so lambda_u is not ramped"),
    "temperature": (0.5, "utils_SimPLE.py sharpen(x, t=0.5), called without t in local_unsupervised.py"),
    "ema_decay": (0.999, "options.py --ema_decay default 0.999"),
    "sup_scale": (1.0, "options.py --sup_scale default 1 (the README's SVHN run: 100)"),
    "dist_scale": (1e4, f"{_README}: --dist_scale=1e4; options.py default 1e4"),
    "w_mul_times": (1.0, "options.py --w_mul_times default 1 (the README's SVHN run: 6)"),
    "carry_optimizer": (True, "train_main.py: sup_optim_locals / unsup_optim_locals keep each client's optimizer "
                              "state from round to round"),
    "augment": ("crop+hflip", "cifar_load.py get_dataloader: RandomCrop(input_sz) of a pre_sz image and "
                              "RandomHorizontalFlip(0.5); an unlabeled client's two views are two draws of that "
                              "weak transform (TransformTwice(weak_trans))"),
    "warm_start": ("labeled checkpoint", f"{_README}: --resume --from_labeled (train_main.py loads warmup/*.pth)"),
    "rounds": (1000, f"{_README}: --rounds=1000"),
    "distance": ("rscfed", "FedAvg.py model_dist: the sum of per-tensor norms"),
    "teacher": ("kept across rounds", "local_unsupervised.py: the EMA model is loaded from the received weights "
                                      "once (self.flag) and then persists from round to round; IsoFed Sec. 2.2 "
                                      "initialises the teacher from the received model every round (this reference)"),
    "ema_warmup": ("min(1 - 1 / (step + 1), ema_decay)", "local_unsupervised.py update_ema_variables, step = the "
                                                          "client's iteration count over all rounds"),
    "meta_round": (3, f"{_README}: --meta_round=3, the number of sub-consensus models a round"),
    "meta_client_num": (5, f"{_README}: --meta_client_num=5 of its 10 clients (train_main.py random.sample)"),
    "w_mul_times_rule": ("coefficient only", "train_main.py: with --un_dist=avg (the README at commit 4872944) a chosen labeled "
                                             "client's coefficient is multiplied (m n exp(...)), the average its "
                                             "distance is taken from is by counts; with --un_dist '' (options.py "
                                             "default) its count is multiplied before the average and its "
                                             "coefficient again (m^2 n exp(...))"),
}

# What the reference runs beside the project's rows (``benchmarks/reference_check.py --rows``): RSCFed's values
# where the project can express them; each value left out is named, with what runs instead and why.
CHECK = {"optimizer": "sgd", "lr": RSCFED["lr_labeled"][0], "lr_unlabeled": RSCFED["lr_unlabeled"][0],
         "momentum": RSCFED["momentum"][0],
         "weight_decay": RSCFED["weight_decay"][0], "batch_size": RSCFED["batch_size"][0],
         "epochs": RSCFED["local_epochs"][0], "lambda_u": RSCFED["lambda_u"][0],
         "temperature": RSCFED["temperature"][0], "ema_alpha": round(1 - RSCFED["ema_decay"][0], 12),
         "sup_scale": RSCFED["sup_scale"][0], "dist_scale": RSCFED["dist_scale"][0],
         "w_mul_times": RSCFED["w_mul_times"][0],
         "carry_optimizer": RSCFED["carry_optimizer"][0], "max_grad_norm": RSCFED["max_grad_norm"][0],
         "augment": "hflip", "strong": "hflip", "scaling": "fixed", "distance": "paper", "pretrain_epochs": 1,
         "subsets": RSCFED["meta_round"][0], "subset_size": 3, "warmup_rounds": 0}
_FLIP_ONLY = ("a left-right flip only, no random crop (RSCFed crops 32 px out of 40 px; MedMNIST is 28 px and the "
              "project's bundle has no crop)")
LEFT_OUT = {  # each entry stands while its setting keeps CHECK's value (left_out)
    "augment": f"{_FLIP_ONLY}; the student's view is a second independent flip, as RSCFed's second weak view",
    "warm_start": "none (warmup_rounds 0)",
    "rounds": "the check's budget, not 1000",
    "distance": "the paper's norm of the flattened model (Eq. 3), which the project implements; RSCFed's sum of "
                "per-tensor norms is the reference's distance='rscfed'",
    "scaling": "x / 127.5 - 1 (MedMNIST's released Normalize(0.5, 0.5)); RSCFed normalises by its datasets' mean/sd",
}
# What runs instead of RSCFed's value where a setting left CHECK's (``--set``); "strong" only: RSCFed's is CHECK's.
INSTEAD = {
    "augment": "RSCFed's resize-crop-flip scaled to MedMNIST (35 px, a random 28 px crop, a flip; RSCFed's 40 and 32 "
               "px), the crop offsets uniform over every position",
    "strong": "the student's view is the weak view with a random gamma contrast (probability 0.8, gamma 0.5-2 over "
              "the image's own range), Gaussian noise (probability 0.8, sd drawn from 0-0.2) and one 7 x 7 hole set "
              "to 0 (probability 0.5): the bundle's strong view, not RSCFed's second weak view",
    "warm_start": "the first warmup_rounds rounds train the labeled sites only, their optimizers carried on: a reading "
                  "of RSCFed's --from_labeled checkpoint, whose code is not released",
}


# CHECK's training settings that are RSCFed's values as released (left_out names them when --set changes them)
TRAINING = {"optimizer": "optimizer", "lr": "lr_labeled", "lr_unlabeled": "lr_unlabeled", "momentum": "momentum",
             "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm", "lambda_u": "lambda_u",
             "carry_optimizer": "carry_optimizer"}


def left_out(s: dict, student: bool = True) -> dict:
    """RSCFed's values not used by settings ``s``, each with what runs instead (``student`` False: a row without
    a student, the labeled site alone, whose text names no student's view)."""
    out = dict(LEFT_OUT) if student else {**LEFT_OUT, "augment": _FLIP_ONLY}
    if s.get("augment", "hflip") != "hflip":
        out["augment"] = INSTEAD["augment"]
    if s.get("strong", "hflip") != "hflip":
        out["strong"] = INSTEAD["strong"]
    if s.get("warmup_rounds", 0):
        out["warm_start"] = INSTEAD["warm_start"]
    for key, name in TRAINING.items():  # a training setting --set away from RSCFed's (e.g. a preset's own)
        if key in s and s[key] != CHECK[key] and (key != "momentum" or s.get("optimizer") == "sgd"):
            out[key] = f"{s[key]} (RSCFed's: {RSCFED[name][0]})"
    return out


# Not printed by IsoFed nor set by RSCFed (RSCFed has no pretraining): the reference's stated choice.
CHOICES = {"pretrain_epochs": "1 pass over the unlabeled site's weak views",
           "pretrain_lr": "the site's lr, a fresh optimizer of the same kind each round",
           "pretrain_target": "the adapted model starts the teacher and the student (Sec. 2.4 adapts 'the global "
                              "model' before it initialises the teacher)",
           "subset_size": "3 of the 4 sites (RSCFed's README draws 5 of its 10 clients; the isofed_rscfed preset's "
                          "choice, which the check gives both sides)",
           "pretrain_sites": "the unlabeled sites only (Sec. 2.4 pretrains before the model initialises the teacher, "
                             "which only they have; Fig. 2's caption says 'for each client')"}


# ---------------------------------------------------------------- aggregation (Eq. 2-3)


def mean_state(states: list, weights) -> dict:
    """sum_k w_k S_k / sum_k w_k per key, in float64, cast back (integer tensors rounded)."""
    w = np.asarray(weights, dtype=np.float64)
    if not w.sum() > 0:
        raise ValueError("weights sum to zero")
    out = {}
    for key, first in states[0].items():
        acc = sum(float(wk) * torch.as_tensor(s[key]).double() for wk, s in zip(w, states)) / float(w.sum())
        out[key] = (acc.round() if not torch.as_tensor(first).is_floating_point() else acc).to(torch.as_tensor(first).dtype)
    return out


def flat_distance(a: dict, b: dict) -> float:
    """||a - b||_2 of the whole flattened model (floating-point tensors)."""
    sq = sum(float(((torch.as_tensor(a[k]).double() - torch.as_tensor(b[k]).double()) ** 2).sum())
             for k in a if torch.as_tensor(a[k]).is_floating_point())
    return float(np.sqrt(sq))


def sum_of_norms(a: dict, b: dict) -> float:
    """RSCFed's model_dist: sum over tensors of ||a_t - b_t||_2."""
    return float(sum(float(torch.linalg.vector_norm(torch.as_tensor(a[k]).double() - torch.as_tensor(b[k]).double()))
                     for k in a))


DISTANCES = {"paper": flat_distance, "rscfed": sum_of_norms}


def dynamic_weights(states: list, n, scale: float, distance: str = "paper", mul=None) -> np.ndarray:
    """Eq. 3's c_k / sum c_k (Eq. 2's W_avg by n_k): m_k n_k exp(-scale d_k / n_k), d_k = distance(W_k, W_avg);
    ``mul`` m_k (default 1): RSCFed's --w_mul_times on a labeled client's coefficient (``w_mul_times_rule``)."""
    n = np.asarray(n, dtype=np.float64)
    m = np.ones_like(n) if mul is None else np.asarray(mul, dtype=np.float64)
    avg = mean_state(states, n)
    d = np.array([DISTANCES[distance](s, avg) for s in states])
    z = -scale * d / n
    c = m * n * np.exp(z - z.max())  # the common factor exp(max z) cancels in the ratio
    return c / c.sum()


def wfedavg(states: list, n, scale: float, distance: str = "paper", mul=None) -> dict:
    """Dynamically weighted FedAvg of ``states``."""
    return mean_state(states, dynamic_weights(states, n, scale, distance, mul))


# ---------------------------------------------------------------- views


def crop_hflip(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """RSCFed's weak view scaled to ``x``'s size s: bilinear resize to 5 s / 4, a random s x s crop per image (every
    offset equally likely), a left-right flip with probability 1/2."""
    size = x.shape[-1]
    big = nn.functional.interpolate(x, size=(size * 5 // 4,) * 2, mode="bilinear", align_corners=False)
    spare = big.shape[-1] - size
    at = torch.randint(0, spare + 1, (len(x), 2), generator=gen)
    crops = torch.stack([big[i, :, a:a + size, b:b + size] for i, (a, b) in enumerate(at.tolist())])
    return hflip(crops, gen)


def adjust_contrast(img: torch.Tensor, gamma: float) -> torch.Tensor:
    """One image's gamma contrast over its own range: ((x - min) / (range + 1e-7)) ** gamma * range + min."""
    lo, span = img.min(), img.max() - img.min()
    return ((img - lo) / (span + 1e-7)) ** gamma * span + lo


def photometric(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The strong view of each image: gamma contrast (p 0.8, gamma ~ U(0.5, 2)), Gaussian noise (p 0.8, sd ~ U(0,
    0.2)), one (s // 4)-square hole set to 0 (p 0.5, its corner uniform over every position)."""
    out = x.clone()
    hole = x.shape[-1] // 4
    for i in range(len(x)):
        u = torch.rand(6, generator=gen).tolist()
        if u[0] < 0.8:
            out[i] = adjust_contrast(out[i], 0.5 + 1.5 * u[1])
        if u[2] < 0.8:
            out[i] = out[i] + u[3] * 0.2 * torch.randn(out[i].shape, generator=gen)
        if u[4] < 0.5:
            a, b = torch.randint(0, x.shape[-1] - hole + 1, (2,), generator=gen).tolist()
            out[i, :, a:a + hole, b:b + hole] = 0.0
    return out


AUGMENT = {**FLIPS, "crop_hflip": crop_hflip, "photometric": photometric}


# ---------------------------------------------------------------- local rules


def sharpen(p: torch.Tensor, temperature: float) -> torch.Tensor:
    """p_i^(1/T) / sum_j p_j^(1/T) over the classes (dim 1)."""
    q = p ** (1.0 / temperature)
    return q / q.sum(1, keepdim=True)


def im_loss(logits: torch.Tensor) -> torch.Tensor:
    """Eq. 4 (information maximisation): mean over cases of H(p_i) minus H(mean_i p_i). A class no case gives any
    probability (p_bar exactly 0 in float32) adds 0 log 0 = 0: its log's argument is floored at 1e-12, so neither
    the loss nor its gradient is nan."""
    p = torch.softmax(logits, 1)
    per_case = -(p * torch.log_softmax(logits, 1)).sum(1).mean()
    p_bar = p.mean(0)
    return per_case + (p_bar * torch.log(p_bar.clamp(min=1e-12))).sum()


def consistency(teacher_probs: torch.Tensor, student_probs: torch.Tensor) -> torch.Tensor:
    """||p_t - p_s||_2^2 per case, averaged over the batch (RSCFed: sum of squares / batch size)."""
    return ((teacher_probs - student_probs) ** 2).sum(1).mean()


@torch.no_grad()
def ema(teacher: nn.Module, student: nn.Module, alpha: float) -> None:
    """Eq. 1 on the parameters: W_t <- alpha W_s + (1 - alpha) W_t."""
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.copy_(alpha * s + (1 - alpha) * t)


def optimizer(params, s: dict, lr: float):
    if s["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=s["momentum"], weight_decay=s["weight_decay"])
    if s["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=s["weight_decay"])
    raise ValueError(f"optimizer {s['optimizer']!r}: sgd or adam")


def _step(loss, opt, net, clip):
    opt.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=clip)
    opt.step()


def _batches(n: int, batch_size: int, gen):
    order = torch.randperm(n, generator=gen)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def train_labeled(net, opt, x, y, s, gen) -> None:
    net.train()
    for _ in range(s["epochs"]):
        for idx in _batches(len(y), s["batch_size"], gen):
            _step(nn.functional.cross_entropy(net(AUGMENT[s["augment"]](x[idx], gen)), y[idx]), opt, net,
                  s["max_grad_norm"])


def site_lr(s: dict, labeled: bool) -> float:
    """RSCFed's lr per kind of site: --base_lr on labeled clients, --unsup_lr on unlabeled ones (absent: one lr)."""
    return s["lr"] if labeled or s.get("lr_unlabeled") is None else s["lr_unlabeled"]


def pretrain(net, x, s, gen) -> None:
    """Client-adaptive pretraining: the IM loss on weak views, a fresh optimizer of the site's kind and lr
    (an unlabeled site's)."""
    net.train()
    opt = optimizer(net.parameters(), s, site_lr(s, labeled=False))
    for _ in range(s["pretrain_epochs"]):
        for idx in _batches(len(x), s["batch_size"], gen):
            _step(im_loss(net(AUGMENT[s["augment"]](x[idx], gen))), opt, net, s["max_grad_norm"])


def train_unlabeled(net, opt, x, s, gen) -> None:
    """Mean teacher: the teacher is the model as received here (after any pretraining)."""
    teacher = copy.deepcopy(net)
    for p in teacher.parameters():
        p.requires_grad_(False)
    net.train()
    teacher.eval()  # RSCFed's ema_model.eval() (this CNN has no batch norm or dropout: the same either way)
    for _ in range(s["epochs"]):
        for idx in _batches(len(x), s["batch_size"], gen):
            weak = AUGMENT[s["augment"]](x[idx], gen)
            strong = AUGMENT[s["strong"]](weak, gen)
            with torch.no_grad():
                target = sharpen(torch.softmax(teacher(weak), 1), s["temperature"])
            loss = s["lambda_u"] * consistency(target, torch.softmax(net(strong), 1))
            _step(loss, opt, net, s["max_grad_norm"])
            ema(teacher, net, s["ema_alpha"])


# ---------------------------------------------------------------- rounds

METHODS = ("wfedavg", "isofed", "isofed_nopt", "mt_wfedavg", "rscfed")


class Site:
    def __init__(self, x, y, labeled: bool, make_net, s: dict):
        self.x, self.y, self.labeled, self.n = x, y, labeled, len(x)
        self.net = make_net()
        self.s = s
        self.opt = optimizer(self.net.parameters(), s, site_lr(s, labeled))

    def train(self, weights: dict, method: str, gen) -> dict:
        self.net.load_state_dict(weights)  # in place: the optimizer keeps its parameters (and state)
        if not self.s["carry_optimizer"]:
            self.opt = optimizer(self.net.parameters(), self.s, site_lr(self.s, self.labeled))
        if self.labeled:
            train_labeled(self.net, self.opt, self.x, self.y, self.s, gen)
        else:
            if method == "isofed":
                pretrain(self.net, self.x, self.s, gen)
            train_unlabeled(self.net, self.opt, self.x, self.s, gen)
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def finite(state: dict) -> bool:
    return all(bool(torch.isfinite(torch.as_tensor(v)).all()) for v in state.values())


def one_round(method: str, sites: list, weights: dict, s: dict, gen, dropped: list | None = None,
              draws: list | None = None) -> dict:
    """One round of ``method`` from the global ``weights``; returns the new global weights. ``draws``
    (``rscfed`` only): this round's subsets, each a list of indices into ``sites``.

    A site whose trained model is not finite (its training diverged) is left out of its group's aggregate and
    named in ``dropped``; a group with no finite model leaves its start model unchanged, and RSCFed's mean
    leaves that subset out (the reference's choice: the papers do not say)."""
    labeled = [t for t in sites if t.labeled]
    unlabeled = [t for t in sites if not t.labeled]

    def group(members, start, scale):
        """The group's aggregate, or None when no member's model is finite."""
        trained = [(t, t.train(start, method, gen)) for t in members]
        kept = [(t, st) for t, st in trained if finite(st)]
        if dropped is not None:
            dropped.extend(getattr(t, "name", str(i)) for i, (t, st) in enumerate(trained) if not finite(st))
        if not kept:
            return None
        return wfedavg([st for _, st in kept], [t.n for t, _ in kept], scale, s["distance"],
                       [s["w_mul_times"] if t.labeled else 1.0 for t, _ in kept])

    def scale(members):
        return s["sup_scale"] if any(t.labeled for t in members) else s["dist_scale"]

    if method in ("isofed", "isofed_nopt"):
        w_u = (group(unlabeled, weights, s["dist_scale"]) if unlabeled else None) or weights
        return group(labeled, w_u, s["sup_scale"]) or w_u
    if method == "mt_wfedavg":
        return group(sites, weights, scale(sites)) or weights
    if method == "wfedavg":
        return group(labeled, weights, s["sup_scale"]) or weights
    if method == "rscfed":
        if not draws:
            raise ValueError("rscfed: a round needs its subsets (draws)")
        models = [m for m in (group([sites[i] for i in d], weights, scale([sites[i] for i in d])) for d in draws)
                  if m is not None]
        return mean_state(models, [1.0] * len(models)) if models else weights
    raise ValueError(f"method {method!r}: one of {METHODS}")


def draw_subsets(rng: random.Random, n_sites: int, s: dict) -> list:
    """RSCFed's draw (train_main.py): ``subsets`` times ``random.sample`` of ``subset_size`` distinct sites."""
    if not 1 <= s["subset_size"] <= n_sites:
        raise ValueError(f"subset_size {s['subset_size']}: between 1 and the {n_sites} sites")
    return [rng.sample(range(n_sites), s["subset_size"]) for _ in range(s["subsets"])]


def read_sites(data: Path, channels: int, scaling: str, oracle: bool, only: str | None = None) -> tuple:
    """[(images, labels, labeled)] per site from the scenario folder (``only``: that site alone, which must be
    labeled), and the test split."""
    scenario = yaml.safe_load((data / "scenario.yaml").read_text())
    if only is not None and only not in scenario["sites"]:
        raise ValueError(f"only={only!r}: the scenario's sites are {scenario['sites']}")
    out = []
    for name in scenario["sites"] if only is None else [only]:
        items = json.loads((data / name / ("oracle.json" if oracle else "datalist.json")).read_text())["training"]
        x, y = load_split(data / name, items, channels, scaling)
        known = y >= 0
        if known.any() and not known.all():
            raise ValueError(f"{data / name}: a site here is either fully labeled or fully unlabeled "
                             f"({int(known.sum())} of {len(y)} cases labeled)")
        if only is not None and not known.all():
            raise ValueError(f"only={only!r}: {data / name} is unlabeled; a site trained alone needs its labels")
        out.append((x, y, bool(known.all())))
    test = load_split(data / "test", json.loads((data / "test" / "datalist.json").read_text())["testing"],
                      channels, scaling)
    return out, test, len(scenario["classes"])


def run(data, method: str, rounds: int, eval_rounds, seed: int = 0, oracle: bool = False, channels: int = 3,
        log=print, only: str | None = None, **settings) -> dict:
    """``method`` on a prepared scenario; test metrics at each eval round and the seconds of every round.
    ``only``: that labeled site trains alone (a table's floor; ``wfedavg`` of one site is its own model)."""
    s = {**CHECK, **settings}
    unknown = set(settings) - set(CHECK)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; settings: {sorted(CHECK)}")
    data = Path(data)
    raw, test, classes = read_sites(data, channels, s["scaling"], oracle, only)
    if not any(lab for _, _, lab in raw):
        raise ValueError(f"{data}: no labeled site")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    subsets = random.Random(seed)  # RSCFed draws with Python's random module

    def make_net():
        return IsoFedCNN(channels, classes)

    global_net = make_net()
    weights = {k: v.clone() for k, v in global_net.state_dict().items()}
    sites = [Site(x, y, lab, make_net, s) for x, y, lab in raw]
    for i, site in enumerate(sites):
        site.name = f"site-{i + 1}"
    out, seconds, dropped = {}, [], {}
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        lost = []
        if rnd <= s["warmup_rounds"]:  # the labeled sites alone: the labeled group of wfedavg
            weights = one_round("wfedavg", sites, weights, s, gen, dropped=lost)
        else:
            draws = draw_subsets(subsets, len(sites), s) if method == "rscfed" else None
            weights = one_round(method, sites, weights, s, gen, dropped=lost, draws=draws)
        seconds.append(time.perf_counter() - t0)
        if lost:
            dropped[rnd] = lost
            log(f"[reference] {method} seed {seed} round {rnd}: non-finite model from {lost}, left out")
        if rnd in eval_rounds:
            global_net.load_state_dict(weights)
            out[rnd] = test_metrics(global_net, *test, classes)
            log(f"[reference] {method} seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds, "settings": s,
            "dropped": dropped}
