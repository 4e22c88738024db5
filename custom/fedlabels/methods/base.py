"""The declared method lifecycle: a client rule, a server rule, and what they exchange.

Pure PyTorch/NumPy -- nothing here knows about FLARE. The round engine
(``fedlabels.engine``) runs the lifecycle; the nvflare controller and the
in-process loop only move ``Update`` objects and weights::

    server.setup(summaries)                      # before round 0: every site's label summary
    for round:
        for step in server.plan(round, sites):   # ordered steps (``Step``)
            updates = send(step.sites, start weights, server.extras(round, step))
            weights = server.aggregate(updates, weights, round)   # abstentions and faults left out
    client.train(weights, round, extras) -> Update(weights, n, meta, metrics, extras)
    client.state_dict() / server.state_dict()   # saved every round: resume is exact

Weights travel as ``dict[str, np.ndarray]`` (a state dict), as FLARE sends
them. Batch-norm policy (docs/methods/baselines.md):

* ``fedavg`` -- BN affine parameters and running statistics are averaged;
* ``fedbn``  -- a site trains with its own BN: after its first round it never
  loads the global BN keys, and it never sends them;
* ``fedbn+`` -- frozen in inference mode at the initial (pretrained,
  ``init_ckpt``) statistics; never sent, never aggregated.

The keys a site keeps (``local_keys``: its batch norm under fedbn / fedbn+)
are declared here and withheld by the transport, not by the client rule,
whose update is always its whole state dict: in FLARE by nvflare's
``ExcludeVars`` result filter at the site (``fedlabels.flare.job``), so they
leave in no task's result; in-process by ``fedlabels.references.site_round``.
The server keeps its own value of a key no update sent
(``aggregate.average_keys``), so a FedBN global model carries the initial
batch norm; a site's deployable model is the global weights with its own
batch norm from its state file (``personal_model``).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ..losses import pos_weight_from_counts
from ..nets import batchnorm_keys, freeze_batchnorm
from ..profile import SiteProfile

BN_POLICIES = ("fedavg", "fedbn", "fedbn+")

# Metadata keys of an update (what a site sends besides weights). The label
# summary's own keys (profile.label_summary) travel in the same dict.
N = "n"                        # cases trained on this step: the FedAvg weight n_k
ABSTAIN = "abstain"            # True: the site sits this step out (weight 0; not a fault)
HEAD_NAME = "head_name"        # module name of the classifier head
LABELED_MASK = "labeled_mask"  # per class: 1 where the site annotates it
ANNOTATED = "annotated"        # per class: n_k^c, training cases annotated for it
SITE = "site"
# Keys of what the server sends besides weights.
EXTRAS = "extras"              # the server rule's extras for this step
PHASE = "phase"                # "train" (default) or "summary" (the set-up handshake)
RESUME = "resume"              # the sites on their first task of a resumed run: each loads its state before that round
REASON = "reason"              # why a site stopped its round (sent with ABSTAIN; the engine drops it, logged)
DRAW = "draw"                  # extras: the group's index within a step with parallel groups (RSCFed)

START_GLOBAL, START_PREVIOUS = "global", "previous"


def site_seed(seed: int, site: str) -> int:
    """One site's seed: the run's seed and the site's name (the same in FLARE and in-process)."""
    return seed + zlib.crc32(site.encode()) % 1000


@dataclass(frozen=True)
class Step:
    """One step of a round's plan.

    ``sites`` train starting from ``start``: the model the round started with
    (``START_GLOBAL``) or the previous step's result (``START_PREVIOUS``).
    With ``groups`` (subsets of ``sites``, possibly overlapping), each group
    is aggregated on its own from the same start and the server rule's
    ``combine`` merges the group results (RSCFed's parallel subsets).
    """

    sites: tuple
    start: str = START_GLOBAL
    groups: tuple = ()
    name: str = "train"

    def __post_init__(self):
        if self.start not in (START_GLOBAL, START_PREVIOUS):
            raise ValueError(f"step {self.name!r}: start must be {START_GLOBAL!r} or {START_PREVIOUS!r}, not {self.start!r}")
        outside = {s for g in self.groups for s in g} - set(self.sites)
        if outside:
            raise ValueError(f"step {self.name!r}: groups name sites outside the step: {sorted(outside)}")


@dataclass
class Update:
    """What a site sends after a step."""

    site: str
    weights: dict
    n: int
    meta: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    abstain: bool = False
    reason: str = ""  # with abstain: the site stopped its round for this reason (a fault, not a choice)


class StopRound(RuntimeError):
    """Raised inside local training to stop this site's round (e.g. a non-finite
    model output): the site sends no weights, only the reason."""


@dataclass
class SiteContext:
    """What a client rule sees of its site.

    ``train`` yields batches with ``image``, ``label``, ``index`` (each case's
    position among the site's training cases) (and ``image_strong``,
    a second, strongly augmented view of the same cases, when the bundle
    defines ``train#strong_preprocessing``); ``val`` is the site's validation
    loader (may be None); ``summary`` is ``profile.label_summary`` of the
    training cases; ``seed`` is the site's seed (``site_seed``); ``items`` are
    the site's validated training items as the scenario gives them
    (supervision level, boxes, image-level classes: what a method needs beyond
    the loader's image and label).
    """

    profile: SiteProfile
    train: object
    summary: dict
    val: object = None
    seed: int = 0
    device: str = "cpu"
    items: list = field(default_factory=list)

    def reseed(self, round: int, draw: int = 0) -> None:
        """Seed everything random in a round from (site seed, round, draw): shuffling,
        augmentation, dropout. A resumed run therefore draws what an
        uninterrupted one would, with no random state to save. ``draw`` tells
        apart a site's several trainings in one round (RSCFed's subsets)."""
        s = (self.seed * 1_000_003 + round + 7_919 * draw) % (2**31)
        torch.manual_seed(s)
        gen = getattr(self.train, "generator", None)
        if gen is not None:
            gen.manual_seed(s)
        dataset = getattr(self.train, "dataset", None)
        target = dataset if hasattr(dataset, "set_random_state") else getattr(dataset, "transform", None)
        if hasattr(target, "set_random_state"):
            target.set_random_state(seed=s)
        collate = getattr(self.train, "collate_fn", None)  # batch augmentation (fedlabels.bundle.augment)
        if hasattr(collate, "set_random_state"):
            collate.set_random_state(seed=s)


def to_numpy(state: dict) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def local_keys(net: torch.nn.Module, bn_policy: str) -> list:
    """The state-dict keys a site under ``bn_policy`` keeps to itself and never sends: its batch norm
    under fedbn / fedbn+, nothing under fedavg."""
    if bn_policy not in BN_POLICIES:
        raise ValueError(f"bn_policy {bn_policy!r} is not one of {BN_POLICIES}")
    return batchnorm_keys(net) if bn_policy in ("fedbn", "fedbn+") else []


def load_state_file(path):
    """A site state file (``site.save_state``) loaded with ``weights_only=True``: such a file may come
    from another machine, and unpickling it in full would run whatever code it names. Besides tensors
    and plain containers, a client rule's state may hold NumPy arrays (FedMLP's tags): only NumPy's
    array reconstruction and dtypes are allowed on top."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = [type(np.dtype(t)) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "float16",
                                           "float32", "float64")]
    with torch.serialization.safe_globals([_reconstruct, scalar, np.ndarray, np.dtype, *dtypes]):
        return torch.load(path, map_location="cpu", weights_only=True)


def personal_model(global_weights: dict, state_file) -> dict:
    """A site's deployable FedBN model: ``global_weights`` with the site's own batch norm from its state file.

    ``global_weights``: a global model's state dict (arrays or tensors; FedBN's carries the initial batch
    norm, which no site trains with). ``state_file``: one of the site's state files,
    ``fedlabels_state/<run>/<site>/round-NNNNN.pt`` (``fedlabels.site.save_state``). Returns a new state
    dict of tensors; raises ValueError naming the file when it holds no batch norm or batch norm that
    does not fit the global model."""
    import pickle
    from pathlib import Path

    path = Path(state_file)
    try:
        saved = load_state_file(path)
        bn = saved["state"]["bn"]
    except (OSError, EOFError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not a site state file (fedlabels_state/<run>/<site>/round-NNNNN.pt): {e!r}") from None
    if not bn:
        raise ValueError(f"{path}: field 'state.bn': no batch-norm keys; the site kept none (it ran with "
                         "bn_policy 'fedavg', or the network has no batch norm): use the global model as it is")
    unknown = sorted(set(bn) - set(global_weights))
    if unknown:
        raise ValueError(f"{path}: field 'state.bn': keys {unknown[:3]} are not in the global model (another network?)")
    out = {k: torch.as_tensor(np.asarray(v)) for k, v in global_weights.items()}
    for k, v in bn.items():
        if tuple(v.shape) != tuple(out[k].shape):
            raise ValueError(f"{path}: field 'state.bn': {k} has shape {tuple(v.shape)}, the global model "
                             f"{tuple(out[k].shape)} (another network?)")
        out[k] = v.detach().clone().to(out[k].dtype)
    return out


def load_weights(net: torch.nn.Module, weights: dict, skip=()) -> None:
    """Copy received arrays into ``net`` in place, leaving keys in ``skip`` untouched."""
    own = net.state_dict()
    with torch.no_grad():
        for k, v in weights.items():
            if k in own and k not in skip:
                own[k].copy_(torch.as_tensor(np.asarray(v)).to(own[k].dtype))


def frozen_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A teacher: a copy of ``net`` in inference mode whose parameters take no gradient."""
    teacher = copy.deepcopy(net).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student: torch.nn.Module, alpha: float) -> None:
    """Mean teacher: parameters move by alpha towards the student's; buffers (if any) follow the student."""
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(1 - alpha).add_(s.detach(), alpha=alpha)
    for t, s in zip(teacher.buffers(), student.buffers()):
        t.copy_(s)


def make_optimizer(name: str, params, lr: float, weight_decay: float = 0.0, momentum: float = 0.9,
                   clip_grad_norm: float | None = None):
    """The one optimizer factory: ``params`` is a list of tensors or of parameter groups.

    ``momentum``: SGD's (Adam has its own betas and ignores it). ``clip_grad_norm``: before every
    step the gradients of the optimizer's parameters are rescaled so their joint L2 norm is at most
    this value (``torch.nn.utils.clip_grad_norm_``, RSCFed's ``--max_grad_norm``); None or 0: off.
    The clip lives on the optimizer (a step pre-hook), so every rule that steps it clips, whatever
    its own training step looks like."""
    if name == "adam":
        opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r}; use 'adam' or 'sgd'")
    if clip_grad_norm:
        max_norm = float(clip_grad_norm)

        def clip(optimizer, args, kwargs):
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_norm)

        opt.register_step_pre_hook(clip)
    return opt


class ClientRule:
    """Local training at one site.

    The generic loop: receive global weights, train ``epochs`` passes over the
    site's training loader with ``loss()``, return the whole state dict (the
    transport withholds ``local_keys``, the batch norm the BN policy keeps at
    the site). Methods override ``loss``,
    ``train_step`` or ``train``; ``train_step`` may return None for a batch it
    skips (not counted in n). The update's n is the site's case count, the cases
    trained on per local epoch (not times the epochs): the papers' n_k, which
    IsoFed's Eq. 3 puts in an exponent where a common factor would not cancel. ``pos_weighted`` (multi-label only; default on)
    weights each class's positives by N_neg / N_pos over the site's cases
    annotated for it (``losses.pos_weight_from_counts``), the same rule for
    every method. ``momentum`` (SGD only; default 0.9) and ``clip_grad_norm`` (None: off) reach
    every optimizer the rule makes (``make_optimizer``). ``reset_optimizer`` False (default) keeps
    the optimizer, and so SGD's momentum buffers or Adam's moments, from one round to the next
    (RSCFed's released code carries each client's optimizer state this way); True makes a fresh
    one every round.
    """

    def __init__(self, net, ctx: SiteContext, *, lr=1e-3, epochs=1, weight_decay=0.0, optimizer="adam",
                 bn_policy="fedavg", pos_weighted=None, reset_optimizer=False, momentum=0.9, clip_grad_norm=None):
        if bn_policy not in BN_POLICIES:
            raise ValueError(f"bn_policy {bn_policy!r} is not one of {BN_POLICIES}")
        if bn_policy == "fedbn+" and batchnorm_keys(net) and not getattr(net, "init_ckpt", None):
            raise ValueError("bn_policy 'fedbn+' freezes batch norm at its initial statistics, and without a "
                             "pretrained checkpoint those are the identity (mean 0, variance 1): the network would "
                             "train with no normalisation. Give the network a pretrained init_ckpt "
                             "(network option), or use 'fedbn'")
        task = ctx.profile.task
        if pos_weighted and task != "multilabel":
            raise ValueError(f"pos_weighted applies to multi-label tasks; this site's task is {task!r}")
        self.net, self.ctx = net.to(ctx.device), ctx
        self.profile, self.device = ctx.profile, ctx.device
        self.lr, self.epochs, self.weight_decay, self.optimizer_name = float(lr), int(epochs), float(weight_decay), optimizer
        self.bn_policy, self.reset_optimizer = bn_policy, bool(reset_optimizer)
        if not 0 <= float(momentum) < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_grad_norm is not None and not float(clip_grad_norm) >= 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0 or None: off), got {clip_grad_norm}")
        self.momentum = float(momentum)
        self.clip_grad_norm = float(clip_grad_norm) if clip_grad_norm else None
        self.current_round, self.local_epoch = 0, 0  # where local training is (rules with schedules read them)
        self.pos_weighted = task == "multilabel" if pos_weighted is None else bool(pos_weighted)
        self.pos_weight = None
        if self.pos_weighted:
            w = pos_weight_from_counts(ctx.summary[ANNOTATED], ctx.summary["positives"])
            self.pos_weight = torch.as_tensor(w, dtype=torch.float32, device=self.device)
        # The site's own batch norm (fedbn: trained locally; fedbn+: frozen): kept in its state,
        # never sent -- the transport withholds these keys (module docstring).
        self.local_keys = set(local_keys(net, bn_policy))
        self.optimizer = None
        self.received = False

    # ---------------------------------------------------------------- hooks
    def make_optimizer(self, params, lr=None):
        """An optimizer of this rule's kind over the trainable ``params`` (at ``lr``, default the rule's)."""
        return make_optimizer(self.optimizer_name, [p for p in params if p.requires_grad],
                              self.lr if lr is None else lr, self.weight_decay, self.momentum, self.clip_grad_norm)

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

    def abstains(self, round: int, extras: dict) -> bool:
        """True: sit this step out. By default a site with nothing to train on
        (e.g. no labeled case for a supervised method) abstains."""
        return len(getattr(self.ctx.train, "dataset", self.ctx.train)) == 0

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """What the site keeps between rounds, for an exact resume."""
        return {"received": self.received,
                "optimizer": None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
                "bn": {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items() if k in self.local_keys}}

    def load_state_dict(self, state: dict) -> None:
        self.received = bool(state["received"])
        load_weights(self.net, state["bn"])
        if state["optimizer"] is not None:
            self.set_train_mode()  # fedbn+: batch norm frozen first, as in train(), so the groups match
            self.optimizer = self.make_optimizer(self.net.parameters())
            self.optimizer.load_state_dict(state["optimizer"])

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
        extras = extras or {}
        self.receive(global_weights)
        if self.abstains(round, extras):
            return Update(self.profile.site, {}, 0, dict(self.ctx.summary), {}, abstain=True)
        self.ctx.reseed(round, int(extras.get(DRAW, 0)))
        self.set_train_mode()
        try:
            self.begin_round(round, extras)
            if self.optimizer is None or self.reset_optimizer:
                self.optimizer = self.make_optimizer(self.net.parameters())
            losses, n = [], 0
            self.current_round = round
            for e in range(self.epochs):
                self.local_epoch = e
                for batch in self.ctx.train:
                    loss = self.train_step(batch)
                    if loss is None:  # the rule skipped this batch (e.g. too small to split)
                        continue
                    losses.append(loss)
                    n += len(batch["image"])
        except StopRound as e:
            return Update(self.profile.site, {}, 0, dict(self.ctx.summary), {}, abstain=True, reason=str(e))
        # n_k: the cases of one local epoch (the papers' n_k; Eq. 3 of IsoFed puts it in an exponent)
        return self.make_update(int(np.rint(n / max(self.epochs, 1))),
                                {"train_loss": float(np.mean(losses)) if losses else float("nan")})

    def make_update(self, n, metrics) -> Update:
        return Update(self.profile.site, to_numpy(self.net.state_dict()), n, dict(self.ctx.summary), metrics)


class ServerRule:
    """Aggregation on the server. ``aggregate`` returns the new global weights.

    Hooks with defaults: ``setup`` (the sites' label summaries, before round
    0), ``plan`` (one step: every site from the global model), ``extras``
    (nothing), ``combine`` (parallel groups: unweighted mean), and
    ``state_dict`` / ``load_state_dict`` (no state). ``sites_needed``: the
    fewest sites the rule can run on with its options (a job with fewer is
    refused before it is submitted).
    """

    sites_needed = 1

    def setup(self, summaries: dict) -> list:
        """Every site's label summary (``profile.label_summary``), keyed by site, before round 0.

        Raises ValueError when the method cannot run on these sites; returns
        lines worth telling the user once (may be empty)."""
        self.summaries = dict(summaries)
        return []

    def plan(self, round: int, sites: list) -> list:
        return [Step(tuple(sites))]

    def extras(self, round: int, step: Step) -> dict:
        """Anything besides weights to broadcast to the step's sites (arrays, numbers, strings)."""
        return {}

    def extra_shapes(self, round: int, step: Step) -> dict:
        """Shapes the sites' ``Update.extras`` must have (name -> shape); others are only checked finite."""
        return {}

    def screen(self, update: Update, global_weights: dict, round: int, step: Step) -> str | None:
        """Why this rule cannot use ``update`` (what it reads from the site's meta, metrics or extras
        is missing or malformed), or None. Called on each update that passed the engine's own
        screen (``fedlabels.engine.screen_update``), before ``aggregate``: a dropped update is
        logged with this reason and the others are aggregated, where an error raised inside
        ``aggregate`` would lose the whole step."""
        return None

    def aggregate(self, updates: list, global_weights: dict, round: int) -> dict:
        raise NotImplementedError

    def take_notes(self) -> list:
        """Lines worth logging about the last aggregation (e.g. what a rule dropped from an update), then forgotten."""
        return []

    def combine(self, results: list, start_weights: dict, round: int, step: Step) -> dict:
        from .aggregate import average_keys

        return average_keys([Update("", r, 1) for r in results], start_weights, [1.0] * len(results))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
