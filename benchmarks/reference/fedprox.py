"""FedProx as FedPSL's paper adapts it to partial labels (Dong et al., ../shared/papers/000_*, Sec. VII-C, after
Li et al.'s FedProx), in plain PyTorch: no fedlabels, no MONAI.

* **Local loss**: FedPSL's FedAVG baseline ("we only update the weights given the partial labels"): the BCE over
  the labeled entries, averaged over them, each class's positives weighted by N_neg / N_pos over the site's cases
  labeled for it (Sec. VII-D3, for every method), plus (mu / 2) ||w - w_global||^2 over the parameters, w_global
  the model the site received ("the same setup of FedAVG and use 0.001 for the proximal term").
* **Server**: every tensor averaged by case counts (``fedavg.run``).

Training settings (``PAPER``): FedPSL's for all methods (Sec. VII-D3), the same as its reference's
(``fedpsl.PAPER``, whose stated choices are marked there).
"""

from __future__ import annotations

from . import fedavg_multilabel, fedpsl

# (value, source)
PAPER = {**{key: fedpsl.PAPER[key] for key in ("lr", "epochs", "rounds", "batch_size", "carry_optimizer")},
         "mu": (0.001, "paper Sec. VII-C: 'use 0.001 for the proximal term'"),
         "pos_weight": ("neg_over_pos", "paper Sec. VII-D3: the BCE of each class weighted by N_neg / N_pos")}
# What both sides train with in benchmarks/reference_check.py --rows fedprox; the network, the input and the
# augmentation are the check's preset's.
CHECK = {key: value for key, (value, _) in PAPER.items() if key != "rounds"}
LEFT_OUT = {**{key: fedpsl.LEFT_OUT[key] for key in ("network", "input", "rounds")}, **fedavg_multilabel.UNANNOTATED,
            "shared_weights": "the paper aggregates 'only the shared weights' without naming them; both sides "
                              "average every tensor, as its FedAVG baseline's FedAvg [13] does"}


def run(data, rounds: int, eval_rounds, seed: int = 0, lr: float = 1e-3, epochs: int = 10, batch_size: int = 16,
        carry_optimizer: bool = False, mu: float = 0.001, pos_weight: str = "neg_over_pos", widen: float = 0.25,
        scaling: str = "fixed", grey: str = "mean", log=print) -> dict:
    """FedProx over a prepared partial-label scenario (label -1: not labeled): FedAvg-PL's rounds
    (``partial_fedavg.run``, no weight decay) with the proximal term. Test metric: the mean one-vs-rest AUROC of
    the global model on the pooled test split."""
    from . import partial_fedavg

    return partial_fedavg.run(data, rounds, eval_rounds, seed=seed, partial=True, lr=lr, batch_size=batch_size,
                              weight_decay=0.0, carry_optimizer=carry_optimizer, epochs=epochs,
                              pos_weight=pos_weight, widen=widen, scaling=scaling, grey=grey, log=log, mu=mu)
