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
from .config import KEY_METRICS
from .engine import RoundEngine
from .methods.base import SiteContext, to_numpy
from .scoring import Scorer
from .site import SiteSetup, evaluate, flat_metrics, setup_site, train_task, validate_task
from .nets import rebuild
from .profile import SiteProfile, label_summary, load_scenario
from .progress import number


def setups(bundle, data, sites=None, batch_size=None, seed=0, oracle=False, network_overrides=None,
           method=None, config=None) -> dict:
    """Every site's ``setup_site``, with the data views ``method`` (a registered name) trains on
    (``config``: bundle config overrides, e.g. ``{"image_size": 32}``)."""
    names = sites or list(load_scenario(data, check_files=False, with_test=False).sites)
    m = methods.get(method) if method else None
    return {s: setup_site(bundle, data, s, batch_size=batch_size, seed=seed, oracle=oracle,
                          network_overrides=m.network_options(network_overrides) if m else network_overrides,
                          unlabeled=bool(m and m.uses_unlabeled),
                          strong_view=bool(m and m.strong_view), config=config) for s in names}


def site_round(client, setup: SiteSetup, weights: dict, rnd: int, extras: dict):
    """A site's part of a round in-process, as the server receives it from a FLARE site: without the keys
    the site keeps (``client.local_keys``), which a FLARE job withholds with nvflare's ExcludeVars result
    filter. The in-process stand-in for that filter, so both transports aggregate the same keys."""
    update = train_task(client, setup, weights, rnd, extras)
    update.weights = {k: v for k, v in update.weights.items() if k not in client.local_keys}
    return update


def federate(method: str, site_setups: dict, rounds: int, seed=0, log=print, client_options=None,
             server_options=None, key_metric=None, min_sites=1, on_round=None) -> dict:
    """Run ``rounds`` of a method in-process through the round engine (``fedlabels.engine``),
    the same engine the FLARE controller runs.

    Returns {"last": weights, "best": weights (best mean site-validation score
    of a received model, or of the final one, as the FLARE controller chooses),
    "records": per-round records, "clients": the client rules, for analysis}. ``on_round(record, weights, best)`` is
    called after each round with the round's model and the best one so far.
    """
    m = methods.get(method)
    first = next(iter(site_setups.values()))
    key_metric = key_metric or KEY_METRICS[first.task]
    server = m.make_server(run_seed=seed, **(server_options or {}))
    clients = {s: m.make_client(st.net, st.context(), **(client_options or {})) for s, st in site_setups.items()}
    for line in server.setup({s: st.summary() for s, st in site_setups.items()}) or []:
        if log:
            log(f"[{method}] {line}")

    def send(step, targets, weights, rnd, extras):
        return [site_round(clients[s], site_setups[s], weights, rnd, extras) for s in targets]

    def say(level, msg):
        if log:
            log(f"[{method}] {msg}")

    engine = RoundEngine(server, send, key_metric=key_metric, min_sites=min_sites, log=say)
    torch.manual_seed(seed)
    weights = to_numpy(rebuild(first.net).state_dict())
    best, records = dict(weights), []
    for rnd in range(rounds):
        t0 = time.time()
        weights, record, best_now = engine.run_round(rnd, weights, list(clients))
        if best_now is not None:
            best = best_now
        record["seconds"] = time.time() - t0
        records.append(record)
        say("info", f"round {rnd}: " + " ".join(f"{s}={r.get('train_loss', float('nan')):.3f}"
                                                for s, r in sorted(record["sites"].items()))
            + f" mean {key_metric}={number(record[f'mean_{key_metric}'])} ({record['seconds']:.1f}s)")
        if on_round:
            on_round(record, weights, best)
    # As the FLARE controller's cross-site validation: the final model is a best-model candidate too.
    final = {s: flat_metrics(validate_task(client, site_setups[s], weights)).get(key_metric) for s, client in clients.items()}
    final = {s: v for s, v in final.items() if v is not None}
    if engine.score_final(final)[1]:
        best = weights
    engine.check_progress()
    return {"last": weights, "best": best, "records": records, "clients": clients}


def local(bundle, data, epochs: int, batch_size=None, seed=0, log=print, client_options=None,
          network_overrides=None, config=None) -> dict:
    """Each site alone; its model scored on the test split and on every site's validation data."""
    site_setups = setups(bundle, data, batch_size=batch_size, seed=seed, network_overrides=network_overrides,
                         config=config)
    scorer, out = Scorer(bundle, data, network_overrides, config, groups=False), {}
    for name, st in site_setups.items():
        client = methods.get("fedavg_pl").make_client(st.net, st.context(), epochs=epochs, **(client_options or {}))
        client.train(to_numpy(st.net.state_dict()), 0)
        out[name] = {"test": scorer.evaluate(to_numpy(st.net.state_dict())),
                     "sites": {o: evaluate(st.net, ot.val_loader, ot.task, ot.classes) for o, ot in site_setups.items()}}
        if log:
            log(f"[local] {name}: test AUROC {out[name]['test'].get('auroc')}")
    return out


def pooled(bundle, data, epochs: int, oracle: bool, batch_size=None, seed=0, client_options=None) -> dict:
    """Centralized (missing labels as negatives) or oracle (full labels) training on all sites' cases."""
    site_setups = setups(bundle, data, batch_size=batch_size, seed=seed, oracle=oracle)
    first = next(iter(site_setups.values()))
    dataset = ConcatDataset([st.train_loader.dataset for st in site_setups.values()])
    collate = first.train_loader.collate_fn  # the bundle's batch augmentation, where it has one
    loader = torch.utils.data.DataLoader(dataset, batch_size=first.train_loader.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed),
                                         **({"collate_fn": collate} if hasattr(collate, "set_random_state") else {}))
    sc = first.scenario
    items = [i for st in site_setups.values() for i in (st.site.oracle()["training"] if oracle else st.site.training)]
    profile = SiteProfile("pooled", sc.task, sc.classes, sc.classes, "image")
    name = "fedavg_pl" if oracle else "fedavg"  # fedavg = missing labels as negatives
    ctx = SiteContext(profile, loader, label_summary(profile, items), seed=seed)
    client = methods.get(name).make_client(first.net, ctx, epochs=epochs, **(client_options or {}))
    client.train(to_numpy(first.net.state_dict()), 0)
    return Scorer(bundle, data, groups=False).evaluate(to_numpy(first.net.state_dict()))


__all__ = ["federate", "local", "pooled", "setups", "SiteSetup"]
