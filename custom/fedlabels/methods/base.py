"""The shape every method takes: a client rule and a server rule.

Pure PyTorch/NumPy -- nothing here knows about FLARE. The FLARE glue
(``fedlabels.flare``) moves ``Update`` objects and global weights between
sites and server and calls these rules; a unit test calls them directly.

Weights travel as ``dict[str, np.ndarray]`` (a state dict), as FLARE sends
them. Batch-norm policy (METHODS.md):

* ``fedavg`` -- BN affine parameters and running statistics are averaged;
* ``fedbn``  -- they never leave the site (not sent, not overwritten);
* ``fedbn+`` -- frozen in inference mode at their initial statistics and not
  aggregated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..nets import batchnorm_keys, freeze_batchnorm
from ..profile import SiteProfile

BN_POLICIES = ("fedavg", "fedbn", "fedbn+")


@dataclass
class Update:
    """What a site sends after local training."""

    site: str
    weights: dict
    n: int
    meta: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


def to_numpy(state: dict) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def load_weights(net: torch.nn.Module, weights: dict, skip=()) -> None:
    """Copy received arrays into ``net`` in place, leaving keys in ``skip`` untouched."""
    own = net.state_dict()
    with torch.no_grad():
        for k, v in weights.items():
            if k in own and k not in skip:
                own[k].copy_(torch.as_tensor(np.asarray(v)).to(own[k].dtype))


def weighted_mean(arrays: list, weights) -> np.ndarray:
    """sum_k w_k a_k / sum_k w_k, in float64, cast back to the first array's dtype."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("weights sum to zero")
    out = sum(wi * np.asarray(a, dtype=np.float64) for wi, a in zip(w, arrays)) / w.sum()
    return out.astype(np.asarray(arrays[0]).dtype)


def average_keys(updates: list, global_weights: dict, weights) -> dict:
    """Weighted mean of every key; a key no update sent keeps its global value.

    Integer buffers (e.g. BN ``num_batches_tracked``) are averaged and rounded.
    """
    out = dict(global_weights)
    for key in global_weights:
        have = [(u.weights[key], w) for u, w in zip(updates, weights) if key in u.weights]
        if have:
            mean = weighted_mean([a for a, _ in have], [w for _, w in have])
            out[key] = np.round(mean).astype(mean.dtype) if np.issubdtype(mean.dtype, np.integer) else mean
    return out


class ClientRule:
    """Local training at one site.

    The generic loop: receive global weights, train ``epochs`` passes over the
    loader with ``loss()``, send the state dict minus the keys the BN policy
    keeps local. Methods override ``loss``, ``train_step`` or ``train``;
    ``train_step`` may return None for a batch it skips (not counted in n).
    """

    def __init__(self, net, profile: SiteProfile, loader, *, lr=1e-3, epochs=1, weight_decay=0.0,
                 optimizer="adam", bn_policy="fedavg", device="cpu", pos_weight=None, reset_optimizer=False,
                 summary=None, **options):
        if bn_policy not in BN_POLICIES:
            raise ValueError(f"bn_policy {bn_policy!r} is not one of {BN_POLICIES}")
        self.net, self.profile, self.loader = net.to(device), profile, loader
        self.lr, self.epochs, self.weight_decay, self.optimizer_name = lr, epochs, weight_decay, optimizer
        self.bn_policy, self.device, self.reset_optimizer = bn_policy, device, reset_optimizer
        self.pos_weight = None if pos_weight is None else torch.as_tensor(pos_weight, dtype=torch.float32, device=device)
        # label_summary() of the site's training cases: sent as metadata every round.
        self.summary = dict(summary or {})
        self.options = options
        self.local_keys = set(batchnorm_keys(net)) if bn_policy in ("fedbn", "fedbn+") else set()
        self.optimizer = None
        self.received = False

    # ---------------------------------------------------------------- hooks
    def make_optimizer(self, params):
        params = [p for p in params if p.requires_grad]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        raise ValueError(f"unknown optimizer {self.optimizer_name!r}")

    def loss(self, logits, labels) -> torch.Tensor:
        raise NotImplementedError

    def train_step(self, batch) -> float:
        x, y = batch["image"].to(self.device), batch["label"].to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.net(x), y)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def begin_round(self, round: int, extras: dict) -> None:
        """Called after the global model is loaded, before local training."""

    # ---------------------------------------------------------------- flow
    def set_train_mode(self):
        self.net.train()
        if self.bn_policy == "fedbn+":
            freeze_batchnorm(self.net)

    def receive(self, global_weights: dict) -> None:
        """Load the global model; FedBN keeps its own BN after the first round."""
        skip = self.local_keys if self.received and self.bn_policy == "fedbn" else set()
        load_weights(self.net, global_weights, skip)
        self.received = True

    def train(self, global_weights: dict, round: int, extras: dict | None = None) -> Update:
        self.receive(global_weights)
        self.set_train_mode()
        self.begin_round(round, extras or {})
        if self.optimizer is None or self.reset_optimizer:
            self.optimizer = self.make_optimizer(self.net.parameters())
        losses, n = [], 0
        for _ in range(self.epochs):
            for batch in self.loader:
                loss = self.train_step(batch)
                if loss is None:  # the rule skipped this batch (e.g. too small to split)
                    continue
                losses.append(loss)
                n += len(batch["image"])
        return self.make_update(n, {"train_loss": float(np.mean(losses)) if losses else float("nan")})

    def make_update(self, n, metrics) -> Update:
        weights = {k: v for k, v in to_numpy(self.net.state_dict()).items() if k not in self.local_keys}
        return Update(self.profile.site, weights, n, dict(self.summary), metrics)


class ServerRule:
    """Aggregation on the server. ``aggregate`` returns the new global weights."""

    def __init__(self, **options):
        self.options = options

    def aggregate(self, updates: list, global_weights: dict, round: int) -> dict:
        raise NotImplementedError

    def extras(self, round: int) -> dict:
        """Anything besides weights to broadcast with the next round's model."""
        return {}
