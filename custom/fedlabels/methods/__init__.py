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
