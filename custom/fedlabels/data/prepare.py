"""``fedlabels prepare``: public datasets -> scenario folders with the papers' site splits.

    fedlabels prepare DATASET --src DIR [--src NAME=DIR ...] --protocol NAME --out DIR [options]
    python -m fedlabels.data.prepare DATASET --src DIR --protocol NAME --out DIR [options]

Datasets (expected layouts and download pages: docs/datasets.md):
  nih            NIH ChestX-ray14 (extra sources: chexpert=, mimic=, tb=, covid=)
  ich            RSNA Intracranial Hemorrhage (DICOM or PNG)
  bloodmnist, pathmnist, pneumoniamnist, organamnist, ... (any 2D MedMNIST .npz;
  "medmnist" with --src FILE.npz for a file of another name)
  breast         BUS (BUSI) + BUSIS + UDIAT
  ham10000       HAM10000 (+ lesion masks)
  ph2            PH2
  retouch        RETOUCH OCT (Cirrus, Topcon, Spectralis)

Protocols: fedpsl-6, fedpsl-8, fedmlp, surgical-sim, surgical-real, isofed,
partial, mixed, fedmix (see fedlabels.data.protocols).

Examples:
  fedlabels prepare bloodmnist --src data/medmnist --protocol isofed --gamma 0.5 --labeled 1 --out scen/blood
  fedlabels prepare bloodmnist --src data/medmnist --protocol isofed --partition rscfed --labeled 1 --out scen/blood-r
  fedlabels prepare nih --src NIH --src tb=TB --src covid=COVID --protocol fedpsl-8 --out scen/fedpsl8
  fedlabels prepare bloodmnist --src data/medmnist --protocol mixed --seed 1 --out scen/blood-mixed
  fedlabels prepare ph2 --src data/ph2 --protocol fedmix --sites 3 --supervision L,B,I --out scen/ph2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from ..profile import ScenarioError
from . import medmnist as M
from .common import PrepareError
from .protocols import PROTOCOLS, Options

# dataset -> (family, default image size; None = keep native)
DATASETS = {
    "nih": ("nih", 224),
    "ich": ("ich", 224),
    "breast": ("breast", 256),
    "ham10000": ("ham10000", 256),
    "ph2": ("ph2", 256),
    "retouch": ("retouch", 256),
    "medmnist": ("medmnist", None),
}
DATASETS.update({name: ("medmnist", None) for name in M.INFO})
ALIASES = {"chestxray14": "nih", "chestx-ray14": "nih", "rsna-ich": "ich", "ham": "ham10000", "bus": "breast"}
EXTRA_SOURCES = ("chexpert", "mimic", "tb", "covid")
VAL_DEFAULTS = {"surgical-sim": 0.125, "surgical-real": 0.125}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="nih | ich | <medmnist set, e.g. bloodmnist> | medmnist | breast | ham10000 | ph2 | retouch")
    p.add_argument("--src", action="append", required=True, metavar="DIR|NAME=DIR",
                   help="the downloaded dataset folder; repeat as NAME=DIR for extra sources "
                        "(chexpert=, mimic=, tb=, covid= for nih; bus=, busis=, udiat= for breast)")
    p.add_argument("--protocol", required=True, choices=sorted(PROTOCOLS))
    p.add_argument("--out", required=True, help="scenario folder to write (replaced atomically)")
    g = p.add_argument_group("common options")
    g.add_argument("--seed", type=int, default=0, help="drives every split and sample (default 0)")
    g.add_argument("--sites", type=int, help="number of sites (protocol default)")
    g.add_argument("--size", type=int, help="image size written, in pixels (default: 224 CXR/CT, 256 "
                   "ultrasound/skin/OCT, native for MedMNIST)")
    g.add_argument("--val-fraction", type=float, help="validation share of each site's cases (default 0.15; surgical 0.125)")
    g.add_argument("--limit", type=int, help="subsample the source to this many cases (fedmix: per site) -- quick runs")
    g.add_argument("--cases", type=int, help="cases per site (fedpsl: default 1000; surgical-sim: per site) or "
                   "training cases in total (fedmlp ICH: default 25000)")
    g.add_argument("--test-cases", type=int, help="cap on the test set size")
    g.add_argument("--test-per-class", type=int, default=300, help="fedpsl: positives and negatives per class in test (300)")
    g.add_argument("--test-fraction", type=float, help="test share when the dataset has no official test split")
    g.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="image conversion processes")
    g.add_argument("--name", help="scenario name (default <dataset>-<protocol>)")
    g.add_argument("--skip-bad", action="store_true", help="leave unreadable images out (listed in provenance) instead of failing")
    g.add_argument("--allow-missing", action="store_true", help="leave out listed images whose file is missing instead of failing")
    g.add_argument("--quiet", action="store_true")
    g = p.add_argument_group("protocol options")
    g.add_argument("--missing", type=int, help="fedmlp/partial: classes removed per site")
    g.add_argument("--gamma", type=float, help="isofed/partial/mixed: Dirichlet label-skew concentration (isofed "
                   "default 0.8; partial, mixed: IID equal shares without it)")
    g.add_argument("--labeled", help="isofed: how many sites keep labels (first N), or site numbers '1,3' (default 1)")
    g.add_argument("--partition", choices=["dirichlet", "rscfed"], default="dirichlet",
                   help="isofed: 'dirichlet' (default): one Dirichlet(gamma) label split over all sites; 'rscfed': "
                        "RSCFed's released split, each labeled site a random block of --labeled-fraction of the "
                        "cases, the rest split over the unlabeled sites by Dirichlet(gamma) with a cap")
    g.add_argument("--labeled-fraction", type=float,
                   help="isofed --partition rscfed: each labeled site's share of the cases (default 0.1, RSCFed's)")
    g.add_argument("--supervision", help="fedmix: per-site level letters, e.g. U,B,L  (L=pixel, B=bbox, I=image-level, U=unlabeled)")
    g.add_argument("--shared", type=int, help="surgical-sim: classes every site annotates (default 0)")
    g.add_argument("--site-classes", help="partial/mixed: classes per site, ';' between sites, e.g. 'a,b;c;d,e' "
                   "(names or indices; '*' every class; mixed: '-' none, e.g. '*;0,1,2,3;4,5,6,7;-')")
    g.add_argument("--folds", type=int, default=5, help="fedmix: cross-validation folds per site (0 = no test split)")
    g.add_argument("--fold", type=int, default=0, help="fedmix: which fold is the test split")
    g.add_argument("--test-split", choices=["paper", "official"], default="paper",
                   help="nih: the paper's random patient-level split, or the official train_val/test lists")
    g.add_argument("--sample", choices=["first", "random"], default="first", help="fedpsl: first N images of each batch (paper) or random N")
    g.add_argument("--subset", type=int, default=180000, help="fedmlp ICH: all hemorrhage images + healthy ones up to this many")
    g.add_argument("--keep-normal", action="store_true", help="fedmix breast: keep all healthy BUS images at BUS")
    g = p.add_argument_group("dataset options")
    g.add_argument("--uncertain", choices=["zeros", "ones", "ignore"], default="zeros",
                   help="CheXpert/MIMIC uncertain labels: negative (default), positive, or not annotated (-1)")
    g.add_argument("--covid-negatives", default="normal",
                   help="COVID-19 database categories used as negatives (comma list of normal, lung_opacity, viral_pneumonia)")
    g.add_argument("--window", default="brain", help="ICH DICOM window: brain | subdural | bone | multi (3-channel) | LEVEL,WIDTH")
    g.add_argument("--download", action="store_true", help="MedMNIST: download the official .npz (MD5-verified) if absent")
    g.add_argument("--strict-checksum", action="store_true", help="MedMNIST: fail when a local file's MD5 is not the official one")


def add_parser(subparsers):
    """Register ``prepare`` on the main CLI's subparsers; dispatches to :func:`run`."""
    p = subparsers.add_parser("prepare", help="turn a downloaded public dataset into a scenario folder",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(fn=run)
    return p


def parse_srcs(values) -> dict:
    out = {}
    for v in values or []:
        name, sep, path = v.partition("=")
        if sep and name and not os.path.exists(v):
            out[name.strip().lower()] = Path(path).expanduser()
        else:
            if "" in out:
                raise PrepareError(f"--src given twice without a name ({out['']} and {v}); name extra sources as NAME=DIR")
            out[""] = Path(v).expanduser()
    return out


def _read_main(dataset: str, family: str, srcs: dict, args, say):
    main = srcs.get("") or srcs.get(dataset)
    if family == "breast":
        from . import breast

        return breast.read(srcs, say)
    if main is None:
        raise PrepareError(f"--src DIR for {dataset} is required")
    if family == "nih":
        from .chestxray import read_nih

        return read_nih(main, allow_missing=args.allow_missing, say=say)
    if family == "ich":
        from . import ich

        return ich.read(main, allow_missing=args.allow_missing, say=say)
    if family == "medmnist":
        name = dataset
        if dataset == "medmnist":
            if not Path(main).is_file():
                raise PrepareError(f"{main}: 'medmnist' needs --src pointing at the .npz file (or use its set name)")
            name = Path(main).stem
        elif args.download and not Path(main).is_file() and not (Path(main) / f"{name}.npz").is_file():
            M.download(name, main, say=say)
        return M.read(main, name, strict_md5=args.strict_checksum)
    if family == "ham10000":
        from .skin import read_ham

        return read_ham(main, need_masks=args.protocol == "fedmix", say=say)
    if family == "ph2":
        from .skin import read_ph2

        return read_ph2(main, say=say)
    if family == "retouch":
        from . import oct

        return oct.read(main, say=say)
    raise PrepareError(f"unknown dataset {dataset!r}")


def _read_extra(name: str, path, args, say):
    from . import chestxray as C

    if name == "chexpert":
        return C.read_chexpert(path, uncertain=args.uncertain, say=say)
    if name == "mimic":
        return C.read_mimic(path, uncertain=args.uncertain, say=say)
    if name == "tb":
        return C.read_tb(path, say=say)
    if name == "covid":
        return C.read_covid(path, negatives=[n.strip() for n in args.covid_negatives.split(",") if n.strip()], say=say)
    raise PrepareError(f"unknown extra source {name!r}")


def options_from_args(args) -> Options:
    return Options(seed=args.seed, sites=args.sites, size=args.size,
                   val_fraction=args.val_fraction if args.val_fraction is not None else VAL_DEFAULTS.get(args.protocol, 0.15),
                   limit=args.limit, cases=args.cases, test_cases=args.test_cases, test_per_class=args.test_per_class,
                   test_fraction=args.test_fraction, missing=args.missing, gamma=args.gamma, labeled=args.labeled,
                   partition=args.partition, labeled_fraction=args.labeled_fraction,
                   supervision=args.supervision, shared=args.shared, site_classes=args.site_classes, folds=args.folds,
                   fold=args.fold, test_split=args.test_split, sample=args.sample, subset=args.subset,
                   keep_normal=args.keep_normal, name=args.name)


def run(args) -> Path:
    """Prepare one scenario from parsed arguments; returns its folder."""
    from .. import progress
    from .build import write_plan

    # the default printer draws a progress bar on a terminal (fedlabels.progress)
    say = (lambda msg: None) if getattr(args, "quiet", False) else progress.say
    dataset = ALIASES.get(args.dataset.lower(), args.dataset.lower())
    if dataset in EXTRA_SOURCES:
        raise PrepareError(f"{dataset} is used together with nih: prepare nih --src NIH_DIR --src {dataset}=DIR ...")
    if dataset not in DATASETS:
        raise PrepareError(f"unknown dataset {args.dataset!r}; choose one of {sorted(set(DATASETS) - set(M.INFO))} "
                           f"or a MedMNIST set {sorted(M.INFO)}")
    family, default_size = DATASETS[dataset]
    fn, families = PROTOCOLS[args.protocol]
    if family not in families:
        raise PrepareError(f"protocol {args.protocol} does not apply to {dataset}; it takes {sorted(families)}")
    srcs = parse_srcs(args.src)
    opts = options_from_args(args)
    sources = {"main": _read_main(dataset, family, srcs, args, say)}
    for name in EXTRA_SOURCES:
        if name in srcs:
            sources[name] = _read_extra(name, srcs[name], args, say)
    unknown = [n for n in srcs if n and n not in EXTRA_SOURCES and n not in ("bus", "busis", "udiat", dataset)]
    if unknown:
        raise PrepareError(f"--src: unknown source name(s) {unknown}; extra sources are {list(EXTRA_SOURCES)}")
    rng = np.random.default_rng(args.seed)
    plan = fn(sources, opts, rng, say)
    if family == "medmnist":
        native = sources["main"].meta.get("native_size")
        plan.size = args.size or native
    else:
        plan.size = args.size or default_size
    if family == "ich":
        plan.window = args.window
        if args.window in ("multi", "rgb"):
            plan.channels = 3
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
               if k not in ("fn", "out", "quiet", "workers", "command")}
    options["src"] = [str(s) for s in args.src]
    return write_plan(plan, args.out, args.seed, workers=max(1, args.workers), say=say, skip_bad=args.skip_bad,
                      command=options)


def build_standalone_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedlabels.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_standalone_parser().parse_args(argv)
    try:
        run(args)
    except ScenarioError as e:
        print(f"fedlabels prepare: the written scenario does not validate: {e}", file=sys.stderr)
        return 2
    except PrepareError as e:
        print(f"fedlabels prepare: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
