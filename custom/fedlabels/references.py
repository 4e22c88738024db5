"""In-process training loops: the non-federated references and a plain federation.

* ``federate``    -- a registered method's client and server rules in one
  process, no FLARE: the same arithmetic a FLARE job runs (used for method
  claims in tests and as the plain-loop side of the overhead benchmark);
* ``local``       -- each site trains alone (partial loss), scored on every site;
* ``centralized`` -- all sites' cases pooled, missing labels as negatives;
* ``oracle``      -- pooled with the full labels (``oracle.json``).
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import ConcatDataset

from . import methods
from .local import SiteSetup, evaluate, setup_site, test_loader
from .methods.base import load_weights, to_numpy
from .nets import rebuild
from .profile import SiteProfile, label_summary, load_scenario


def setups(bundle, data, sites=None, batch_size=None, seed=0, oracle=False, network_overrides=None) -> dict:
    names = sites or list(load_scenario(data, check_files=False, with_test=False).sites)
    return {s: setup_site(bundle, data, s, batch_size=batch_size, seed=seed + i, oracle=oracle,
                          network_overrides=network_overrides) for i, s in enumerate(names)}


def federate(method: str, site_setups: dict, rounds: int, seed=0, log=print, **options) -> dict:
    """Run ``rounds`` of a method in-process; returns the final global weights."""
    m = methods.get(method)
    server = m.make_server(**options)
    clients = {s: m.make_client(st.net, st.site.profile, st.train_loader, summary=st.site.summary(), **options)
               for s, st in site_setups.items()}
    torch.manual_seed(seed)
    global_weights = to_numpy(rebuild(next(iter(site_setups.values())).net).state_dict())
    for rnd in range(rounds):
        t0 = time.time()
        groups = server.plan(rnd, list(clients)) if hasattr(server, "plan") else [list(clients)]
        for group in groups:
            updates = [clients[s].train(global_weights, rnd, server.extras(rnd)) for s in group]
            global_weights = server.aggregate(updates, global_weights, rnd)
        if log:
            losses = " ".join(f"{u.site}={u.metrics.get('train_loss', float('nan')):.3f}" for u in updates)
            log(f"[{method}] round {rnd}: {losses} ({time.time() - t0:.1f}s)")
    return global_weights


def score(net, weights, bundle, data, loader=None) -> dict:
    """Test-split metrics of ``weights`` loaded into ``net`` (``loader``: a
    ``test_loader(bundle, data)`` to reuse across calls)."""
    sc = load_scenario(data, sites=[], with_test=False)
    load_weights(net, weights)
    return evaluate(net, loader or test_loader(bundle, data), sc.task, sc.classes)


def local(bundle, data, epochs: int, batch_size=None, seed=0, log=print) -> dict:
    """Each site alone; its model scored on the test split and on every site's validation data."""
    site_setups = setups(bundle, data, batch_size=batch_size, seed=seed)
    tests, out = test_loader(bundle, data), {}
    for name, st in site_setups.items():
        client = methods.get("fedavg_pl").make_client(st.net, st.site.profile, st.train_loader, summary=st.site.summary(), epochs=epochs)
        client.train(to_numpy(st.net.state_dict()), 0)
        out[name] = {"test": score(st.net, to_numpy(st.net.state_dict()), bundle, data, tests),
                     "sites": {o: evaluate(st.net, ot.val_loader, ot.task, ot.classes) for o, ot in site_setups.items()}}
        if log:
            log(f"[local] {name}: test AUROC {out[name]['test'].get('auroc')}")
    return out


def pooled(bundle, data, epochs: int, oracle: bool, batch_size=None, seed=0) -> dict:
    """Centralized (missing labels as negatives) or oracle (full labels) training on all sites' cases."""
    site_setups = setups(bundle, data, batch_size=batch_size, seed=seed, oracle=oracle)
    first = next(iter(site_setups.values()))
    dataset = ConcatDataset([st.train_loader.dataset for st in site_setups.values()])
    loader = torch.utils.data.DataLoader(dataset, batch_size=first.train_loader.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    sc = first.scenario
    items = [i for st in site_setups.values() for i in (st.site.oracle()["training"] if oracle else st.site.training)]
    profile = SiteProfile("pooled", sc.task, sc.classes, sc.classes, "image")
    name = "fedavg_pl" if oracle else "fedavg"  # fedavg = missing labels as negatives
    client = methods.get(name).make_client(first.net, profile, loader, summary=label_summary(profile, items), epochs=epochs)
    client.train(to_numpy(first.net.state_dict()), 0)
    return score(first.net, to_numpy(first.net.state_dict()), bundle, data)


__all__ = ["federate", "local", "pooled", "setups", "score", "SiteSetup"]
