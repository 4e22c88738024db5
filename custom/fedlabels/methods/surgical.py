"""Surgical Aggregation (Kulkarni et al.; METHODS.md "Surgical Aggregation").

The model is ``head ∘ features``; the head is the network's last ``nn.Linear``
(``net.head_name``), row ``c`` of its weight plus entry ``c`` of its bias
being class ``c``'s classifier.

Server (``SurgicalServer``)
    * features -- every key but the head's -- aggregated by the rule
      ``feature_rule`` in {"fedavg", "fedbn", "fedbn+"} (the paper's pluggable
      f). It is the base ``bn_policy`` machinery: with FedBN / FedBN+ the batch
      norm keys never leave the site, so the server keeps its (initial) values.
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
    * plain BCE over the classes the site annotates (``partial_bce``; a
      ``pos_weight`` is used only if one is passed -- the paper has none);
    * head warm-up before federation, once, at the first round the site
      trains, after the global model is loaded and before local training:
      backbone frozen *and in inference mode* (batch-norm statistics and
      dropout fixed, like Keras' frozen layers), the head alone trained for
      ``warmup_epochs`` (paper 15) at ``warmup_lr`` (paper 5e-3) with the
      client's optimizer family (Adam by default). The released code's
      "keep the best validation-loss head" is not done: the client has no
      validation loader. ``warmup_epochs=0`` disables the warm-up. The
      warm-up assumes a pretrained backbone (the paper's is ImageNet's): on a
      randomly initialised one it fits the head to random features, and on
      the embedded cxr scenario it cost pneumothorax (one site's class) about
      0.2 AUROC (benchmarks/results/partial_label_claim.md).

Paper setup (job configuration, not defaults here): DenseNet121 (ImageNet
weights via ``init_ckpt``), Adam lr 5e-5, 1 local epoch per round, 150
rounds, batch 64. The released model's Dense(256)+ReLU+Dropout(0.3) before
the head is a network option: ``DenseNet121Classifier(hidden=256)``; those
layers then count as features (aggregated by ``feature_rule``) and stay
frozen during the warm-up.

The class-wise head mean (``classwise_head_mean``) is shared with FedPSL's
TDMA, which weights the rows by n_k^c instead.
"""

from __future__ import annotations

import numpy as np
import torch

from ..losses import partial_bce
from .base import BN_POLICIES, ClientRule, ServerRule, average_keys


# ------------------------------------------------------------ shared helpers

def head_param_keys(head_name: str, keys) -> list:
    """The state-dict keys of the head among ``keys`` (weight, and bias if any)."""
    return [k for k in (f"{head_name}.weight", f"{head_name}.bias") if k in keys]


def resolve_head_name(updates: list, head_name: str | None = None) -> str:
    """The head's module name: the server option if given, else what the sites say."""
    names = {u.meta.get("head_name") for u in updates} - {None}
    if head_name is not None:
        if names - {head_name}:
            raise ValueError(f"server option head_name={head_name!r} disagrees with the sites' {sorted(names)}")
        return head_name
    if len(names) != 1:
        raise ValueError("class-wise head aggregation needs the head's name: every update's meta['head_name'] "
                         f"(sent by the method's clients) or the server option head_name; got {sorted(names)}")
    return names.pop()


def meta_vector(update, key: str, size: int) -> np.ndarray:
    """A per-class vector from an update's label summary, checked for length."""
    if key not in update.meta:
        raise ValueError(f"update from site {update.site!r} has no meta[{key!r}]: the client must send its "
                         "label_summary (fedlabels.profile) as metadata")
    v = np.asarray(update.meta[key], dtype=np.float64)
    if v.shape != (size,):
        raise ValueError(f"site {update.site!r}: meta[{key!r}] has shape {v.shape}, the head has {size} classes")
    return v


def classwise_head_mean(updates: list, global_weights: dict, head_name: str, class_weights: list) -> dict:
    """Head rows averaged class by class.

    ``class_weights[k][c]`` is site k's weight for class c (0 = the site does
    not count for c). Row c of the head weight and entry c of its bias become
    sum_k w_kc row_kc / sum_k w_kc; where every weight of c is 0 the previous
    global row is kept. Returns the new head arrays only.
    """
    keys = head_param_keys(head_name, global_weights)
    if not keys:
        raise KeyError(f"no head keys '{head_name}.weight' / '{head_name}.bias' in the global weights")
    w = np.stack([np.asarray(cw, dtype=np.float64) for cw in class_weights])  # K x C
    if np.any(w < 0):
        raise ValueError("class weights must be non-negative")
    total = w.sum(0)  # C
    out = {}
    for key in keys:
        old = np.asarray(global_weights[key])
        if old.shape[0] != w.shape[1]:
            raise ValueError(f"{key} has {old.shape[0]} rows but the label summaries have {w.shape[1]} classes")
        for u in updates:
            if key not in u.weights:
                raise ValueError(f"site {u.site!r} did not send {key}")
        rows = np.stack([np.asarray(u.weights[key], dtype=np.float64) for u in updates])  # K x C [x N]
        wk = w.reshape(w.shape + (1,) * (rows.ndim - 2))
        num = (wk * rows).sum(0)
        have = total > 0
        new = old.astype(np.float64).copy()
        new[have] = num[have] / total[have].reshape((-1,) + (1,) * (rows.ndim - 2))
        out[key] = new.astype(old.dtype)
    return out


class HeadMetaMixin:
    """Client mixin: add the head's module name to the update's metadata."""

    def make_update(self, n, metrics):
        update = super().make_update(n, metrics)
        update.meta["head_name"] = self.net.head_name
        return update


def _optimizer(name: str, params, lr: float, weight_decay: float):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


# ------------------------------------------------------------ client

class SurgicalClient(HeadMetaMixin, ClientRule):
    """Plain partial BCE; a one-time head warm-up with the backbone frozen.

    ``feature_rule`` is the paper's name for the base ``bn_policy`` (None: use
    ``bn_policy``, default "fedavg"); giving both with different values fails.
    """

    def __init__(self, *args, feature_rule=None, warmup_epochs=15, warmup_lr=5e-3, **kw):
        if feature_rule is not None:
            if feature_rule not in BN_POLICIES:
                raise ValueError(f"feature_rule {feature_rule!r} is not one of {BN_POLICIES}")
            if kw.get("bn_policy", feature_rule) != feature_rule:
                raise ValueError(f"feature_rule={feature_rule!r} contradicts bn_policy={kw['bn_policy']!r}")
            kw["bn_policy"] = feature_rule
        super().__init__(*args, **kw)
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
        opt = _optimizer(self.optimizer_name, head.parameters(), self.warmup_lr, self.weight_decay)
        losses = []
        for _ in range(self.warmup_epochs):
            for batch in self.loader:
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


# ------------------------------------------------------------ server

class SurgicalServer(ServerRule):
    """Features by ``feature_rule`` (mean unweighted unless ``weighted``); head by Eq. 2/3."""

    def __init__(self, weighted=False, feature_rule=None, head_name=None, **options):
        super().__init__(**options)
        if feature_rule is not None and feature_rule not in BN_POLICIES:
            raise ValueError(f"feature_rule {feature_rule!r} is not one of {BN_POLICIES}")
        self.weighted, self.feature_rule, self.head_name = weighted, feature_rule, head_name

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

    def feature_weights(self, updates) -> list:
        return [u.n if self.weighted else 1.0 for u in updates]

    def head_weights(self, updates, c) -> list:
        """Per site, a weight per class row (Eq. 2: 1 where the site annotates the class)."""
        return [meta_vector(u, "labeled_mask", c) > 0 for u in updates]


def _register():
    from . import Method, register

    register(Method("surgical", SurgicalClient, SurgicalServer, ("multilabel",), {},
                    doc="Surgical Aggregation: class-wise head mean over the sites that annotate each class"))


_register()
