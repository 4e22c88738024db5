"""Method registry: a method is a client rule + a server rule + preset options.

``build(name, **options)`` checks option names against the method's own
(so a typo in a job config fails before training) and returns the pair of
factories the FLARE glue and the tests use.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from .base import ClientRule, ServerRule, Update  # noqa: F401


@dataclass(frozen=True)
class Method:
    name: str
    client: type
    server: type
    tasks: tuple
    presets: dict = field(default_factory=dict)
    needs_labels: bool = True  # every site must annotate at least one class
    doc: str = ""

    def option_names(self) -> set:
        names = set()
        for cls in (self.client, self.server, ClientRule):
            for klass in cls.__mro__:
                if "__init__" in vars(klass):
                    names |= {p for p in inspect.signature(klass.__init__).parameters if p not in ("self", "args", "kw", "kwargs", "options")}
        return names - {"net", "profile", "loader", "device", "summary"}

    def options(self, **overrides) -> dict:
        unknown = set(overrides) - self.option_names()
        if unknown:
            raise ValueError(f"method {self.name!r} has no option(s) {sorted(unknown)}; options are {sorted(self.option_names())}")
        return {**self.presets, **overrides}

    def make_client(self, net, profile, loader, device="cpu", summary=None, **options):
        opts = self.options(**options)
        return self.client(net, profile, loader, device=device, summary=summary, **opts)

    def make_server(self, **options):
        return self.server(**self.options(**options))


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
    # Importing a method module registers it.
    from . import fedavg, fedpsl, surgical  # noqa: F401
