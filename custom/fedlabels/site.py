"""One site: its training setup read from a MONAI bundle, and its task in a round.

The bundle supplies the network definition and the transforms (its
``network_def``, ``train#preprocessing``, ``validate#preprocessing``); the
scenario supplies the site's cases and label profile; the method supplies the
training step. Used by the FLARE client script and by the non-federated
references (local learning, centralized, oracle), so all of them see the same
data the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import contextlib
import copy
import dataclasses

import torch
from monai.data import CacheDataset, DataLoader, get_track_meta, set_track_meta

from .bundle import data as bundle_data
from .bundle.augment import BatchCollate
from .bundle import network, read
from .methods.base import SiteContext, Update, site_seed
from .metrics import multiclass_metrics, multilabel_metrics, segmentation_metrics
from .profile import Scenario, SiteData, label_summary, load_scenario, write_atomic


@dataclass
class SiteSetup:
    scenario: Scenario
    site: SiteData
    net: torch.nn.Module
    train_loader: DataLoader
    val_loader: DataLoader | None
    classes: tuple
    task: str
    seed: int = 0
    device: str = "cpu"
    oracle: bool = False  # the site trains on its full labels (oracle.json): an upper-bound run
    released: dict | None = None  # the noised label summary (release_summary), when the run asks for privacy

    @property
    def profile(self):
        """What the site labels in this run (oracle: every class, fully supervised)."""
        if not self.oracle:
            return self.site.profile
        return dataclasses.replace(self.site.profile, annotated=tuple(self.classes),
                                   supervision="pixel" if self.task == "segmentation" else "image")

    def items(self) -> list:
        return self.site.oracle()["training"] if self.oracle else list(self.site.training)

    def summary(self) -> dict:
        """The label summary of what the site trains on (what it tells the server).

        After ``release_summary`` it is the one noised release: the site's own
        method sees the same numbers as the server (positive weights, the
        labeled flag), so a client rule cannot send the exact counts by mistake
        and the server's plan (who is labeled) agrees with every site's."""
        if self.released is not None:
            return copy.deepcopy(self.released)
        return label_summary(self.profile, self.items()) if self.oracle else self.site.summary()

    def release_summary(self, options: dict, ledger=None, seed=None, note: str = "") -> tuple:
        """Noise the label summary once for this run (``fedlabels.privacy``); from now on
        ``summary()`` and ``context()`` give it. Returns its (epsilon, delta) report and
        whether the release was reused from the site's ``ledger``."""
        from . import privacy

        self.released, reused = privacy.release(self.profile, self.items(), privacy.options(options), ledger, seed,
                                                note=note)
        return self.released[privacy.REPORT], reused

    def context(self) -> SiteContext:
        return SiteContext(self.profile, self.train_loader, self.summary(), self.val_loader, self.seed,
                           self.device, self.items())


@contextlib.contextmanager
def plain_tensors():
    """MONAI transforms on plain tensors, not MetaTensors. The cached cases carry
    no metadata (the bundles' deterministic transforms end with
    ``EnsureTyped(track_meta=False)``), and on 28-64 px images MONAI's
    per-call metadata bookkeeping costs more than the random transforms
    themselves (measured: a BloodMNIST IsoFed round 12.8 s -> 6.8 s)."""
    before = get_track_meta()
    set_track_meta(False)
    try:
        yield
    finally:
        set_track_meta(before)


class CachedCases(CacheDataset):
    """The bundle's deterministic transforms cached once; its random ones per draw, on plain tensors.

    The cached case is not deep-copied before the random transforms
    (``copy_cache=False``): every bundle's random transforms return new
    tensors (tests/unit/test_site.py checks the cache is unchanged after training
    draws), and the copy cost as much as a 28 px transform."""

    def __init__(self, *args, **kw):
        super().__init__(*args, copy_cache=False, **kw)

    def _transform(self, index):
        with plain_tensors():
            out = super()._transform(index)
        # The case's position among the site's cases: rules that keep per-case state (FedMLP's tags) need it.
        if isinstance(out, dict):
            out["index"] = index
        return out


class TwoViews(torch.utils.data.Dataset):
    """Each case with a second, strongly augmented view: ``image`` is the bundle's
    training view (``train#preprocessing``), ``image_strong`` that view further
    perturbed by ``train#strong_preprocessing`` (photometric, so a mask or box
    still fits both views)."""

    def __init__(self, weak, strong):
        self.weak, self.strong = weak, strong
        self.strong_on = True  # a rule that needs no strong view (a labeled site, a pretraining pass) turns it off

    def __len__(self):
        return len(self.weak)

    def __getitem__(self, i):
        out = dict(self.weak[i])
        if not self.strong_on:
            return out
        with plain_tensors():
            out["image_strong"] = self.strong({"image": out["image"].clone()})["image"]
        return out

    def set_random_state(self, seed):
        self.weak.transform.set_random_state(seed=seed)
        self.strong.set_random_state(seed=seed + 1)


def _loader(items, transform, batch_size, shuffle, seed, strong=None, batch_transforms=None):
    ds = CachedCases(items, transform, cache_rate=1.0, num_workers=None, progress=False)
    if strong is not None:
        ds = TwoViews(ds, strong)
    gen = torch.Generator().manual_seed(seed)
    # the bundle's train#batch_transforms augment each collated batch at once (fedlabels.bundle.augment)
    collate = BatchCollate(batch_transforms).set_random_state(seed) if batch_transforms else None
    # An empty site (nothing it can learn from) gets an empty loader: its client abstains. A training
    # epoch whose last batch would hold one case drops it (shuffled, a different case each epoch): batch
    # norm cannot normalise a batch of one, and torch raises.
    single = shuffle and batch_size > 1 and len(ds) % batch_size == 1
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle and len(ds) > 0, num_workers=0, generator=gen,
                      drop_last=single, **({"collate_fn": collate} if collate else {}))


def _items(site: SiteData, split: str, oracle: bool, labeled_only: bool):
    items = site.oracle()[split] if oracle else getattr(site, split)
    task = site.profile.task
    out = [bundle_data.bundle_item(i, task, labeled_only=labeled_only) for i in items]
    return [i for i in out if i is not None]


def setup_site(bundle, dataset_dir, site_name: str, *, batch_size=None, seed=0, device="cpu", oracle=False,
               network_overrides: dict | None = None, unlabeled: bool = False, strong_view: bool = False,
               config: dict | None = None) -> SiteSetup:
    """Validate the site's data, build the bundle's network and the site's loaders.

    ``seed`` is the run's seed; the site's own (``site_seed``) drives its loaders.
    The training loader holds the cases a supervised method learns from
    (segmentation: those with a pixel mask; classification: those with a
    label) unless ``unlabeled`` (semi-supervised methods), which keeps every
    case. Validation always holds the labeled cases only. ``strong_view``
    adds ``image_strong`` to every training batch (``TwoViews``). ``config``
    overrides the bundle's config (e.g. ``{"image_size": 32}``). The raw items
    (supervision level, boxes, image-level classes) stay in ``setup.site``."""
    seed = site_seed(seed, site_name)
    scenario = load_scenario(dataset_dir, sites=[site_name], with_test=False)
    site = scenario.site(site_name)
    parser = read(bundle, dataset_dir, site=site_name, class_names=list(scenario.classes), **(config or {}))
    task = parser.get_parsed_content("task")
    if task != scenario.task:
        raise ValueError(f"{bundle}: bundle task {task!r} does not match scenario task {scenario.task!r} ({dataset_dir})")
    torch.manual_seed(seed)
    net = network(bundle, network_overrides, parser=parser).to(device)
    bs = batch_size or parser.get_parsed_content("batch_size")
    train_tf = parser.get_parsed_content("train#preprocessing", instantiate=True)
    val_tf = parser.get_parsed_content("validate#preprocessing", instantiate=True)
    strong = None
    if strong_view:
        if parser.get("train#strong_preprocessing") is None:
            raise ValueError(f"{bundle}: configs/train.json defines no train#strong_preprocessing, and the method "
                             "trains on a strongly augmented second view")
        strong = parser.get_parsed_content("train#strong_preprocessing", instantiate=True)
    batch_tf = parser.get_parsed_content("train#batch_transforms", instantiate=True) \
        if parser.get("train#batch_transforms") else None
    train_loader = _loader(_items(site, "training", oracle, labeled_only=not unlabeled), train_tf, bs, True, seed,
                           strong, batch_tf)
    val_items = _items(site, "validation", oracle, labeled_only=True)
    val_loader = _loader(val_items, val_tf, bs, False, seed) if val_items else None
    return SiteSetup(scenario, site, net, train_loader, val_loader, scenario.classes, scenario.task, seed, device,
                     oracle)


def test_loader(bundle, dataset_dir, batch_size=64, config: dict | None = None) -> DataLoader:
    """The scenario's fully labeled test split with the bundle's validation transforms
    (``config``: bundle config overrides, e.g. ``image_size``, as in ``setup_site``)."""
    scenario = load_scenario(dataset_dir, sites=[], with_test=True)
    parser = read(bundle, dataset_dir, class_names=list(scenario.classes), **(config or {}))
    val_tf = parser.get_parsed_content("validate#preprocessing", instantiate=True)
    items = [bundle_data.bundle_item(i, scenario.task, labeled_only=False) for i in scenario.test or []]
    if not items:
        raise ValueError(f"{dataset_dir}: the scenario has no test split (test/datalist.json)")
    return _loader(items, val_tf, batch_size, False, 0)


@torch.no_grad()
def predict(net, loader, task, device="cpu"):
    """Probabilities and labels over a loader (softmax for multi-class, else sigmoid: multi-label, masks)."""
    net.eval()
    probs, labels = [], []
    for batch in loader:
        logits = net(batch["image"].to(device))
        probs.append(torch.softmax(logits, 1) if task == "multiclass" else torch.sigmoid(logits))
        labels.append(torch.as_tensor(batch["label"]))
    return torch.cat(probs).cpu().numpy(), torch.cat(labels).cpu().numpy()


def evaluate(net, loader, task, classes, device="cpu") -> dict:
    """Label-aware metrics: classes a site does not annotate come back undefined;
    segmentation: Dice per class of the thresholded masks (0.5)."""
    if loader is None or len(loader.dataset) == 0:
        return {}
    probs, labels = predict(net, loader, task, device)
    if task == "multilabel":
        return multilabel_metrics(probs, labels, classes)
    if task == "multiclass":
        return multiclass_metrics(probs, labels.reshape(-1), classes)
    if task == "segmentation":
        return segmentation_metrics(probs > 0.5, labels > 0.5, classes)
    raise ValueError(f"no metrics for task {task!r}")


def flat_metrics(metrics: dict, prefix="val_") -> dict:
    """Scalar view for FLARE/TensorBoard: macro values and per-class values; undefined left out."""
    out = {}
    for key in ("auroc", "ap", "bacc", "accuracy", "precision", "recall", "dice"):
        if metrics.get(key) is not None:
            out[f"{prefix}{key}"] = float(metrics[key])
    for cls, vals in metrics.get("per_class", {}).items():
        for key in ("auroc", "ap", "bacc", "precision", "recall", "dice"):
            if vals.get(key) is not None:
                out[f"{prefix}{key}/{cls}"] = float(vals[key])
    return out



def validate_task(client, setup: SiteSetup, weights: dict) -> dict:
    """A model as this site sees it (FedBN: with its own batch norm), scored on its validation data."""
    client.receive(weights)
    return evaluate(client.net, setup.val_loader, setup.task, setup.classes, setup.device)


def train_task(client, setup: SiteSetup, weights: dict, rnd: int, extras: dict) -> Update:
    """A site's part of a round: score the received model on local validation
    data (for best-model selection), then run the method's client rule."""
    received = flat_metrics(validate_task(client, setup, weights))
    update = client.train(weights, rnd, extras)
    update.metrics.update(received)
    return update


STATE_KEEP = 2  # a resumed round needs the state before it; a site may have trained that round already


def state_folder(root, run: str, site: str) -> Path:
    """Where ``site`` keeps its client-rule state for run ``run`` (a resumed run keeps its token):
    two jobs at one hospital never share it."""
    return Path(root) / run / site


def _saved_rounds(folder: Path) -> dict:
    rounds = {}
    for f in folder.glob("round-*.pt") if folder.is_dir() else []:
        try:
            rounds[int(f.stem.split("-", 1)[1])] = f
        except ValueError:
            continue
    return rounds


def save_state(folder, client, rnd: int) -> Path:
    """The client rule's state after round ``rnd``, as ``folder/round-NNNNN.pt`` written atomically (exact
    resume); older files than the last ``STATE_KEEP`` are removed."""
    import io

    folder = Path(folder)
    buf = io.BytesIO()
    torch.save({"round": rnd, "state": client.state_dict()}, buf)
    path = folder / f"round-{rnd:05d}.pt"
    write_atomic(path, buf.getvalue())
    saved = _saved_rounds(folder)
    for old in sorted(saved)[:-STATE_KEEP]:
        saved[old].unlink(missing_ok=True)
    return path


def latest_state(path) -> Path:
    """A site state file from a file or a site's state folder (its last saved round)."""
    path = Path(path)
    if path.is_dir():
        rounds = _saved_rounds(path)
        if not rounds:
            raise FileNotFoundError(f"{path}: no saved site state (round-NNNNN.pt) in this folder")
        return rounds[max(rounds)]
    return path


def state_site(path) -> str:
    """The site a state file or folder belongs to (``<state>/<run>/<site>/round-NNNNN.pt``)."""
    path = Path(path)
    return path.name if path.is_dir() else path.parent.name if path.stem.startswith("round-") else path.stem


def load_state(folder, client, *, before: int | None = None, through: int | None = None) -> int | None:
    """Restore the newest state the site saved in ``folder`` of a round before ``before`` (resuming a run
    at that round: the site may have trained it already, for a server that died before aggregating it)
    or up to ``through`` (a new process continuing the run inside a round: a second draw of that round
    continues the first). Returns the round restored, or None when there is none (the site then starts
    from the global model alone)."""
    from .methods.base import load_state_file

    limit = before - 1 if before is not None else through
    files = _saved_rounds(Path(folder))
    rounds = [r for r in files if limit is None or r <= limit]
    if not rounds:
        return None
    rnd = max(rounds)
    saved = load_state_file(files[rnd])
    if saved.get("round") != rnd:
        raise ValueError(f"{files[rnd]}: field 'round': {saved.get('round')!r}, not the round its name says")
    client.load_state_dict(saved["state"])
    return rnd
