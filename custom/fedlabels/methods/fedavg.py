"""FedAvg and its partial-label baselines (docs/methods/baselines.md).

* ``fedavg``     -- naive: a missing label (-1) counts as a negative;
* ``fedavg_pl``  -- partial loss: BCE over annotated entries only;
* ``fedprox``    -- FedAvg-PL + (mu/2)||w - w_global||^2;
* ``fedbn`` / ``fedbn_plus`` -- FedAvg-PL with BN kept local / frozen.

All share one server rule: every key averaged by n_k (or unweighted), and
every multi-label row trains with the same ``pos_weighted`` loss default
(``ClientRule``), so the rows differ only in what their names say.
"""

from __future__ import annotations

from monai.losses import DiceLoss

from ..losses import masked_cross_entropy, naive_bce, partial_bce
from .aggregate import average_keys
from .base import ClientRule, ServerRule


class FedAvgClient(ClientRule):
    """``partial_loss`` False = naive (missing as negatives); ``mu`` > 0 = FedProx."""

    def __init__(self, net, ctx, *, partial_loss=True, mu=0.0, **kw):
        super().__init__(net, ctx, **kw)
        self.partial_loss, self.mu = bool(partial_loss), float(mu)
        self.anchor = None
        # Segmentation: the lesion bundle's own loss (MONAI soft Dice on sigmoid outputs).
        self.dice = DiceLoss(sigmoid=True)

    def loss(self, logits, labels):
        task = self.profile.task
        if task == "multilabel":
            fn = partial_bce if self.partial_loss else naive_bce
            loss = fn(logits, labels, pos_weight=self.pos_weight)
        elif task == "segmentation":
            loss = self.dice(logits, labels)
        elif task == "multiclass":
            loss = masked_cross_entropy(logits, labels)
        else:
            raise ValueError(f"FedAvg client has no loss for task {task!r}")
        if self.mu > 0:
            loss = loss + self.proximal_term()
        return loss

    def proximal_term(self):
        """(mu/2) * ||w - w_global||^2 over trainable parameters."""
        sq = sum(((p - a) ** 2).sum() for p, a in zip(self.net.parameters(), self.anchor) if p.requires_grad)
        return 0.5 * self.mu * sq

    def begin_round(self, round, extras):
        # The FedProx anchor: the global model as received (FedBN: with local BN).
        self.anchor = [p.detach().clone() for p in self.net.parameters()] if self.mu > 0 else None


class FedAvgServer(ServerRule):
    """Every key averaged by n_k (``weighted=True``) or unweighted."""

    def __init__(self, weighted=True):
        self.weighted = bool(weighted)

    def aggregate(self, updates, global_weights, round):
        weights = [u.n if self.weighted else 1.0 for u in updates]
        return average_keys(updates, global_weights, weights)


def _register():
    from . import AS_NEGATIVES, Method, register

    common = ("multilabel", "multiclass", "segmentation")
    register(Method("fedavg", FedAvgClient, FedAvgServer, common, {"partial_loss": False}, partial_site=AS_NEGATIVES,
                    doc="naive FedAvg: missing labels as negatives (segmentation: pixel-labeled cases)"))
    register(Method("fedavg_pl", FedAvgClient, FedAvgServer, ("multilabel", "multiclass"), {"partial_loss": True},
                    doc="FedAvg with the partial BCE loss"))
    register(Method("fedprox", FedAvgClient, FedAvgServer, common, {"partial_loss": True, "mu": 0.001},
                    doc="FedProx (mu=0.001 as in FedPSL) with the partial loss"))
    register(Method("fedbn", FedAvgClient, FedAvgServer, common, {"partial_loss": True, "bn_policy": "fedbn"},
                    doc="FedBN: a site trains with its own batch norm"))
    register(Method("fedbn_plus", FedAvgClient, FedAvgServer, common, {"partial_loss": True, "bn_policy": "fedbn+"},
                    doc="FedBN+: batch norm frozen at pretrained statistics (needs init_ckpt)"))


_register()
