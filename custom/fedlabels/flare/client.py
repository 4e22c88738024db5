"""The one client script every job runs (nvflare Client API).

It reads its site's data from the scenario folder by ``flare.get_site_name()``,
builds the network and transforms from the bundle, and runs the named
method's client rule. A bad scenario is reported to the server as a fatal
error before any training, so the whole job stops with that one message.

Where the data is: ``--data DIR`` or the ``FEDLABELS_DATA`` environment
variable (each real site sets its own); neither -> the embedded synthetic
scenario of ``--family``, generated on first use.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from pathlib import Path

import nvflare.client as flare
import torch
import yaml
from nvflare.app_common.abstract.fl_model import FLModel

from .. import methods
from ..local import evaluate, flat_metrics, setup_site
from ..methods.base import to_numpy
from ..profile import ScenarioError
from .controller import FATAL


def parse_options(pairs) -> dict:
    """``key=value`` pairs; values parsed as YAML (numbers, booleans, lists)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"method option {pair!r} is not key=value")
        out[key] = yaml.safe_load(value)
    return out


def find_bundle(name: str, here: Path | None = None) -> Path:
    """A bundle path, or a name looked up in the job's custom folder, then ./bundles."""
    candidates = [Path(name)]
    if here is not None:
        candidates.append(here / Path(name).name)
    candidates.append(Path(__file__).resolve().parents[3] / "bundles" / Path(name).name)
    for c in candidates:
        if (c / "configs" / "train.json").is_file():
            return c.resolve()
    raise FileNotFoundError(f"bundle {name!r} not found (looked in {[str(c) for c in candidates]})")


def build_parser():
    p = argparse.ArgumentParser(description="fedlabels FLARE client")
    p.add_argument("--bundle", required=True, help="bundle folder or name (looked up in the job's custom folder)")
    p.add_argument("--method", required=True)
    p.add_argument("--opt", action="append", default=[], help="method option key=value (repeatable)")
    p.add_argument("--data", default=None, help="scenario folder (default: $FEDLABELS_DATA, else the embedded one)")
    p.add_argument("--family", default="cxr", help="embedded synthetic family when no data is given")
    p.add_argument("--synth", action="append", default=[], help="embedded-data option key=value, e.g. cases=40")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fault", action="append", default=[], metavar="SITE:KIND:ROUND",
                   help="fault drill: make SITE send a bad update (KIND nan|shape|keys) or crash (crash) at ROUND")
    return p


def inject_fault(faults, site: str, rnd: int, weights: dict) -> dict:
    """Deliberately corrupt this site's update, to drill the server's fault handling."""
    for fault in faults:
        where, kind, when = fault.split(":")
        if where != site or int(when) != rnd:
            continue
        key = next(k for k, v in weights.items() if v.dtype.kind == "f")
        if kind == "crash":
            raise RuntimeError(f"fault drill: {site} crashes in round {rnd}")
        weights = dict(weights)
        if kind == "nan":
            weights[key] = weights[key] * float("nan")
        elif kind == "shape":
            weights[key] = weights[key].reshape(-1)[:-1]
        elif kind == "keys":
            weights["not_a_layer.weight"] = weights.pop(key)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
    return weights


def data_root(args) -> Path:
    root = args.data or os.environ.get("FEDLABELS_DATA")
    if root:
        return Path(root)
    from ..data.synthetic import default_scenario

    return default_scenario(args.family, seed=args.seed, **parse_options(args.synth))


def prepare(args, site: str, here: Path | None):
    """Everything a site needs, validated before the first round."""
    method = methods.get(args.method)
    options = parse_options(args.opt)
    method.options(**options)  # unknown option names fail here
    setup = setup_site(find_bundle(args.bundle, here), data_root(args), site, batch_size=args.batch_size,
                       seed=args.seed + zlib.crc32(site.encode()) % 1000, device=args.device)
    profile = setup.site.profile
    if setup.task not in method.tasks:
        raise ValueError(f"method {method.name!r} handles {method.tasks}, not the scenario's task {setup.task!r}")
    if method.needs_labels and not profile.annotated:
        raise ScenarioError(setup.site.folder / "profile.yaml", f"method {method.name!r} needs labels but the site annotates no class", field="annotated")
    summary = setup.site.summary()
    client = method.make_client(setup.net, profile, setup.train_loader, device=args.device, summary=summary, **options)
    return setup, client


def main(argv=None, here: Path | None = None):
    args = build_parser().parse_args(argv)
    flare.init()
    site = flare.get_site_name()
    try:
        setup, client = prepare(args, site, here)
        fatal = None
        print(f"[{site}] {args.method} on {setup.scenario.name}: {setup.site.summary()['cases']} training cases, "
              f"annotates {list(setup.site.profile.annotated) or 'nothing'}", flush=True)
    except (ScenarioError, ValueError, FileNotFoundError) as e:
        fatal = str(e)
        print(f"[{site}] cannot start: {fatal}", flush=True)
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        if fatal:
            flare.send(FLModel(params={}, meta={FATAL: fatal}))
            continue
        t0 = time.time()
        if flare.is_train():
            # Score the received global model on local validation data first.
            client.receive(model.params)
            received = evaluate(client.net, setup.val_loader, setup.task, setup.classes, args.device)
            update = client.train(model.params, model.current_round, (model.meta or {}).get("extras"))
            scores = flat_metrics(received)
            metrics = {**update.metrics, **scores}
            meta = {**update.meta, "n": update.n, "NUM_STEPS_CURRENT_ROUND": update.n}
            flare.send(FLModel(params=inject_fault(args.fault, site, model.current_round, update.weights), metrics=metrics, meta=meta))
            print(f"[{site}] round {model.current_round}: n={update.n} train_loss={update.metrics.get('train_loss', float('nan')):.4f} "
                  f"received model: val_auroc={scores.get('val_auroc')} val_accuracy={scores.get('val_accuracy')} "
                  f"({time.time() - t0:.1f}s)", flush=True)
        elif flare.is_evaluate():
            client.receive(model.params)
            result = evaluate(client.net, setup.val_loader, setup.task, setup.classes, args.device)
            flare.send(FLModel(metrics=flat_metrics(result) or {"val_cases": 0.0}, meta={"evaluation": result}))
        elif flare.is_submit_model():
            flare.send(FLModel(params=to_numpy(client.net.state_dict())))


if __name__ == "__main__":
    main()
