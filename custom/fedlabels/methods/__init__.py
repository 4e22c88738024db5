"""Method registry: a method is a client rule + a server rule + preset options.

A method module registers itself when imported; every module of this
package is imported on first use, so adding a method is adding a module.
``Method.client_options`` / ``server_options`` check option names against
the rule's own keyword arguments, so a typo in a job configuration fails
with its name before training.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field

from .base import ClientRule, ServerRule, SiteContext, Step, Update  # noqa: F401

# What a method does with a site that lacks labels, by kind of site (``Method.site_roles``); None in a
# declaration: the method cannot serve such a site, and a run on it is refused naming the site.
LABELED = "trains on its labels"
ABSTAINS = "abstains (nothing it can learn from)"
ANNOTATED_ONLY = "trains on the classes it annotates only"
AS_NEGATIVES = "counts the classes it does not annotate as negatives"
FROM_MODEL = "trains the classes it does not annotate on the model's own outputs"
WITHOUT_LABELS = "trains on its images without labels"
WEAK_LABELS = "trains on its boxes or image tags"

# Not options: what the site supplies.
_SUPPLIED = {"self", "net", "ctx", "args", "kw", "kwargs"}


def _keywords(cls) -> set:
    """Keyword arguments of ``cls.__init__``, following ``**kw`` up the MRO (and only then)."""
    names = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = inspect.signature(klass.__init__).parameters
        names |= set(params)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names - _SUPPLIED


@dataclass(frozen=True)
class Method:
    name: str
    client: type
    server: type
    tasks: tuple
    client_presets: dict = field(default_factory=dict)
    server_presets: dict = field(default_factory=dict)
    uses_unlabeled: bool = False  # semi-supervised: sites also train on their unlabeled cases
    strong_view: bool = False  # training batches also carry ``image_strong`` (bundle: train#strong_preprocessing)
    network: dict = field(default_factory=dict)  # network_def options the method needs (FedMix: a TwinUNet)
    doc: str = ""
    # What it does with each kind of site (a LABELED site annotates every class, with pixel masks in
    # segmentation): one annotating some classes, one annotating none, one with boxes or image tags
    # for masks; ``needs_full_site``: at least one LABELED site.
    partial_site: str | None = ANNOTATED_ONLY
    unlabeled_site: str | None = ABSTAINS
    weak_site: str | None = ABSTAINS
    needs_full_site: bool = False

    def site_roles(self, summaries: dict) -> dict:
        """site -> what this method does with it (None: it cannot), from the sites' label summaries
        (``profile.label_summary``: ``labeled``, ``labeled_mask``, ``supervision``)."""
        roles = {}
        for site, s in sorted(summaries.items()):
            if not s.get("labeled") or s.get("supervision") == "none":
                roles[site] = self.unlabeled_site
            elif s.get("task") == "segmentation":
                roles[site] = LABELED if s.get("supervision") == "pixel" else self.weak_site
            else:
                roles[site] = LABELED if all(s["labeled_mask"]) else self.partial_site
        return roles

    def refusal(self, summaries: dict) -> str | None:
        """Why this method cannot run on these sites, in one line naming the site and what it lacks; None
        when it can (every site's role is declared)."""
        tasks = {s.get("task") for s in summaries.values()}
        wrong = sorted(t for t in tasks if t not in self.tasks)
        if wrong:
            return f"{self.name} handles {'/'.join(self.tasks)} tasks, not {'/'.join(wrong)}"
        roles = self.site_roles(summaries)
        for site, role in roles.items():
            if role is None:
                s = summaries[site]
                if not s.get("labeled") or s.get("supervision") == "none":
                    lacks = "annotates no class"
                elif s.get("task") == "segmentation":
                    lacks = f"has {s.get('supervision')} supervision, not pixel masks"
                else:
                    lacks = f"annotates {sum(map(bool, s['labeled_mask']))} of the {len(s['labeled_mask'])} classes"
                return f"{self.name} cannot use {site}: it {lacks}"
        if self.needs_full_site and LABELED not in roles.values():
            return f"{self.name} needs a site that annotates every class; none of {sorted(roles)} does"
        return None

    def client_option_names(self) -> set:
        return _keywords(self.client)

    def server_option_names(self) -> set:
        return _keywords(self.server)

    def _check(self, side: str, options: dict, known: set, presets: dict) -> dict:
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"method {self.name!r} has no {side} option(s) {unknown}; {side} options are {sorted(known)}")
        return {**presets, **options}

    def client_options(self, **options) -> dict:
        return self._check("client", options, self.client_option_names(), self.client_presets)

    def server_options(self, **options) -> dict:
        return self._check("server", options, self.server_option_names(), self.server_presets)

    def network_options(self, overrides: dict | None = None) -> dict:
        """The bundle's network_def overrides this method trains with: its own, then the run's."""
        return {**self.network, **(overrides or {})}

    def make_client(self, net, ctx: SiteContext, **options) -> ClientRule:
        return self.client(net, ctx, **self.client_options(**options))

    def make_server(self, run_seed: int | None = None, **options) -> ServerRule:
        """The server rule; a rule with a ``seed`` option (random draws) gets the run's seed unless set."""
        if run_seed is not None and "seed" in self.server_option_names() and "seed" not in options:
            options["seed"] = run_seed
        return self.server(**self.server_options(**options))


REGISTRY: dict = {}


def register(method: Method) -> Method:
    REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    _load_all()
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; registered: {sorted(REGISTRY)}")
    return REGISTRY[name]


def names() -> list:
    _load_all()
    return sorted(REGISTRY)


def _load_all():
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
