"""RSCFed on partial labels (the project's ``rscfed_pl`` row, docs/methods/fedmlp.md) in plain PyTorch: no
fedlabels, no MONAI.

FedMLP (Sun et al., MICCAI 2024, ../shared/papers/001_*, Tables 1-2) compares with RSCFed (Liang et al., CVPR
2022) on partial labels and prints no rule for it; its released code runs another scheme (docs/methods/fedmlp.md).
What runs here is RSCFed's own scheme, written from its paper and released code (github.com/XMed-Lab/RSCFed, the
sources in ``semisup.RSCFED``), with the missing classes of a partial-label site in the place of an unlabeled
client's cases:

* each round ``subsets`` draws of ``subset_size`` distinct sites (``random.sample``, RSCFed's ``--meta_round`` and
  ``--meta_client_num``); every member of every draw trains from the global model (a site drawn twice trains
  twice, each a fresh start from the global model);
* a site's loss on a batch: the BCE of the weak view over the entries it annotates (averaged over them) plus
  ``consistency_weight`` x the mean squared difference between the student's sigmoid on the strong view and a
  mean teacher's sigmoid on the weak view, over the entries it does not annotate (averaged over them; nothing
  when it annotates every class);
* the teacher is the received model, frozen and in inference mode, made anew each time the site trains; after
  every step its parameters move towards the student's by ``ema_alpha`` (W_t <- alpha W_s + (1 - alpha) W_t,
  Mean Teacher's rule, RSCFed's ``update_ema_variables``) and its batch-norm statistics are the student's;
* each draw is aggregated by Eqs. 2-3 (``semisup.wfedavg``: n_k exp(-lambda d_k / n_k), d_k the distance of the
  flattened model to the draw's case-weighted mean) with lambda = ``sup_scale`` (every member annotates some
  class: RSCFed's scale for a group holding a labeled client); the global model is the plain mean of the draws'
  models (RSCFed ``train_main.py``).

Settings (``PAPER``): FedMLP's Sec. 3.1.3 values "for all comparison methods" (those of ``partial_fedavg``),
RSCFed's released code for the rest.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import numpy as np
import torch

from . import fedavg_multilabel, fedmlp, partial_fedavg, semisup
from .surgical import partial_bce

PAPER = {**{key: partial_fedavg.PAPER[key] for key in ("lr", "batch_size", "epochs", "rounds", "weight_decay",
                                                      "carry_optimizer", "pos_weight")},
         "consistency_weight": (semisup.RSCFED["lambda_u"][0], semisup.RSCFED["lambda_u"][1] + " (RSCFed's loss sums "
                                "the squares over classes; here they are averaged over the missing entries)"),
         "ema_alpha": (round(1 - semisup.RSCFED["ema_decay"][0], 12), semisup.RSCFED["ema_decay"][1]),
         "sup_scale": semisup.RSCFED["sup_scale"],
         "subsets": semisup.RSCFED["meta_round"],
         "subset_size": (3, "3 of the 4 sites (RSCFed's README draws 5 of its 10 clients; the project's default)")}
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {**fedmlp.LEFT_OUT, **fedavg_multilabel.UNANNOTATED,
            "unannotated_site": "a site annotating no class is drawn as any other and sits out of its draw (the "
                                "project's site abstains likewise); RSCFed's unlabeled clients train on the "
                                "consistency alone",
            "views": "the bundle's weak view and its strong view (the weak view further changed: contrast, Gaussian "
                     "noise, a dropped square), not RSCFed's two weak views",
            "teacher": "made anew from the received model each time the site trains, its batch-norm statistics the "
                       "student's; RSCFed keeps one teacher across rounds and averages its parameters only",
            "sharpening": "none: a sigmoid per class has no temperature to sharpen over the classes",
            "ema_warmup": "a constant alpha, not RSCFed's min(1 - 1 / (step + 1), decay)",
            "clip": "no gradient clipping (RSCFed's --max_grad_norm 5)",
            "w_mul_times": "1 (RSCFed's README runs 6)"}


def loss_fn(weak_logits, strong_logits, teacher_logits, y, weight, consistency_weight: float) -> torch.Tensor:
    """The BCE of the weak view over the annotated entries (y >= 0) plus ``consistency_weight`` x the mean over the
    missing entries (y < 0) of (sigmoid(strong) - sigmoid(teacher))^2 (0 when none is missing)."""
    loss = partial_bce(weak_logits, y, weight)
    missing = (y < 0).float()
    if strong_logits is not None and missing.any():
        sq = (torch.sigmoid(strong_logits) - torch.sigmoid(teacher_logits)) ** 2
        loss = loss + consistency_weight * (sq * missing).sum() / missing.sum()
    return loss


@torch.no_grad()
def ema(teacher: torch.nn.Module, student: torch.nn.Module, alpha: float) -> None:
    """The teacher's parameters: alpha W_s + (1 - alpha) W_t; its buffers (batch-norm statistics): the student's."""
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.copy_(alpha * s + (1 - alpha) * t)
    for t, s in zip(teacher.buffers(), student.buffers()):
        t.copy_(s)


class Site:
    """One site's cases (``annotated``: it annotates some class) and, with ``carry_optimizer``, its kept Adam."""

    def __init__(self, x, y, make_net, weight):
        self.x, self.y, self.n, self.weight = x, y, len(y), weight  # n: set again by each train
        self.annotated = bool((y >= 0).any())
        self.net, self.opt = make_net(), None

    def train(self, weights: dict, s: dict, gen, views) -> dict:
        """From ``weights``: ``epochs`` passes in shuffled batches; the trained state."""
        self.net.load_state_dict(weights)  # in place: a kept Adam keeps its parameters and moments
        if self.opt is None or not s["carry_optimizer"]:
            self.opt = torch.optim.Adam(self.net.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
        teacher = copy.deepcopy(self.net).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.net.train()
        missing = bool((self.y < 0).any()) and s["consistency_weight"] > 0
        # a last batch of one case is dropped (batch norm cannot train on it), as the bundles' loaders drop it
        batches = fedavg_multilabel.batcher(gen, s["batch_size"], smallest=2 if s["batch_size"] > 1 else 1)
        trained = 0
        for _ in range(s["epochs"]):
            for idx in batches(len(self.y)):
                trained += len(idx)
                weak, strong = views(self.x[idx], gen)
                weak_logits = self.net(weak)
                if missing and bool((self.y[idx] < 0).any()):
                    with torch.no_grad():
                        teacher_logits = teacher(weak)
                    strong_logits = self.net(strong)
                else:
                    teacher_logits = strong_logits = None
                loss = loss_fn(weak_logits, strong_logits, teacher_logits, self.y[idx], self.weight,
                               s["consistency_weight"])
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                ema(teacher, self.net, s["ema_alpha"])
        self.n = round(trained / s["epochs"])  # n_k: the cases of one epoch it trained on
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def weak_and_strong(x: torch.Tensor, gen: torch.Generator):
    """A batch's weak view and its strong view, the weak one further transformed (as the bundles' are)."""
    weak = fedavg_multilabel.augment(x, gen)
    return weak, fedmlp.strong_augment(weak, gen)


def one_round(sites: list, weights: dict, draws: list, s: dict, gen, views) -> dict:
    """One round from the global ``weights``: each draw (indices into ``sites``) trained and aggregated by Eqs.
    2-3, the new global model their plain mean; a draw whose members all annotate nothing leaves nothing."""
    models = []
    for draw in draws:
        members = [sites[i] for i in draw if sites[i].annotated]
        if members:
            states = [t.train(weights, s, gen, views) for t in members]
            models.append(semisup.wfedavg(states, [t.n for t in members], s["sup_scale"], "paper"))
    return semisup.mean_state(models, [1.0] * len(models)) if models else weights


def run(data, rounds: int, eval_rounds, seed: int = 0, widen: float = 0.25, scaling: str = "fixed",
        grey: str = "mean", log=print, **settings) -> dict:
    """RSCFed on partial labels over a prepared partial-label scenario (label -1: not annotated). Test metric: the
    mean one-vs-rest AUROC of the global model on the pooled test split."""
    s = {**CHECK, **settings}
    unknown = set(settings) - set(CHECK)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; settings: {sorted(CHECK)}")
    classes, raw, test = fedavg_multilabel.load_scenario(Path(data), scaling, grey_rule=grey, keep_unannotated=True)
    if not 1 <= s["subset_size"] <= len(raw):
        raise ValueError(f"subset_size {s['subset_size']}: between 1 and the {len(raw)} sites")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)  # RSCFed draws with Python's random module

    def make_net():
        return fedavg_multilabel.ResNet18(1, len(classes), widen)

    global_net = make_net()
    weights = {k: v.clone() for k, v in global_net.state_dict().items()}
    sites = [Site(x, y, make_net, partial_fedavg.class_weights(y, s["pos_weight"])) for x, y in raw]
    out, seconds = {}, []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        draws = [draw.sample(range(len(sites)), s["subset_size"]) for _ in range(s["subsets"])]
        weights = one_round(sites, weights, draws, s, gen, weak_and_strong)
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            global_net.load_state_dict(weights)
            out[rnd] = {"auroc": fedavg_multilabel.macro_auroc(global_net, *test)}
            log(f"[reference] rscfed_pl seed {seed} round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds}
