"""The ``fedlabels`` command.

```text
fedlabels synth {cxr,medmnist,lesion,mixed} --out DIR [--seed N]
fedlabels validate DIR                         check a scenario, print its table
fedlabels prepare DATASET --src DIR --protocol NAME --out DIR
fedlabels import LABELS.csv [SITE=MORE.csv ...] --out DIR   your own images and labels
fedlabels train --bundle X --data DIR [--site NAME] [--epochs N] --out DIR
fedlabels evaluate --bundle X --ckpt MODEL --data DIR
fedlabels export --bundle X --ckpt MODEL --out DIR [--run RUN_DIR] [--data DIR]
fedlabels baseline {local,centralized,oracle} --data DIR   non-federated references
fedlabels methods                              registered federated methods
fedlabels bundles [NAME]                       the MONAI bundles found by name and their folders
fedlabels bench --data DIR --bundle X --methods a,b --seeds 0,1,2 --rounds R --out DIR
                                               methods side by side over seeds, with local floors
fedlabels jobs --out nvflare_jobs              (re)generate the FLARE job folders
fedlabels simulate JOB [--data DIR] -n N       run one job in the FLARE simulator
fedlabels demo --out DIR                       the main job on the embedded data
```

A bundle (``--bundle``) is a folder or the name of one: ``FEDLABELS_BUNDLES``'s folders first, then the
bundles the package ships (``fedlabels bundles`` lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from . import __version__
from .config import positive_int
from .profile import ScenarioError

# Subcommands defined in flare/commands.py. Registering them imports NVIDIA FLARE
# and MONAI (seconds), so the parser only does it when one of them (or the help
# listing) is asked for.
FLARE_COMMANDS = ("jobs", "simulate", "report", "demo")
# The FLARE subcommands as the top-level help (``fedlabels --help``) lists them, without importing
# flare/commands.py: that listing answers in a fraction of a second. A test keeps these lines equal to
# the ones flare/commands.py registers.
FLARE_HELP = {
    "jobs": "(re)generate the FLARE job folders from their Python definitions",
    "simulate": "run one job in the FLARE simulator",
    "provision": "provision a real federation: one TLS startup kit per participant",
    "kit-policy": "add fedlabels' site policy to a startup kit nvflare made (distributed provisioning: the "
                  "hospital's private key never leaves it)",
    "report": "test-set per-class table of finished runs' global models",
    "demo": "naive FedAvg, FedAvg-PL, Surgical Aggregation and FedPSL on the embedded data, then export the best "
            "on validation",
}
LISTING = "listing"
# data.synthetic.CXR_SITE_SCALE, as `synth --help` says it (a test keeps them equal; the listing imports no numpy)
CXR_SCALES = "1, 0.6, 1.6, 0.8"

# Subcommands that read a scenario folder given as --data and do not validate it
# themselves (train and evaluate do, in bundle.workflows): main() validates it
# with profile.load_scenario first, so a malformed scenario is one ScenarioError
# line before any model code is imported or trained.
SCENARIO_COMMANDS = ("baseline", "simulate", "report", "export", "methods")

# Subcommands that write a folder, some replacing it whole: (its option, what an earlier output of the
# command always holds, what it is). main() refuses a non-empty folder holding none of these unless
# --force: `export --out .` must not wipe the working folder. (import checks its own --out: it
# reads the scenario's generator.)
OUTPUTS = {
    "export": ("out", ("configs/metadata.json",), "exported bundle"),
    "synth": ("out", ("scenario.yaml",), "scenario"),
    "prepare": ("out", ("scenario.yaml",), "scenario"),
    "bench": ("out", ("results.csv", "cells"), "bench output"),
    "simulate": ("workspace", ("simulator.log", "ws", "jobs"), "simulate workspace"),
    "provision": ("out", ("project.yml",), "provisioning workspace"),
    "demo": ("out", ("jobs", "ws", "comparison.md"), "demo output"),
}


def check_outputs(args) -> None:
    """Refuse a command's output folder when it is not empty and not the command's earlier output."""
    if args.command not in OUTPUTS:
        return
    from .profile import check_output_dir

    attr, markers, what = OUTPUTS[args.command]
    if getattr(args, attr, None):
        check_output_dir(getattr(args, attr), markers, what, force=args.force,
                         option="--" + attr if attr == "out" else "--workspace")


def _say(msg: str) -> None:
    print(msg, flush=True)


def cmd_synth(args):
    from .data.synthetic import generate
    from .profile import format_summary, load_scenario

    kwargs = {k: v for k, v in (("size", args.size), ("cases", args.cases), ("test_cases", args.test_cases)) if v}
    if args.sites < 1:
        raise ValueError(f"--sites must be >= 1, not {args.sites}")
    if args.family == "medmnist":
        kwargs.update(gamma=args.gamma, labeled=[int(i) - 1 for i in args.labeled.split(",")] if args.labeled else None)
    elif args.family == "mixed":
        if args.labeled:
            raise ValueError("--labeled applies to the medmnist family; the mixed family's roles are fixed (site-1 "
                             "annotates every class, the last site none, the others a share each)")
        kwargs["gamma"] = args.gamma
    if args.missing is not None:
        if args.family != "cxr":
            raise ValueError(f"--missing applies to the cxr family, not {args.family}")
        kwargs["missing"] = args.missing
    root = generate(args.family, args.out, seed=args.seed, sites=args.sites, progress=_say, **kwargs)
    _say(format_summary(load_scenario(root)))
    _say(f"wrote {root}")


def cmd_validate(args):
    from .profile import format_summary, load_scenario

    # A hospital's folder holds only its own site: --site validates that one (and no test split).
    sc = load_scenario(args.data, sites=[args.site] if args.site else None, with_test=not args.site)
    _say(f"{sc.name}: {sc.task}, {len(sc.classes)} classes, {len(sc.sites)} sites, "
         f"{len(sc.test or [])} test cases")
    _say(format_summary(sc))


def cmd_train(args):
    from .bundle.workflows import train_bundle

    ckpt = train_bundle(args.bundle, args.data, args.out, site=args.site, epochs=args.epochs, oracle=args.oracle)
    _say(f"checkpoint: {ckpt}")


def cmd_evaluate(args):
    from .bundle.workflows import evaluate_bundle

    metrics = evaluate_bundle(args.bundle, args.ckpt, args.data, out=args.out, split=args.split)
    _say(json.dumps({k: v for k, v in metrics.items() if k != "per_case"}, indent=1))


def cmd_export(args):
    from .bundle.workflows import export_bundle
    from .run import Run

    if not args.ckpt and not args.run:
        raise ValueError("export needs --ckpt MODEL or --run RUN_DIR (its best global model)")
    # default: the run's best model; with --site-state the last one, whose round the state file's batch norm is from
    ckpt = args.ckpt or Run(args.run).model_path("last" if args.site_state else "best")
    out = export_bundle(args.bundle, ckpt, args.out, data=args.data, run=args.run, site_state=args.site_state,
                        twin=args.twin)
    _say(f"exported bundle: {out}")
    if args.data:
        meta = json.loads(open(os.path.join(out, "configs", "metadata.json")).read())
        _say("decision thresholds (chosen on validation data): "
             + ", ".join(f"{k} {'none (probability only)' if v is None else f'{v:.3f}'}"
                         for k, v in meta["decision_thresholds"].items())
             if meta["training"]["task"] != "multiclass" else "decision: the class with the highest probability")
        _say(f"model card: {os.path.join(out, 'docs', 'README.md')}")


def cmd_bundles(args):
    from .bundle import available, bundle_path

    if args.name:
        _say(str(bundle_path(args.name)))
        return
    for name, folder in available().items():
        _say(f"{name:18s} {folder}")


def cmd_baseline(args):
    from . import references
    from .bundle import bundle_path
    from .flare.commands import comparison_table, label_counts

    bundle = bundle_path(args.bundle)
    if args.kind == "local":
        per_site = references.local(bundle, args.data, args.epochs, batch_size=args.batch_size, seed=args.seed, log=_say)
        results = {f"local {site}": r["test"] for site, r in per_site.items()}
    else:
        results = {args.kind: references.pooled(bundle, args.data, args.epochs, oracle=args.kind == "oracle",
                                                batch_size=args.batch_size, seed=args.seed)}
    table = comparison_table(results, label_counts(args.data))
    _say(table)
    if args.out:
        from .profile import write_json_atomic

        write_json_atomic(args.out, results)


def cmd_methods(args):
    from . import methods

    if not args.data:
        for name in methods.names():
            m = methods.get(name)
            _say(f"{name:14s} {', '.join(m.tasks):28s} {m.doc}")
        return
    # which methods can run on this scenario's sites, and what each does with each site (Method.site_roles)
    from .profile import load_scenario

    summaries = {s: site.summary() for s, site in load_scenario(args.data, with_test=False).sites.items()}
    for name in methods.names():
        m = methods.get(name)
        why = m.refusal(summaries)
        if why:
            _say(f"{name:14s} refused: {why}")
        else:
            roles = m.site_roles(summaries)
            _say(f"{name:14s} runs: " + "; ".join(f"{s} {r}" for s, r in roles.items()))


def build_parser(flare: bool | str = True) -> argparse.ArgumentParser:
    """The ``fedlabels`` parser; ``flare=False`` leaves out the FLARE subcommands (imports nothing heavy);
    ``flare="listing"`` lists them by name and help line only (``FLARE_HELP``), for the top-level help."""
    p = argparse.ArgumentParser(prog="fedlabels", description="Federated learning when every hospital labels differently.")
    p.add_argument("--version", action="version", version=f"fedlabels {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synth", help="generate an embedded synthetic scenario")
    s.add_argument("family", choices=["cxr", "medmnist", "lesion", "mixed"],
                   help="cxr: multi-label chest-X-ray-like, FedPSL Table I's label sets; medmnist: multi-class, "
                        "labeled and unlabeled sites; lesion: segmentation, pixel/box/image/no supervision per site; "
                        "mixed: medmnist's images as one-vs-rest multi-label, site-1 annotating every class, the "
                        "last site none, the sites between a share of the classes each")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--size", type=positive_int, help="image size in pixels")
    s.add_argument("--cases", type=positive_int,
                   help=f"cxr: the cases of a reference site; site k holds round(s_k x N) with s = {CXR_SCALES} "
                        "(cycled), so 4 sites hold 4 N (sites of different sizes, as hospitals are); lesion: cases "
                        "per site; medmnist, mixed: cases in total")
    s.add_argument("--test-cases", type=positive_int)
    s.add_argument("--sites", type=int, default=4,
                   help="number of sites (cxr: site k labels like FedPSL Table I's site k mod 4; mixed: 3 to 10, "
                        "site-1 annotates all 8 classes, the last site none, the sites between deal the classes out "
                        "in contiguous blocks; default 4)")
    s.add_argument("--gamma", type=float, default=0.8, help="medmnist, mixed: Dirichlet label skew")
    s.add_argument("--labeled", help="medmnist: comma-separated site numbers that keep labels (default 1)")
    s.add_argument("--missing", type=int, help="cxr: each site drops this many of the 6 findings and annotates the "
                   "others on every case, every finding at some site (FedMLP's setting; default: FedPSL Table I's sets)")
    s.set_defaults(fn=cmd_synth)

    s = sub.add_parser("validate", help="validate a scenario folder and print its label table")
    s.add_argument("data")
    s.add_argument("--site", help="validate only this site's folder (what one hospital holds)")
    s.set_defaults(fn=cmd_validate)

    from .data import prepare

    prepare.add_parser(sub)

    from .data import importer

    importer.add_parser(sub)

    s = sub.add_parser("train", help="train a bundle locally (one site) or centralized (all sites)")
    s.add_argument("--bundle", required=True)
    s.add_argument("--data", required=True, help="scenario folder")
    s.add_argument("--site", help="train on this site only (default: all sites pooled)")
    s.add_argument("--epochs", type=int, default=None)
    s.add_argument("--oracle", action="store_true", help="use the full (oracle) labels")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("evaluate", help="evaluate a checkpoint with the bundle's metrics")
    s.add_argument("--bundle", required=True)
    s.add_argument("--ckpt", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--split", default="test", help="'test' or a site name (its validation split)")
    s.add_argument("--out", help="where to save metrics JSON")
    s.set_defaults(fn=cmd_evaluate)

    s = sub.add_parser("export", help="turn a checkpoint into a deployable inference bundle")
    s.add_argument("--bundle", required=True)
    s.add_argument("--ckpt", help="the model (default with --run: the run's best global model; with --site-state "
                                   "its last one)")
    s.add_argument("--out", required=True)
    s.add_argument("--run", help="the federated run's server folder: method, rounds and model kind in the metadata")
    s.add_argument("--data", help="scenario folder: decision thresholds from its validation cases, test metrics with "
                                   "confidence intervals, the sites' label table and the model card")
    s.add_argument("--site-state", help="a FedBN site's state folder fedlabels_state/<run>/<site> (or one round-NNNNN.pt in "
                                         "it): export the global model with that site's own batch norm (the "
                                         "global model's was never trained)")
    s.add_argument("--twin", choices=["first", "mean"], default="first",
                   help="a FedMix model (two UNets): ship F1 (default) or both, predicting their mean probability")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("baseline", help="non-federated references: local learning, centralized, oracle")
    s.add_argument("kind", choices=["local", "centralized", "oracle"])
    s.add_argument("--bundle", default="cxr_densenet121")
    s.add_argument("--data", required=True)
    s.add_argument("--epochs", type=int, default=5)
    s.add_argument("--batch-size", type=int)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", help="save the test metrics as JSON")
    s.set_defaults(fn=cmd_baseline)

    s = sub.add_parser("methods", help="list the registered federated methods; with --data, which of them can run "
                                       "on a scenario and what each does with each site")
    s.add_argument("--data", help="a scenario folder: say for each method whether it serves every site "
                                  "(and what it does with each) or why it is refused")
    s.set_defaults(fn=cmd_methods)

    s = sub.add_parser("bundles", help="the MONAI bundles found by name (FEDLABELS_BUNDLES's folders first, then "
                                       "the shipped ones) and their folders")
    s.add_argument("name", nargs="?", help="print only this bundle's folder (e.g. for --bundle_root)")
    s.set_defaults(fn=cmd_bundles)

    from . import bench

    bench.add_parser(sub)

    if flare == LISTING:
        for name, text in FLARE_HELP.items():
            sub.add_parser(name, help=text)
    elif flare:
        from .flare import commands as flare_commands

        flare_commands.add_parsers(sub)
    for name in OUTPUTS.keys() & sub.choices.keys():
        sub.choices[name].add_argument("--force", action="store_true",
                                       help="write into a non-empty output folder that is not an earlier output "
                                            "of this command (what it writes replaces what is there)")
    return p


def _subcommands(parser: argparse.ArgumentParser) -> set:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


def _needs_flare(argv) -> bool | str:
    """Whether parsing ``argv`` needs the FLARE subcommands: yes unless it names another subcommand (or
    asks for the version only); the top-level help (or no argument) lists them only (``LISTING``)."""
    if not argv or argv[0] in ("-h", "--help"):
        return LISTING
    return argv[0] != "--version" and argv[0] not in _subcommands(build_parser(flare=False))


def check_scenario(args) -> None:
    """Validate the scenario of a command that reads one (``--data``); raises ``ScenarioError``."""
    data = getattr(args, "data", None)
    if args.command in SCENARIO_COMMANDS and data:
        from .profile import held_sites, load_scenario

        # export reads the sites a folder holds (an admin's or a hospital's own copy)
        load_scenario(data, sites=held_sites(data) if args.command == "export" else None)


def _scenario_error(exc: BaseException) -> ScenarioError | None:
    """The ScenarioError behind ``exc``, also when a library wrapped it (MONAI's ConfigParser does)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ScenarioError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(flare=_needs_flare(argv)).parse_args(argv)
    try:
        check_scenario(args)
        check_outputs(args)
        args.fn(args)
    except ScenarioError as e:
        print(f"fedlabels: invalid scenario: {_one_line(e)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"fedlabels: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        cause = _scenario_error(e)  # a library (MONAI's ConfigParser) may wrap it
        if cause is not None:
            print(f"fedlabels: invalid scenario: {_one_line(cause)}", file=sys.stderr)
            return 2
        if isinstance(e, RuntimeError):  # a run that failed (e.g. no round aggregated); its log has the rest
            print(f"fedlabels: {_one_line(e)}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
