"""``fedlabels bench``: registered methods side by side, over seeds, with their floor.

```text
fedlabels bench --data DIR|embedded:FAMILY --bundle NAME --methods m1,m2 --seeds 0,1,2 --rounds R
                [--preset NAME] [--local-epochs E] [--opt METHOD:key=value ...] [--eval-rounds 10,30,100]
                [--engine inprocess|flare] [--synth key=value ...] [--batch-size B]
                [--network key=value ...] [--image-size N] --out OUT
```

A *cell* is one method (or one floor row) and one seed. Each federated cell
trains the method for R rounds and scores the global model on the scenario's
fully labeled test split at every eval round: the last model (``last``) and
the best one so far on the sites' validation data (``best``, never chosen on
test data). Every table carries its floor: each labeled site trained alone
(``local:site-k``; the ``fedavg_pl`` client's partial loss, as
``references.local``; segmentation: the ``fedavg`` client on the site's
pixel-labeled cases) for eval-round x E epochs.

A row ``oracle:METHOD`` runs METHOD with every site's full labels (the
scenario's ``oracle.json``): the upper bound of a label-scarce split, on the
same split (e.g. ``oracle:wfedavg``, IsoFed's "wFedAvg (UB)").

Every row, the floor included, trains the same network (``--network``: the
bundle's ``network_def`` options, e.g. ``widen_factor=0.25``) at the same
input size (``--image-size``). Every method gets the same client options unless ``--opt`` says otherwise:
lr 1e-3 (``DEFAULT_LR``; the bundles set none for federated training) and
E local epochs, so rows differ only in the method. ``--opt`` names are routed
to the method's client or server rule by name (``all:`` = every method and
the floor, ``local:`` = the floor); an unknown name stops the run before any
training.

``--preset NAME`` trains every row, the floor included, with a paper's
preset (``fedlabels.presets``: the bundle's ``configs/presets/NAME.json``):
its input scaling and size, augmentations, network and batch size, and its
optimizer, lr, weight decay, optimizer reset, local epochs and rounds as the
defaults that ``--rounds``, ``--local-epochs``, ``--batch-size`` and ``--opt``
override. ``--bundle`` defaults to the preset's bundle.

Seeds redraw the split where the data allows it: ``embedded:FAMILY`` generates
one scenario per seed (``OUT/data/FAMILY-seedS``, with the ``--synth``
options), a DIR containing ``{seed}`` reads one prepared split per seed;
a plain DIR is one fixed split (seeds then vary initialisation and order only).

Engines: ``inprocess`` runs ``references.federate`` (the round engine with
direct calls); ``flare`` exports a job (``flare.job.JobSpec``) and runs it in
the FLARE simulator, then scores ``FL_global_model.pt`` (last) and
``best_FL_global_model.pt``; it scores the final round only.

Outputs: ``OUT/cells/<cell>-seed<s>.json`` (one per finished cell, written
atomically; a rerun skips finished cells and refuses cells computed with
other settings; ``--reuse DIR`` copies a missing cell from another bench folder
when its settings are the same), ``OUT/results.csv`` (long format), ``OUT/results.md``
(mean ± sd over seeds) and ``OUT/plots/*.png``.

Modules: ``plan`` (the options checked into a ``Plan`` before anything trains; the per-seed scenarios),
``cells`` (training and scoring each cell, in process or in the simulator; kept, reused, never recomputed),
``report`` (``results.md`` and the plots); the command line is here.
"""

from __future__ import annotations

# the package's API: the plan and its cells, as the command line and the benchmarks use them
from .cells import (Cell, cell_config, cells, run, run_federated_flare,  # noqa: F401
                    run_federated_inprocess, run_floor)
from .plan import (ALL, CSV_COLUMNS, ENGINES, FLOOR, MEAN, ORACLE, POOLED, TEST_METRICS, Plan, base_method,
                   make_plan, prepare_data)  # noqa: F401

# ---------------------------------------------------------------- command line

HELP = ("Compare registered methods over seeds on one scenario, each with its floor (every labeled site trained "
        "alone). Engines: inprocess (references.federate; any --eval-rounds) or flare (the FLARE simulator; "
        "scores the final round only, so --eval-rounds must be R or left out).")


def add_parser(sub) -> None:
    s = sub.add_parser("bench", help="methods side by side over seeds, with local-learning floors",
                       description=HELP)
    s.add_argument("--data", required=True,
                   help="scenario folder; with '{seed}' in it, one prepared split per seed "
                        "(e.g. data/blood-seed{seed}); or embedded:cxr|medmnist|lesion (one generated split per seed)")
    s.add_argument("--bundle", help="bundle name under bundles/ or a bundle folder (default: the --preset's)")
    s.add_argument("--preset", help="a paper's preset (fedlabels.presets, e.g. isofed, isofed_rscfed, fedmix): "
                                      "input scaling, augmentation, network, optimizer, batch, epochs, rounds and "
                                      "method options of every row")
    s.add_argument("--methods", required=True, help="comma-separated registered methods (fedlabels methods)")
    s.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    s.add_argument("--rounds", type=int, help="federated rounds R (required without --preset)")
    s.add_argument("--local-epochs", type=int, help="local epochs per round (client option epochs; default 1)")
    s.add_argument("--opt", action="append", metavar="METHOD:key=value",
                   help="a method's client or server option (routed by name; values parsed as JSON when they "
                        f"parse); METHOD '{FLOOR}' = the floor rows, '{ALL}' = every row; repeatable")
    s.add_argument("--eval-rounds", help="comma-separated rounds in 1..R to score (default R; flare: R only)")
    s.add_argument("--engine", choices=ENGINES, default="inprocess",
                   help="inprocess (default) or flare (FLARE simulator; final round only)")
    s.add_argument("--synth", action="append", metavar="key=value",
                   help="embedded data option of fedlabels.data.synthetic.generate (e.g. cases=16); repeatable")
    s.add_argument("--batch-size", type=int, help="batch size (default: the bundle's)")
    s.add_argument("--network", action="append", metavar="key=value",
                   help="network option of every row, e.g. widen_factor=0.25 (the bundle's network_def arguments)")
    s.add_argument("--image-size", type=int, help="input size in pixels of every row (default: the bundle's)")
    s.add_argument("--out", required=True, help="output folder (results.csv, results.md, plots/, cells/)")
    s.add_argument("--reuse", action="append", metavar="DIR",
                   help="another bench --out folder: a cell not finished here whose file there has the same "
                        "settings is copied instead of trained (e.g. an ablation's floor rows); repeatable")
    s.set_defaults(fn=cmd_bench)


def cmd_bench(args) -> None:
    plan = make_plan(args)
    prepare_data(plan)
    run(plan)
