"""Differential privacy for the label summary a site shares (the Gaussian mechanism).

The label summary (``profile.label_summary``) is the only statistic a site
sends besides weights, metrics and ``n``: its case count and, per class, the
annotated count n_k^c and the positive count. With the run option ``privacy``
(``{"noise_multiplier": s, "clip": C, "delta": d}`` in ``fedlabels.json``)
those counts leave noised:

* each training case contributes the vector ``[1, annotated(c)..., positive(c)...]``
  (its own label summary); that vector is scaled to L2 norm at most ``C``, so
  adding or removing one case moves the sum by at most ``C`` (the sensitivity);
* the sum gets N(0, (s*C)^2) noise on every entry: the Gaussian mechanism with
  noise multiplier ``s``;
* the noised sums are then rounded and clamped to valid counts
  (0 <= positives <= annotated <= cases), and entries the site's published
  profile fixes at 0 (classes it does not annotate) are set to 0. Both are
  post-processing: they cost no privacy.

The (epsilon, delta) this spends comes from opacus's ``RDPAccountant`` (a
maintained accountant; sample rate 1: every case is in the release).

One release per run, reused for every message. The noised summary is drawn
once, before round 0, and sent unchanged in the handshake and in every
training update: resending the same numbers is post-processing and spends
nothing, whereas fresh noise each round would spend the budget again every
round (and averaging the rounds would undo the noise).

One ledger per site (``ledger_path``: ``FEDLABELS_PRIVACY_LEDGER``, default
``~/.fedlabels/privacy-ledger.json``, outside any nvflare workspace so that a
new workspace does not reset it) records every release of every job and run,
under a file lock (two jobs at one hospital may start at once). A later run on
the same data with the same options reuses its release at no further cost;
changed data or options make a new release, and the reported epsilon composes
every release the ledger holds for the site, whatever data it came from (the
cases of two datasets at one hospital may be the same patients').

The unit is one image (one training case), not one patient: a patient with k
images in the site's data is protected at roughly k times the epsilon (group
privacy).

The noise comes from the operating system's random source (``SystemRandom``),
never from the run's seed: the server knows that seed and could subtract the
noise. ``seed`` exists for tests only.

What this does not cover (``EXACT``; docs/deployment.md section 6 lists every
statistic that leaves a site): ``n``, the FedAvg weight, leaves exact every
round and gives the number of cases trained on, so the noised ``cases`` (and,
at a site that annotates every case, the noised ``annotated`` counts) protect
nothing beyond it; the weights, the training loss, the validation metrics and
each method's own statistics leave exact too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .profile import SiteProfile, label_summary, write_json_atomic

NOISED = ("cases", "annotated", "positives")  # the label summary's fields that carry noise
# what leaves exact beside them: n gives the case count (and the annotated counts of a fully annotated site)
EXACT = ("n", "site", "task", "supervision", "labeled_mask")
UNIT = "image"                                 # the guarantee is per image (training case), not per patient
LEDGER_ENV = "FEDLABELS_PRIVACY_LEDGER"
REPORT = "privacy"                             # the summary's key for the (epsilon, delta) report
ACCOUNTANT = "opacus.accountants.RDPAccountant"


class OptionError(ValueError):
    """A bad ``privacy`` option; ``key`` names it (the config names the file)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Options:
    noise_multiplier: float  # noise std / clip
    clip: float              # the L2 bound of one case's contribution (the sensitivity)
    delta: float             # the delta of the reported (epsilon, delta)


def options(doc: dict) -> Options:
    """Validated options from the run configuration's ``privacy`` mapping."""
    if not isinstance(doc, dict):
        raise OptionError("", f"expected a mapping with {list(Options.__annotations__)}, got {type(doc).__name__}")
    keys = list(Options.__annotations__)
    unknown = sorted(set(doc) - set(keys))
    if unknown:
        raise OptionError(unknown[0], f"unknown option; options are {keys}")
    for key in keys:
        if key not in doc:
            raise OptionError(key, "missing (every privacy option must be given; omit 'privacy' to turn it off)")
        v = doc[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise OptionError(key, f"expected a finite number, got {v!r}")
    if doc["noise_multiplier"] <= 0:
        raise OptionError("noise_multiplier", f"must be > 0, not {doc['noise_multiplier']!r} "
                          "(0 adds no noise: omit 'privacy' to send exact counts)")
    if doc["clip"] <= 0:
        raise OptionError("clip", f"must be > 0, not {doc['clip']!r}")
    if not 0 < doc["delta"] < 1:
        raise OptionError("delta", f"must lie in (0, 1), not {doc['delta']!r}")
    return Options(float(doc["noise_multiplier"]), float(doc["clip"]), float(doc["delta"]))


# ---------------------------------------------------------------- the mechanism


def clip_rows(x, clip: float) -> np.ndarray:
    """Each row scaled by min(1, clip / ||row||_2): no case moves the sum by more than ``clip``."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, clip / np.maximum(norms, 1e-300))


def gaussian_sum(contributions, noise_multiplier: float, clip: float, rng: random.Random) -> np.ndarray:
    """Sum of the clipped rows plus N(0, (noise_multiplier * clip)^2) on every entry."""
    x = np.asarray(contributions, dtype=np.float64)
    total = clip_rows(x, clip).sum(0) if len(x) else np.zeros(x.shape[1])
    std = noise_multiplier * clip
    return total + np.array([rng.gauss(0.0, std) for _ in range(total.size)])


def epsilon(noise_multiplier: float, delta: float, releases: int = 1) -> float:
    """The epsilon of ``releases`` Gaussian releases at ``noise_multiplier``, by opacus's RDP accountant."""
    return composed_epsilon([noise_multiplier] * releases, delta)


def composed_epsilon(noise_multipliers: list, delta: float) -> float:
    """The epsilon of several releases, each with its own noise multiplier (RDP adds up)."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for s in noise_multipliers:
        accountant.step(noise_multiplier=s, sample_rate=1.0)  # every case is in each release
    return float(accountant.get_epsilon(delta=delta))


# ---------------------------------------------------------------- the label summary


def contributions(profile: SiteProfile, items: list) -> np.ndarray:
    """One row per case: its own label summary ``[cases=1, annotated..., positives...]``.
    The rows sum to the site's exact counts."""
    rows = []
    for item in items:
        s = label_summary(profile, [item])
        rows.append([s["cases"], *s["annotated"], *s["positives"]])
    return np.asarray(rows, dtype=np.float64).reshape(len(items), 1 + 2 * profile.num_classes)


def noised_summary(profile: SiteProfile, items: list, opts: Options, rng: random.Random) -> dict:
    """The label summary with its counts released once through the Gaussian mechanism (no report yet)."""
    c = profile.num_classes
    v = np.rint(gaussian_sum(contributions(profile, items), opts.noise_multiplier, opts.clip, rng))
    # Post-processing only from here: valid counts, and zeros the published profile implies.
    cases = max(0, int(v[0]))
    annotated = np.clip(v[1:1 + c], 0, cases)
    positives = np.clip(v[1 + c:], 0, annotated)
    if profile.supervision == "none":
        annotated[:] = 0  # an unlabeled site's datalist holds no label (profile.py checks it)
    if profile.task == "multilabel":
        annotated[~profile.labeled_mask] = 0  # classes it does not annotate are -1 in every case
    if profile.task == "segmentation":
        positives[:] = 0  # segmentation summaries count no positives
    positives = np.minimum(positives, annotated)
    out = label_summary(profile, [])
    out.update(cases=cases, annotated=annotated.astype(int).tolist(), positives=positives.astype(int).tolist(),
               labeled=bool(annotated.any()))
    return out


def fingerprint(profile: SiteProfile, items: list, opts: Options) -> str:
    """Names the exact counts and options a release was drawn from (kept at the site, never sent)."""
    doc = {"summary": label_summary(profile, items), "options": asdict(opts)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def ledger_path() -> Path:
    """The site's privacy ledger: ``FEDLABELS_PRIVACY_LEDGER``, else ``~/.fedlabels/privacy-ledger.json``."""
    env = os.environ.get(LEDGER_ENV)
    return Path(env) if env else Path.home() / ".fedlabels" / "privacy-ledger.json"


@contextlib.contextmanager
def _locked(ledger: Path):
    """An exclusive lock on the ledger for a read-modify-write (another job's site may release at once)."""
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with open(ledger.with_name(ledger.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_ledger(ledger: Path) -> dict:
    if not Path(ledger).is_file():
        return {"sites": {}}
    try:
        doc = json.loads(Path(ledger).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{ledger}: not valid JSON ({e}); restore it from a backup: it records what this "
                         "site's releases have spent, and a new one would start counting from zero") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sites"), dict):
        raise ValueError(f"{ledger}: field 'sites': expected a mapping of site -> releases")
    return doc


def spent(ledger: Path, site: str, delta: float) -> tuple:
    """(epsilon, releases): everything the ledger records for ``site``, composed at ``delta``."""
    releases = read_ledger(ledger)["sites"].get(site, [])
    return (composed_epsilon([r["noise_multiplier"] for r in releases], delta) if releases else 0.0), len(releases)


def release(profile: SiteProfile, items: list, opts: Options, ledger: Path | None = None,
            seed: int | None = None, note: str = "") -> tuple:
    """The site's noised label summary with its (epsilon, delta) report under ``"privacy"``,
    and whether it was reused from ``ledger``.

    ``ledger`` (``ledger_path()``) keeps every release of the site: the same
    data and options get the same numbers back, at no further cost; a new
    release is appended, and the report's epsilon composes every release the
    ledger holds for this site. ``note`` (the job) goes in the ledger entry.
    ``seed`` is for tests only."""
    key = fingerprint(profile, items, opts)
    rng = random.SystemRandom() if seed is None else random.Random(seed)
    if ledger is None:
        summary = noised_summary(profile, items, opts, rng)
        summary[REPORT] = report(opts, [opts.noise_multiplier])
        return summary, False
    ledger = Path(ledger)
    with _locked(ledger):
        doc = read_ledger(ledger)
        mine = doc["sites"].setdefault(profile.site, [])
        for entry in reversed(mine):
            if entry.get("fingerprint") == key:
                return entry["summary"], True
        summary = noised_summary(profile, items, opts, rng)
        summary[REPORT] = report(opts, [r["noise_multiplier"] for r in mine] + [opts.noise_multiplier])
        mine.append({"fingerprint": key, "summary": summary, "noise_multiplier": opts.noise_multiplier,
                     "delta": opts.delta, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "note": note})
        write_json_atomic(ledger, doc)
    return summary, False


def report(opts: Options, history: list) -> dict:
    """What a release tells the server: its mechanism, what it noised and what leaves exact, and the
    (epsilon, delta) of every release so far (``history``: their noise multipliers)."""
    return {"mechanism": "gaussian", "noised": list(NOISED), "exact": list(EXACT), "unit": UNIT,
            "noise_multiplier": opts.noise_multiplier, "clip": opts.clip, "delta": opts.delta,
            "releases": len(history), "epsilon": composed_epsilon(history, opts.delta), "accountant": ACCOUNTANT}


def describe(report: dict) -> str:
    """One line on what a label summary release spent."""
    n = report["releases"]
    return (f"label summary noised (Gaussian, noise_multiplier={report['noise_multiplier']:g}, "
            f"clip={report['clip']:g}): (epsilon={report['epsilon']:.4g}, delta={report['delta']:g}) spent over "
            f"{n} release{'s' if n != 1 else ''} of this site's counts (opacus RDP accountant), per "
            f"{report.get('unit', UNIT)}, not per patient; n, sent exactly every round, gives the case count")


def server_lines(summaries: dict, required: bool) -> list:
    """The server's one line per site on what its label summary spent. With the
    option on, a site that sent exact counts is refused (no round starts)."""
    lines = []
    for site, summary in sorted(summaries.items()):
        report = summary.get(REPORT)
        if report is None:
            if required:
                raise ValueError(f"{site} sent an exact label summary, but the run's 'privacy' option asks for a "
                                 "noised one: the site runs another configuration or package version")
            continue
        lines.append(f"privacy: {site}: {describe(report)}")
    return lines
