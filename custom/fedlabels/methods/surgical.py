"""Surgical Aggregation (Kulkarni et al.; docs/methods/surgical.md).

The model is ``head ∘ features``; the head is the network's last ``nn.Linear``
(``net.head_name``), row ``c`` of its weight plus entry ``c`` of its bias
being class ``c``'s classifier.

Server (``SurgicalServer``)
    * features -- every key but the head's -- averaged; the paper's pluggable
      feature rule f (FedAvg / FedBN / FedBN+) is the client's ``bn_policy``
      (base.py: what a site loads and sends of its batch norm).
      ``weighted`` chooses the mean: False (default) = unweighted, 1/K sum_k,
      which is both the paper's Eq. 1 (FedAvg as printed there is 1/K sum_k)
      and the released code; True = McMahan's n_k-weighted FedAvg.
    * head -- Eq. 2/3: for each class c, the global row is the *unweighted* mean
      of the rows of the sites that annotate c (``Update.meta["labeled_mask"]``),
      whatever ``weighted`` says; a class unique to one site therefore takes
      that site's row, and a class no participating site annotates keeps its
      previous global row. Rows a site sends for classes it does not annotate
      are ignored.

    The paper sends each site only the rows of its own classes. FLARE here
    broadcasts one global model, so each site receives the whole head; that is
    equivalent for training and aggregation (the partial BCE gives a site's
    foreign rows zero gradient and the server ignores them) and differs only
    in what a site can see.

Client (``SurgicalClient``)
    * BCE over the classes the site annotates (``partial_bce``), with the
      shared ``pos_weighted`` default of every multi-label method (the paper
      has no positive weighting: ``pos_weighted=False`` reproduces it);
    * head warm-up before federation, once, at the first round the site
      trains, after the global model is loaded and before local training:
      backbone frozen *and in inference mode* (batch-norm statistics and
      dropout fixed, like Keras' frozen layers), the head alone trained for
      ``warmup_epochs`` (paper 15) at ``warmup_lr`` (paper 5e-3) with the
      client's optimizer family (Adam by default). The released code's
      "keep the best validation-loss head" is not done: the client has no
      validation loader. ``warmup_epochs=0`` disables the warm-up. The
      warm-up assumes a pretrained backbone (the paper's is ImageNet's): on a
      randomly initialised one it fits the head to random features. On the
      embedded cxr scenario from scratch (benchmarks/results/partial_label_study,
      3 seeds) a 2-epoch warm-up neither helped nor hurt the single-site
      classes beyond the seed spread (AUROC 0.723 +- 0.015 with, 0.741 +- 0.048
      without, at about 1000 local steps per site).

Paper setup (job configuration, not defaults here): DenseNet121 (ImageNet
weights via ``init_ckpt``), Adam lr 5e-5, 1 local epoch per round, 150
rounds, batch 64. The released model's Dense(256)+ReLU+Dropout(0.3) before
the head is a network option: ``DenseNet121Classifier(hidden=256)``; those
layers then count as features and stay
frozen during the warm-up.

The class-wise head mean (``classwise_head_mean``) is shared with FedPSL's
TDMA, which weights the rows by n_k^c instead.
"""

from __future__ import annotations

import numpy as np
import torch

from ..losses import partial_bce
from .aggregate import average_keys, classwise_head_mean, head_param_keys, meta_vector
from .base import ANNOTATED, HEAD_NAME, LABELED_MASK, ClientRule, ServerRule


def resolve_head_name(updates: list, head_name: str | None = None) -> str:
    """The head's module name: the server option if given, else what the sites say."""
    names = {u.meta.get(HEAD_NAME) for u in updates} - {None}
    if head_name is not None:
        if names - {head_name}:
            raise ValueError(f"server option head_name={head_name!r} disagrees with the sites' {sorted(names)}")
        return head_name
    if len(names) != 1:
        raise ValueError(f"class-wise head aggregation needs the head's name: every update's meta[{HEAD_NAME!r}] "
                         f"(sent by the method's clients) or the server option head_name; got {sorted(names)}")
    return names.pop()


class HeadMetaMixin:
    """Client mixin: add the head's module name to the update's metadata."""

    def make_update(self, n, metrics):
        update = super().make_update(n, metrics)
        update.meta[HEAD_NAME] = self.net.head_name
        return update


# ------------------------------------------------------------ client

class SurgicalClient(HeadMetaMixin, ClientRule):
    """Partial BCE; a one-time head warm-up with the backbone frozen.

    The paper's pluggable feature rule f is the base ``bn_policy`` (fedavg,
    fedbn, fedbn+).
    """

    def __init__(self, net, ctx, *, warmup_epochs=15, warmup_lr=5e-3, **kw):
        super().__init__(net, ctx, **kw)
        if warmup_epochs < 0:
            raise ValueError("warmup_epochs must be >= 0")
        self.warmup_epochs, self.warmup_lr = int(warmup_epochs), float(warmup_lr)
        self.warmed_up = False
        self.warmup_loss = None

    def loss(self, logits, labels):
        if self.profile.task != "multilabel":
            raise ValueError(f"Surgical Aggregation is for multi-label tasks, not {self.profile.task!r}")
        return partial_bce(logits, labels, pos_weight=self.pos_weight)

    def begin_round(self, round, extras):
        if not self.warmed_up:
            self.warmed_up = True
            if self.warmup_epochs > 0:
                self.warmup_loss = self.warm_up()

    def warm_up(self) -> float:
        """Train the head alone on local data, backbone frozen in inference mode."""
        net, head = self.net, self.net.head
        net.eval()
        head.train()
        opt = self.make_optimizer(head.parameters(), lr=self.warmup_lr)
        losses = []
        for _ in range(self.warmup_epochs):
            for batch in self.ctx.train:
                x, y = batch["image"].to(self.device), batch["label"].to(self.device)
                with torch.no_grad():
                    feats = net.extract(x)
                opt.zero_grad(set_to_none=True)
                loss = self.loss(head(feats), y)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        self.set_train_mode()
        return float(np.mean(losses)) if losses else float("nan")

    def make_update(self, n, metrics):
        if self.warmup_loss is not None:
            metrics = {**metrics, "warmup_loss": self.warmup_loss}
            self.warmup_loss = None
        return super().make_update(n, metrics)

    def state_dict(self):
        return {**super().state_dict(), "warmed_up": self.warmed_up}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.warmed_up = bool(state["warmed_up"])


# ------------------------------------------------------------ server

class SurgicalServer(ServerRule):
    """Features: mean over the sites (unweighted unless ``weighted``); head: Eq. 2/3."""

    def __init__(self, weighted=False, head_name=None):
        self.weighted, self.head_name = bool(weighted), head_name

    def aggregate(self, updates, global_weights, round):
        if not updates:
            return dict(global_weights)
        head = resolve_head_name(updates, self.head_name)
        hkeys = head_param_keys(head, global_weights)
        features = {k: v for k, v in global_weights.items() if k not in hkeys}
        out = average_keys(updates, features, self.feature_weights(updates))
        c = np.asarray(global_weights[hkeys[0]]).shape[0]
        out.update(classwise_head_mean(updates, global_weights, head, self.head_weights(updates, c)))
        return {k: out[k] for k in global_weights}

    def screen(self, update, global_weights, round, step):
        """What the head rule reads from the site's meta: its head's name and per-class weights
        (finite, >= 0, and the label summary the site declared at the handshake, not new numbers)."""
        head = self.head_name or update.meta.get(HEAD_NAME)
        if not isinstance(head, str) or not head_param_keys(head, global_weights):
            return f"meta[{HEAD_NAME!r}]={str(update.meta.get(HEAD_NAME))[:60]!r} names no head of the global model"
        if self.head_name and update.meta.get(HEAD_NAME) not in (None, self.head_name):
            return f"meta[{HEAD_NAME!r}] disagrees with the server option head_name={self.head_name!r}"
        c = np.asarray(global_weights[head_param_keys(head, global_weights)[0]]).shape[0]
        try:
            w = np.asarray(self.head_weights([update], c)[0], dtype=np.float64)
        except (ValueError, TypeError) as e:
            return str(e)
        if not np.isfinite(w).all() or (w < 0).any():
            return "per-class head weights from its meta are not finite and >= 0"
        declared = (getattr(self, "summaries", None) or {}).get(update.site)
        for key in (LABELED_MASK, ANNOTATED):
            if declared and key in declared and key in update.meta and \
                    np.asarray(update.meta[key], dtype=np.float64).tolist() != \
                    np.asarray(declared[key], dtype=np.float64).tolist():
                return f"meta[{key!r}] differs from the label summary the site declared at the handshake"
        return None

    def feature_weights(self, updates) -> list:
        return [u.n if self.weighted else 1.0 for u in updates]

    def head_weights(self, updates, c) -> list:
        """Per site, a weight per class row (Eq. 2: 1 where the site annotates the class)."""
        return [meta_vector(u, LABELED_MASK, c) > 0 for u in updates]


def _register():
    from . import Method, register

    register(Method("surgical", SurgicalClient, SurgicalServer, ("multilabel",), {},
                    doc="Surgical Aggregation: class-wise head mean over the sites that annotate each class"))


_register()
