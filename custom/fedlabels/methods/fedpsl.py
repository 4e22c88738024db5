"""FedPSL (Dong et al.; docs/methods/fedpsl.md): TDMA aggregation + TADL local training.

The model is ``g_phi ∘ f_theta``: phi = the head (``net.head_name``, the last
``nn.Linear``), theta = every other trainable parameter.

TDMA -- task-dependent model aggregation (Eq. 9), ``TDMAServer``
    * features (every key but the head's): mean weighted by n_k. n_k is
      ``Update.n``, the cases of one local epoch the site trained on, exactly as in
      ``FedAvgServer``, so "fedpsl_tadl" and "fedpsl" differ only in the head;
    * head row c (weight row + bias entry): mean weighted by n_k^c, the site's
      training cases annotated for c (``Update.meta["annotated"]``, masked by
      ``meta["labeled_mask"]``): zero weight for sites that do not annotate c;
      a class no participating site annotates keeps its previous global row.
    Batch-norm keys a site keeps (``bn_policy`` fedbn / fedbn+) are not sent
    and keep their global value, as everywhere.

TADL -- task-agnostic decoupling learning (Algorithm 1), ``FedPSLClient(tadl=True)``
    Each mini-batch is split in half: B_train = the first ceil(B/2) cases,
    B_val = the rest (a batch of one case is skipped, and a batch of two or three where batch norm
    trains on each half: it cannot normalise a half of one case). Per batch:

    1. L_t = L_Btrain(g_phi ∘ f_theta); g_theta, g_phi = grad of L_t
       (``create_graph`` unless ``first_order``);
    2. theta' = theta - alpha_in * g_theta: a plain, differentiable SGD step,
       alpha_in = ``inner_lr`` (default: ``lr``, the paper's alpha);
    3. phi <- optimizer step with gradient g_phi at learning rate ``lr`` (alpha);
    4. L_v = L_Bval(g_phi ∘ f_theta'), phi = the *updated* head held constant
       (Algorithm 1 line 9; Eq. 11 differentiates theta only through theta');
       theta <- optimizer step with gradient dL_v/dtheta at learning rate
       ``meta_lr`` (beta, default ``lr``).
       ``first_order=True`` drops the second-order term: dL_v/dtheta is then
       the gradient at theta' (first-order MAML).

    How the paper's "Adam, alpha = beta = 1e-3" maps: one optimizer of the
    client's family (``optimizer``, Adam by default) with two parameter
    groups, phi at ``lr`` and theta at ``meta_lr``; step 3 steps phi alone and
    step 4 theta alone (parameters without a gradient are skipped), so this is
    one Adam for phi driven by the B_train gradient and one for theta driven
    by the meta gradient, each with its own moments. The inner step 2 is not
    an optimizer step: it is the SGD step of Eq. 11. Optimizer state persists
    across rounds unless ``reset_optimizer``, like the other clients. Note a
    plain SGD step of 1e-3 moves theta far less than an Adam step of 1e-3;
    ``inner_lr`` tunes it separately.

    Batch norm under ``torch.func.functional_call``: both forwards run with the
    module's own buffers in its current mode. In train mode each forward
    normalises with its half batch's statistics and updates the running
    statistics in place (no autograd through them), so every case feeds them
    once per epoch, as in ordinary training with half-size batches
    (``num_batches_tracked`` advances by 2 per batch). FedBN+ batch norm is
    in eval mode and frozen (no ``requires_grad``): it is neither in theta nor
    updated.

Loss: BCE over the annotated entries only (``partial_bce``), each class's
positives weighted by N_neg / N_pos over the site's training cases annotated
for it (``pos_weighted``, the shared default of every multi-label method,
``losses.pos_weight_from_counts``).

Registered: "fedpsl" (TDMA + TADL), "fedpsl_tdma" (TDMA + the plain
pos-weighted partial BCE client), "fedpsl_tadl" (n_k-weighted FedAvg of every
key + TADL): the paper's ablation rows. Paper setup (job configuration):
DenseNet121, randomly initialised, instance normalisation per image, Adam
alpha = beta = 1e-3, aggregation every E = 10 local epochs.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from ..losses import partial_bce
from .aggregate import meta_vector
from .base import ANNOTATED, LABELED_MASK, ClientRule, make_optimizer
from .fedavg import FedAvgServer
from .surgical import HeadMetaMixin, SurgicalServer


class FedPSLClient(HeadMetaMixin, ClientRule):
    """TADL (``tadl=True``) or plain joint training (``tadl=False``) with the
    pos-weighted partial BCE."""

    def __init__(self, net, ctx, *, tadl=True, first_order=False, meta_lr=None, inner_lr=None, **kw):
        super().__init__(net, ctx, **kw)
        self.tadl, self.first_order = bool(tadl), bool(first_order)
        self.meta_lr = self.lr if meta_lr is None else float(meta_lr)
        self.inner_lr = self.lr if inner_lr is None else float(inner_lr)

    def loss(self, logits, labels):
        if self.profile.task != "multilabel":
            raise ValueError(f"FedPSL is for multi-label tasks, not {self.profile.task!r}")
        return partial_bce(logits, labels, pos_weight=self.pos_weight)

    # ---------------------------------------------------------------- TADL
    def split_parameters(self):
        """(theta, phi): trainable parameters of the features and of the head, by name."""
        prefix = self.net.head_name + "."
        theta, phi = {}, {}
        for name, p in self.net.named_parameters():
            if p.requires_grad:
                (phi if name.startswith(prefix) else theta)[name] = p
        if not phi:
            raise ValueError(f"no trainable head parameters under {self.net.head_name!r}")
        return theta, phi

    def make_optimizer(self, params):
        if not self.tadl:
            return super().make_optimizer(params)
        theta, phi = self.split_parameters()
        groups = [{"params": list(phi.values()), "lr": self.lr}, {"params": list(theta.values()), "lr": self.meta_lr}]
        return make_optimizer(self.optimizer_name, groups, self.lr, self.weight_decay, self.momentum, self.clip_grad_norm)

    def train_step(self, batch):
        if not self.tadl:
            return super().train_step(batch)
        x, y = batch["image"].to(self.device), batch["label"].to(self.device)
        if x.shape[0] < self.smallest_batch():
            return None  # no half to spare for B_val (with batch norm training: no half of one case)
        h = (x.shape[0] + 1) // 2
        return self.tadl_step(x[:h], y[:h], x[h:], y[h:])

    def smallest_batch(self) -> int:
        """2 cases (one a half); 4 where batch norm trains on each half, which cannot normalise a single case."""
        bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in self.net.modules())
        return 4 if bn else 2

    def tadl_step(self, x_train, y_train, x_val, y_val) -> float:
        net, opt = self.net, self.optimizer
        theta, phi = self.split_parameters()
        t_names, p_names = list(theta), list(phi)
        # A private copy of phi for the B_train forward: the graph kept for the
        # second-order term must not see phi's in-place optimizer update.
        phi_t = {n: phi[n].detach().clone().requires_grad_(True) for n in p_names}
        loss_t = self.loss(functional_call(net, {**theta, **phi_t}, (x_train,)), y_train)
        grads = torch.autograd.grad(loss_t, [theta[n] for n in t_names] + [phi_t[n] for n in p_names],
                                    create_graph=not self.first_order, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g
                 for g, p in zip(grads, [theta[n] for n in t_names] + [phi[n] for n in p_names])]
        g_theta, g_phi = grads[:len(t_names)], grads[len(t_names):]

        # theta' = theta - alpha * grad (differentiable in theta unless first order)
        theta_prime = {n: theta[n] - self.inner_lr * g for n, g in zip(t_names, g_theta)}

        # phi <- phi - alpha * grad_phi L_Btrain (optimizer step, phi only)
        opt.zero_grad(set_to_none=True)
        for n, g in zip(p_names, g_phi):
            phi[n].grad = g.detach()
        opt.step()

        # theta <- theta - beta * grad_theta L_Bval(g_phi ∘ f_theta')
        phi_new = {n: phi[n].detach() for n in p_names}
        loss_v = self.loss(functional_call(net, {**theta_prime, **phi_new}, (x_val,)), y_val)
        opt.zero_grad(set_to_none=True)
        if t_names:
            meta = torch.autograd.grad(loss_v, [theta[n] for n in t_names], allow_unused=True)
            for n, g in zip(t_names, meta):
                theta[n].grad = torch.zeros_like(theta[n]) if g is None else g
            opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss_t.detach())


class TDMAServer(SurgicalServer):
    """Eq. 9: features by n_k, head row c by n_k^c (the Surgical server with other weights)."""

    def __init__(self, head_name=None):
        super().__init__(weighted=True, head_name=head_name)

    def head_weights(self, updates, c):
        weights = []
        for u in updates:
            n_kc = meta_vector(u, ANNOTATED, c)
            if LABELED_MASK in u.meta:
                n_kc = n_kc * (meta_vector(u, LABELED_MASK, c) > 0)
            weights.append(n_kc)
        return weights


def _register():
    from . import Method, register

    task = ("multilabel",)
    register(Method("fedpsl", FedPSLClient, TDMAServer, task, {"tadl": True},
                    doc="FedPSL: TDMA aggregation + TADL meta-learned features"))
    register(Method("fedpsl_tdma", FedPSLClient, TDMAServer, task, {"tadl": False},
                    doc="FedPSL ablation 'w/ TDMA': class-wise head by n_k^c, plain local training"))
    register(Method("fedpsl_tadl", FedPSLClient, FedAvgServer, task, {"tadl": True}, {"weighted": True},
                    doc="FedPSL ablation 'w/ TADL': FedAvg by n_k, TADL local training"))


_register()
