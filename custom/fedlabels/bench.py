"""``fedlabels bench``: registered methods side by side, over seeds, with their floor.

```text
fedlabels bench --data DIR|embedded:FAMILY --bundle NAME --methods m1,m2 --seeds 0,1,2 --rounds R
                [--protocol NAME] [--local-epochs E] [--opt METHOD:key=value ...] [--eval-rounds 10,30,100]
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

``--protocol NAME`` trains every row, the floor included, with a paper's
preset (``fedlabels.presets``: the bundle's ``configs/protocols/NAME.json``):
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
"""

from __future__ import annotations

import csv
import inspect
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import progress

EMBEDDED = "embedded:"
FLOOR = "local"          # floor rows are named local:<site>
ORACLE = "oracle:"       # a row oracle:METHOD trains METHOD on every site's full labels
ALL = "all"              # --opt all:key=value applies to every method and the floor
DEFAULT_LR = 1e-3        # the one client lr default of every row
ENGINES = ("inprocess", "flare")
CSV_COLUMNS = ("method", "seed", "round", "model", "split", "group", "class", "metric", "value")
POOLED, MEAN = "pooled", "mean"
# Test metrics per task: (metric, has a per-class value).
TEST_METRICS = {
    "multilabel": (("auroc", True), ("ap", True), ("bacc", True)),
    "multiclass": (("accuracy", False), ("auroc", True), ("precision", True), ("recall", True)),
    "segmentation": (("dice", True), ("dice_present", False), ("empty_correct", False)),
}
# The metric of the per-class plot.
PRIMARY = {"multilabel": "auroc", "multiclass": "auroc", "segmentation": "dice"}


def _say(msg: str) -> None:
    progress.say(msg)


# ---------------------------------------------------------------- parsing


def parse_value(text: str):
    """An option value: JSON when it parses (5e-05 -> float, true -> bool, [0,1] -> list), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _ints(text: str, what: str) -> list:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not an integer (expected a comma-separated list, e.g. 0,1,2)") from None
    return out


def _key_values(items, what: str) -> dict:
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{what} {item!r}: expected key=value")
        out[key.strip()] = parse_value(value.strip())
    return out


def base_method(row: str) -> str:
    """The registered method of a row (``oracle:wfedavg`` -> ``wfedavg``)."""
    return row[len(ORACLE):] if row.startswith(ORACLE) else row


def parse_opts(items) -> list:
    """``METHOD:key=value`` -> [(METHOD, key, value)] in order (METHOD may be ``oracle:NAME``)."""
    out = []
    for item in items or []:
        prefix = ORACLE if item.startswith(ORACLE) else ""
        target, colon, rest = item[len(prefix):].partition(":")
        target = prefix + target
        key, eq, value = rest.partition("=")
        if not colon or not target.strip() or not eq or not key.strip():
            raise ValueError(f"--opt {item!r}: expected METHOD:key=value (METHOD a method of --methods, "
                             f"'{FLOOR}' for the floor rows or '{ALL}')")
        out.append((target.strip(), key.strip(), parse_value(value.strip())))
    return out


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    """Everything a bench run is, checked before any training."""

    data: str
    bundle: Path
    methods: list
    seeds: list
    rounds: int
    local_epochs: int
    eval_rounds: list
    engine: str
    synth: dict
    batch_size: int | None
    out: Path
    network: dict = field(default_factory=dict)    # network_def overrides of every row (e.g. widen_factor)
    image_size: int | None = None                 # the bundle's input size (None: the bundle's own)
    protocol: str | None = None                   # a preset (fedlabels.presets) every row trains with
    overrides: dict = field(default_factory=dict)  # further bundle config overrides (analysis scripts)
    options: dict = field(default_factory=dict)   # method -> {"client": {...}, "server": {...}}
    floor_client: dict = field(default_factory=dict)
    family: str | None = None                     # embedded family
    per_seed_split: bool = False
    datasets: dict = field(default_factory=dict)  # seed -> scenario folder (resolved)
    scenarios: dict = field(default_factory=dict)  # seed -> profile.Scenario
    reuse: list = field(default_factory=list)      # other bench folders whose finished cells may be copied

    @property
    def config(self) -> dict | None:
        """Bundle config overrides of every row (the preset's override file, then the input size)."""
        out = {**({"protocol": self.protocol} if self.protocol else {}),
               **({"image_size": self.image_size} if self.image_size else {}), **self.overrides}
        return out or None

    @property
    def last_round(self) -> int:
        return max(self.eval_rounds)

    def data_for(self, seed: int) -> Path:
        if self.family:
            return self.out / "data" / f"{self.family}-seed{seed}"
        return Path(self.data.replace("{seed}", str(seed))).resolve()


def _route(method, key: str, value, opts: dict) -> None:
    if key in method.client_option_names():
        opts["client"][key] = value
    elif key in method.server_option_names():
        opts["server"][key] = value
    else:
        raise ValueError(f"--opt {method.name}:{key}: method {method.name!r} has no option {key!r}; client options: "
                         f"{sorted(method.client_option_names())}; server options: {sorted(method.server_option_names())}")


def make_plan(args) -> Plan:
    """Check every argument (methods, bundle, rounds, options, engine, synthetic options); no data is touched."""
    from . import methods
    from .bundle import bundle_path

    names = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    if not names:
        raise ValueError("--methods: name at least one method")
    registered = {n: methods.get(base_method(n)) for n in names}  # unknown -> ValueError naming the registered ones
    protocol = getattr(args, "protocol", None)
    preset = None
    if protocol:
        from . import presets

        preset = presets.load(protocol, args.bundle)
        args.rounds = preset.rounds if args.rounds is None else args.rounds
    elif args.bundle is None or args.rounds is None:
        raise ValueError("--bundle and --rounds are required without --protocol (a preset gives both)")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.local_epochs is not None and args.local_epochs < 1:
        raise ValueError(f"--local-epochs must be >= 1, got {args.local_epochs}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    seeds = list(dict.fromkeys(_ints(args.seeds, "--seeds")))
    eval_rounds = sorted(set(_ints(args.eval_rounds, "--eval-rounds"))) if args.eval_rounds else [args.rounds]
    outside = [r for r in eval_rounds if not 1 <= r <= args.rounds]
    if outside:
        raise ValueError(f"--eval-rounds: {outside} outside 1..{args.rounds} (--rounds)")
    if eval_rounds[-1] != args.rounds:  # rounds after the last scored one would train and never be scored
        raise ValueError(f"--eval-rounds: the last scored round {eval_rounds[-1]} is not --rounds {args.rounds} "
                         f"(the run's last round, whose model is also a best-model candidate); give --rounds "
                         f"{eval_rounds[-1]} or add {args.rounds}")
    if args.engine == "flare" and eval_rounds != [args.rounds]:
        raise ValueError(f"--engine flare scores the final round only: drop --eval-rounds or give "
                         f"--eval-rounds {args.rounds} (use --engine inprocess for earlier rounds)")
    bundle = preset.bundle if preset else bundle_path(args.bundle)

    epochs = args.local_epochs or (preset.local_epochs if preset else 1)
    client = dict(preset.client) if preset else {"lr": DEFAULT_LR}
    options = {n: {"client": {**client, "epochs": epochs}, "server": {}} for n in names}
    floor = dict(client)
    floor_rule = methods.get("fedavg_pl")
    # the preset's method options reach the rows whose rules take them (a supervised row has no
    # lr_unlabeled); --opt below still overrides them
    for key, value in (preset.options if preset else {}).items():
        for name in names:
            rule = registered[name]
            if key in rule.client_option_names() or key in rule.server_option_names():
                _route(rule, key, value, options[name])
        if key in floor_rule.client_option_names():
            floor[key] = value
    parsed = parse_opts(args.opt)
    # all: first, so a method's own --opt wins.
    for target, key, value in sorted(parsed, key=lambda t: t[0] != ALL):
        if target not in registered and target not in (FLOOR, ALL):
            raise ValueError(f"--opt {target}:{key}: {target!r} is not one of --methods {names} "
                             f"(or '{FLOOR}' for the floor rows, '{ALL}' for every row)")
        if key == "epochs" and target in (FLOOR, ALL):
            raise ValueError(f"--opt {target}:epochs: set the local epochs of every row with --local-epochs "
                             "(the floor trains eval round x --local-epochs epochs)")
        if key == "epochs" and args.local_epochs is not None:
            raise ValueError(f"--opt {target}:epochs and --local-epochs both set the local epochs; give one")
        if target == FLOOR or target == ALL:
            if key in floor_rule.client_option_names():
                floor[key] = value
            elif target == FLOOR:
                raise ValueError(f"--opt {FLOOR}:{key}: the floor's client (fedavg_pl) has no option {key!r}; "
                                 f"its options: {sorted(floor_rule.client_option_names())}")
        for name in (names if target == ALL else [target] if target in registered else []):
            _route(registered[name], key, value, options[name])

    for name in names:  # the test split scores one global model: FedBN's has no trained batch norm
        if registered[name].client_options(**options[name]["client"]).get("bn_policy") == "fedbn":
            raise ValueError(f"--methods {name}: its sites keep their batch norm, so its global model carries the "
                             "initial one and scoring it on the test split says nothing about the method; "
                             "score a site's own model instead (methods.base.personal_model)")
    synth = _key_values(args.synth, "--synth")
    family = None
    data = str(args.data)
    if data.startswith(EMBEDDED):
        from .data import synthetic

        family = data[len(EMBEDDED):]
        if family not in synthetic.FAMILIES:
            raise ValueError(f"--data {data}: unknown embedded family {family!r}; choose one of "
                             f"{[EMBEDDED + f for f in synthetic.FAMILIES]}")
        allowed = set(inspect.signature(synthetic.generate).parameters) - {"family", "out", "seed", "progress"}
        unknown = sorted(set(synth) - allowed)
        if unknown:
            raise ValueError(f"--synth: unknown option(s) {unknown}; options are {sorted(allowed)}")
    elif synth:
        raise ValueError("--synth applies to embedded data only (--data embedded:FAMILY)")
    network = _key_values(getattr(args, "network", None), "--network")
    image_size = getattr(args, "image_size", None)
    if image_size is not None and image_size < 8:
        raise ValueError(f"--image-size must be >= 8 pixels, got {image_size}")
    reuse = [Path(d).resolve() for d in getattr(args, "reuse", None) or []]
    for d in reuse:
        if not (d / "cells").is_dir():
            raise ValueError(f"--reuse {d}: no cells/ folder there (another fedlabels bench --out folder)")
    return Plan(data=data, bundle=bundle, methods=names, seeds=seeds, rounds=args.rounds, local_epochs=epochs,
                eval_rounds=eval_rounds, engine=args.engine, synth=synth, batch_size=args.batch_size,
                out=Path(args.out).resolve(), options=options, floor_client=floor, family=family,
                per_seed_split=bool(family) or "{seed}" in data, network=network, image_size=image_size,
                protocol=protocol, reuse=reuse)


def prepare_data(plan: Plan) -> None:
    """Generate the embedded scenarios (one per seed) and validate every seed's scenario before any training."""
    from . import methods
    from .profile import load_scenario, write_json_atomic
    from .bundle import read

    for seed in plan.seeds:
        root = plan.data_for(seed)
        if plan.family:
            from .data import synthetic

            marker = root.parent / f".{root.name}.json"
            want = {"family": plan.family, "seed": seed, "synth": plan.synth,
                    "generator": getattr(synthetic, "GENERATOR_VERSION", None)}
            have = json.loads(marker.read_text()) if marker.is_file() and (root / "scenario.yaml").is_file() else None
            if have is not None and have != want and list((plan.out / "cells").glob(f"*-seed{seed}.json")):
                raise ValueError(f"{root} was generated with other options ({have}, now {want}) and finished "
                                 f"cells in {plan.out / 'cells'} were computed on it; use another --out")
            if have != want:
                _say(f"[bench] generating embedded {plan.family} scenario for seed {seed}: {root}")
                try:
                    synthetic.generate(plan.family, root, seed=seed, **plan.synth)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"--synth {plan.synth}: {e}") from None
                write_json_atomic(marker, want)
        sc = load_scenario(root)
        if not sc.test:
            raise ValueError(f"{root}: the scenario has no test split (test/datalist.json): bench scores on it")
        plan.datasets[seed], plan.scenarios[seed] = root, sc
    first = plan.scenarios[plan.seeds[0]]
    for seed, sc in plan.scenarios.items():
        if (sc.task, sc.classes) != (first.task, first.classes):
            raise ValueError(f"{plan.datasets[seed]}: task {sc.task} / classes {list(sc.classes)} differ from "
                             f"{plan.datasets[plan.seeds[0]]} ({first.task} / {list(first.classes)}): seeds must "
                             "split the same problem")
    if plan.network:  # a misspelt network option fails here, not at the first cell
        from .bundle import network

        try:
            network(plan.bundle, plan.network, dataset_dir=plan.datasets[plan.seeds[0]], class_names=list(first.classes),
                    **(plan.config or {}))
        except Exception as e:  # noqa: BLE001 -- MONAI wraps the constructor's TypeError in its own errors
            raise ValueError(f"--network {plan.network}: the bundle's network_def does not take it: "
                             f"{str(e).splitlines()[0]}") from None
    task = read(plan.bundle, plan.datasets[plan.seeds[0]]).get_parsed_content("task")
    if task != first.task:
        raise ValueError(f"bundle {plan.bundle.name}: task {task!r} does not match the scenario's task {first.task!r}")
    for name in plan.methods:
        m = methods.get(base_method(name))
        if first.task not in m.tasks:
            raise ValueError(f"method {name!r} handles {list(m.tasks)}, not the scenario's task {first.task!r}")
    if plan.engine == "flare":
        for seed, sc in plan.scenarios.items():
            expected = [f"site-{i + 1}" for i in range(len(sc.sites))]
            if list(sc.sites) != expected:
                raise ValueError(f"{plan.datasets[seed]}: --engine flare needs sites named {expected} (the "
                                 f"simulator's names), got {list(sc.sites)}")


# ---------------------------------------------------------------- cells


def floor_method(task: str) -> str:
    """The floor's client: the partial loss (fedavg_pl); segmentation: fedavg on pixel-labeled cases."""
    return "fedavg" if task == "segmentation" else "fedavg_pl"


def floor_sites(scenario) -> list:
    """Sites with something a supervised client learns from (labeled cases; segmentation: pixel masks)."""
    from .bundle import data as bundle_data

    out = []
    for name, site in scenario.sites.items():
        if any(bundle_data.bundle_item(i, scenario.task, labeled_only=True) is not None for i in site.training):
            out.append(name)
    return out


def cell_name(method: str, seed: int) -> str:
    return f"{method.replace(':', '_')}-seed{seed}"


@dataclass
class Cell:
    method: str            # a method name or local:<site>
    seed: int
    site: str | None = None  # floor rows: the site

    @property
    def label(self) -> str:
        return f"{self.method} seed {self.seed}"


def cell_config(plan: Plan, cell: Cell) -> dict:
    """What a cell's numbers depend on; a finished cell is reused only when this matches."""
    common = {"method": cell.method, "seed": cell.seed, "data": str(plan.datasets[cell.seed]), "synth": plan.synth,
              "bundle": str(plan.bundle), "rounds": plan.rounds, "eval_rounds": plan.eval_rounds,
              "batch_size": plan.batch_size, "local_epochs": plan.local_epochs,
              **({"network": plan.network} if plan.network else {}),
              **({"image_size": plan.image_size} if plan.image_size else {}),
              **({"protocol": plan.protocol} if plan.protocol else {})}
    if cell.site:
        sc = plan.scenarios[cell.seed]
        return {**common, "client": floor_method(sc.task), "client_options": plan.floor_client}
    return {**common, "engine": plan.engine, "client_options": plan.options[cell.method]["client"],
            "server_options": plan.options[cell.method]["server"]}


def cells(plan: Plan) -> list:
    out = []
    for seed in plan.seeds:
        out += [Cell(m, seed) for m in plan.methods]
        out += [Cell(f"{FLOOR}:{s}", seed, s) for s in floor_sites(plan.scenarios[seed])]
    return out


class Scorer:
    """Test-split metrics of one scenario: pooled (``references.score``) and per test-item ``group``."""

    def __init__(self, bundle, data, network_overrides=None, config=None):
        from monai.data import DataLoader
        from torch.utils.data import Subset

        from .profile import load_scenario
        from .bundle import network
        from .site import test_loader

        sc = load_scenario(data, sites=[], with_test=True)
        self.task, self.classes = sc.task, sc.classes
        self.loader = test_loader(bundle, data, config=config)
        self.net = network(bundle, network_overrides or None, dataset_dir=data, class_names=list(sc.classes),
                           **(config or {}))
        self.n = len(sc.test)
        self.groups = {POOLED: self.loader}
        names = [i.get("group", i.get("site")) for i in sc.test]  # prepared scenarios name a test item's site
        if any(g is not None for g in names):
            names = ["(no group)" if n is None else str(n) for n in names]
            for g in sorted(set(names)):
                idx = [i for i, n in enumerate(names) if n == g]
                self.groups[g] = DataLoader(Subset(self.loader.dataset, idx), batch_size=self.loader.batch_size,
                                            shuffle=False, num_workers=0)

    def __call__(self, weights) -> list:
        """[(group, class, metric, value)]; value None where the metric is undefined."""
        from .methods.base import load_weights
        from .nets import first_of_twin
        from .site import evaluate

        load_weights(self.net, first_of_twin(weights))  # FedMix's two UNets: F1 is scored, as it ships
        out = []
        for group, loader in self.groups.items():
            result = evaluate(self.net, loader, self.task, self.classes)
            for metric, per_class in TEST_METRICS[self.task]:
                if per_class:
                    for cls in self.classes:
                        value = (result.get("per_class", {}).get(cls) or {}).get(metric)
                        out.append((group, cls, metric, value))
                out.append((group, MEAN, metric, result.get(metric)))
        return out


def _rows(cell: Cell, rnd: int, model: str, scored: list) -> list:
    return [{"method": cell.method, "seed": cell.seed, "round": rnd, "model": model, "split": "test", "group": g,
             "class": c, "metric": m, "value": None if v is None else float(v)} for g, c, m, v in scored]


def _copy(weights: dict) -> dict:
    import numpy as np

    return {k: np.array(v, copy=True) for k, v in weights.items()}


def _jsonable(obj):
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def run_federated_inprocess(plan: Plan, cell: Cell, scorer: Scorer, log) -> dict:
    """``references.federate``; the last model at each eval round and the best on site validation so far."""

    from . import references
    from .config import KEY_METRICS

    data, opts = plan.datasets[cell.seed], plan.options[cell.method]
    key = KEY_METRICS[plan.scenarios[cell.seed].task]
    method = base_method(cell.method)
    setups = references.setups(plan.bundle, data, batch_size=plan.batch_size, seed=cell.seed, method=method,
                               oracle=cell.method.startswith(ORACLE), network_overrides=plan.network or None,
                               config=plan.config)
    captured = {}

    def on_round(record, weights, best):
        r = record["round"] + 1
        if r in plan.eval_rounds:
            captured[r] = {"last": _copy(weights), "best": _copy(best)}

    result = references.federate(method, setups, plan.rounds, seed=cell.seed, log=log,
                                 client_options=opts["client"], server_options=opts["server"], on_round=on_round)
    # The final model is a best-model candidate too (validated at every site after the last round).
    captured[plan.rounds]["best"] = result["best"]
    rows = []
    for r in plan.eval_rounds:
        for model in ("last", "best"):
            rows += _rows(cell, r, model, scorer(captured[r][model]))
    return {"rows": rows, "records": result["records"], "key_metric": key}


def run_federated_flare(plan: Plan, cell: Cell, scorer: Scorer, log) -> dict:
    """The same method as a FLARE job in the simulator; its last and best global models scored."""
    from .config import KEY_METRICS
    from .bundle.workflows import load_state_dict
    from .flare.simulator import simulate
    from .flare.job import JobSpec, export

    data, opts, sc = plan.datasets[cell.seed], plan.options[cell.method], plan.scenarios[cell.seed]
    spec = JobSpec(name=f"bench_{cell_name(cell.method, cell.seed)}", method=base_method(cell.method),
                   oracle=cell.method.startswith(ORACLE), bundle=str(plan.bundle),
                   family=plan.family or "cxr", rounds=plan.rounds, sites=len(sc.sites), client=dict(opts["client"]),
                   server=dict(opts["server"]), seed=cell.seed, batch_size=plan.batch_size,
                   network=dict(plan.network), image_size=plan.image_size, protocol=plan.protocol)
    work = plan.out / "flare" / cell_name(cell.method, cell.seed)
    job_dir = export(spec, work / "jobs")
    log(f"FLARE simulator, {len(sc.sites)} sites x {plan.rounds} rounds; log: {work / 'simulator.log'}")
    run_dir = simulate(job_dir, work / "ws", len(sc.sites), data=data, log=work / "simulator.log")
    models = {"last": "FL_global_model.pt", "best": "best_FL_global_model.pt"}
    rows = []
    for model, fname in models.items():
        rows += _rows(cell, plan.rounds, model, scorer(load_state_dict(run_dir / "app_server" / fname)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"rows": rows, "records": records, "key_metric": KEY_METRICS[sc.task], "run_dir": str(run_dir)}


def run_floor(plan: Plan, cell: Cell, scorer: Scorer, log) -> dict:
    """One site alone (``references.local``'s recipe), trained on to each eval round: round r = r x E epochs."""
    from . import methods
    from .methods.base import to_numpy
    from .site import setup_site

    sc = plan.scenarios[cell.seed]
    st = setup_site(plan.bundle, plan.datasets[cell.seed], cell.site, batch_size=plan.batch_size, seed=cell.seed,
                    network_overrides=plan.network or None, config=plan.config)
    first = plan.eval_rounds[0] * plan.local_epochs
    client = methods.get(floor_method(sc.task)).make_client(st.net, st.context(), **{**plan.floor_client,
                                                                                      "epochs": first})
    rows, done = [], 0
    for i, r in enumerate(plan.eval_rounds):
        client.epochs = (r - done) * plan.local_epochs
        update = client.train(to_numpy(st.net.state_dict()), i)
        done = r
        loss = progress.number(update.metrics.get("train_loss"))
        log(f"[{cell.method}] {r * plan.local_epochs} epochs: train_loss={loss}")
        rows += _rows(cell, r, "last", scorer(to_numpy(st.net.state_dict())))
    total = sum(s.summary()["cases"] for s in sc.sites.values())
    cases = sc.site(cell.site).summary()["cases"]
    return {"rows": rows, "records": [], "share": cases / total, "cases": cases, "total_cases": total}


# ---------------------------------------------------------------- run


def _cell_path(plan: Plan, cell: Cell) -> Path:
    return plan.out / "cells" / f"{cell_name(cell.method, cell.seed)}.json"


def _where_free(config: dict) -> dict:
    """A cell's settings with its split and bundle named by their folders: a checkout moved to another place
    (or cells computed on another machine) holds the same split under another absolute path."""
    return {k: Path(v).name if k in ("data", "bundle") and isinstance(v, str) and not v.startswith("embedded:")
            else v for k, v in config.items()}


def _differences(plan: Plan, cell: Cell, saved: dict) -> list:
    """(setting, saved value, value now) where a saved cell differs from ``cell`` in this plan (none: it can
    stand for it)."""
    want = _where_free(_jsonable(cell_config(plan, cell)))
    have = _where_free(saved.get("config", {}))
    return [(k, have.get(k), want.get(k)) for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]


def _reused(plan: Plan, cell: Cell, path: Path) -> dict | None:
    """A finished cell of the same name and settings in a ``--reuse`` folder, copied to ``path``. (An ablation
    run of a plan shares its floor cells with the main run: the same split, bundle and floor settings.)"""
    from .profile import write_json_atomic

    for folder in plan.reuse:
        there = folder / "cells" / path.name
        try:
            saved = json.loads(there.read_text())
        except (OSError, json.JSONDecodeError):  # missing or unreadable there: it is not a finished cell
            continue
        if not _differences(plan, cell, saved):
            write_json_atomic(path, saved)
            _say(f"[bench] {cell.label}: reused from {there}")
            return saved
    return None


def _check_finished(plan: Plan, todo: list) -> dict:
    """Finished cells whose settings match (here, or copied from a ``--reuse`` folder); refuse (before
    training) one here computed with other settings."""
    done = {}
    for cell in todo:
        path = _cell_path(plan, cell)
        if not path.is_file():
            saved = _reused(plan, cell, path)
            if saved is not None:
                done[(cell.method, cell.seed)] = saved
            continue
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); remove it to recompute the cell") from None
        diff = _differences(plan, cell, saved)
        if diff:
            shown = ", ".join(f"{k}: {have!r} there, {want!r} now" for k, have, want in diff[:3])
            raise ValueError(f"{path}: computed with other settings ({shown}); use another --out or remove the file")
        done[(cell.method, cell.seed)] = saved
    return done


def run(plan: Plan) -> dict:
    """Every cell (finished ones skipped), then results.csv, results.md and the plots."""
    from .profile import write_json_atomic

    t_start = time.time()
    todo = cells(plan)
    results = _check_finished(plan, todo)
    scorers = {}

    def stamp():
        s = int(time.time() - t_start)
        return f"[bench {s // 60:02d}:{s % 60:02d}]"

    # cells done in an earlier run advance the count but not the time estimate
    bar = progress.Progress(len(todo), "cells", prefix="[bench] ")
    for i, cell in enumerate(todo, 1):
        where = f"(cell {i}/{len(todo)})"
        if (cell.method, cell.seed) in results:
            _say(f"{stamp()} {cell.label}: skipped (done) {where}")
            bar.step(cell.label, counted=False)
            continue
        _say(f"{stamp()} {cell.label}: start {where}")
        bar.doing(cell.label)
        t0 = time.time()
        data = plan.datasets[cell.seed]
        if data not in scorers:
            scorers[data] = Scorer(plan.bundle, data, plan.network, plan.config)

        def log(msg, _seed=cell.seed):
            _say(f"    seed {_seed} {msg}")

        if cell.site:
            out = run_floor(plan, cell, scorers[data], log)
        elif plan.engine == "flare":
            out = run_federated_flare(plan, cell, scorers[data], log)
        else:
            out = run_federated_inprocess(plan, cell, scorers[data], log)
        out.update(config=cell_config(plan, cell), seconds=time.time() - t0)
        out = _jsonable(out)
        write_json_atomic(_cell_path(plan, cell), out)
        results[(cell.method, cell.seed)] = out
        metric = PRIMARY[plan.scenarios[cell.seed].task]
        value = next((r["value"] for r in out["rows"] if r["round"] == plan.last_round and r["model"] == "last"
                      and r["group"] == POOLED and r["class"] == MEAN and r["metric"] == metric), None)
        shown = "n/a" if value is None else f"{value:.3f}"
        _say(f"{stamp()} {cell.label}: done in {out['seconds']:.1f}s; test mean {metric} {shown} (last model, "
             f"round {plan.last_round}) {where}")
        bar.step(cell.label)
    bar.close()
    ordered = [results[(c.method, c.seed)] for c in todo]
    rows = [r for cell in ordered for r in cell["rows"]]
    write_csv(plan.out / "results.csv", rows)
    md = markdown(plan, todo, results)
    (plan.out / "results.md").write_text(md)
    pngs = plot(plan, todo, results)
    _say(f"{stamp()} wrote {plan.out / 'results.csv'} ({len(rows)} rows), {plan.out / 'results.md'}, "
         f"{len(pngs)} plot(s) in {plan.out / 'plots'}")
    return {"rows": rows, "markdown": md, "plots": pngs}


def write_csv(path: Path, rows: list) -> None:
    from .profile import write_atomic

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "value": "" if r["value"] is None else repr(float(r["value"]))})
    write_atomic(path, buf.getvalue().encode())


# ---------------------------------------------------------------- reporting


def _stats(values: list):
    """(mean, sd, n) over the defined values; sd is the sample sd (n - 1), None for one value."""
    import numpy as np

    vals = [v for v in values if v is not None]
    if not vals:
        return None, None, 0
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None), len(vals)


def _fmt(values: list, seeds: int) -> str:
    mean, sd, n = _stats(values)
    if mean is None:
        return "n/a"
    text = f"{mean:.3f}" if sd is None else f"{mean:.3f} ± {sd:.3f}"
    return text + (f" ({n}/{seeds})" if n < seeds and seeds > 1 else "")


def _row_labels(plan: Plan, todo: list, results: dict) -> list:
    """(row label, method, model) in table order: the methods (last, best), then the floor rows."""
    out = [(f"{m} · {model}", m, model) for m in plan.methods for model in ("last", "best")]
    floors = list(dict.fromkeys(c.method for c in todo if c.site))
    for f in sorted(floors, key=lambda name: _site_order(name)):
        shares = [results[(c.method, c.seed)]["share"] for c in todo if c.method == f]
        share = (f"{100 * shares[0]:.0f}%" if max(shares) - min(shares) < 0.005
                 else f"{100 * min(shares):.0f}-{100 * max(shares):.0f}%")
        out.append((f"{f} ({share} of training cases)", f, "last"))
    return out


def _site_order(name: str):
    tail = name.rsplit("-", 1)[-1]
    return (0, int(tail), name) if tail.isdigit() else (1, 0, name)


def _values(rows_by_key: dict, method, model, rnd, group, cls, metric, seeds) -> list:
    return [rows_by_key.get((method, s, rnd, model, group, cls, metric)) for s in seeds]


def markdown(plan: Plan, todo: list, results: dict) -> str:
    from .config import KEY_METRICS

    first = plan.scenarios[plan.seeds[0]]
    task, classes = first.task, list(first.classes)
    rows = [r for c in todo for r in results[(c.method, c.seed)]["rows"]]
    by_key = {(r["method"], r["seed"], r["round"], r["model"], r["group"], r["class"], r["metric"]): r["value"]
              for r in rows}
    groups = list(dict.fromkeys(r["group"] for r in rows))
    rnd, seeds, n = plan.last_round, plan.seeds, len(plan.seeds)
    labels = _row_labels(plan, todo, results)
    counts = {c: sum(c in s.profile.annotated for s in first.sites.values()) for c in classes}
    key = KEY_METRICS[task]
    opts = "; ".join(f"{m}: client {plan.options[m]['client']}" + (f", server {plan.options[m]['server']}"
                                                                    if plan.options[m]["server"] else "")
                     for m in plan.methods)
    lines = [f"# fedlabels bench: {', '.join(plan.methods)} on {plan.data}", ""]
    if plan.family:
        synth = " ".join(f"{k}={v}" for k, v in plan.synth.items()) or "defaults"
        split = (f"each seed its own split: the embedded `{plan.family}` scenario generated with that seed "
                 f"(synthetic options: {synth})")
    elif plan.per_seed_split:
        split = f"each seed its own prepared split (`{plan.data}` with {{seed}} = the seed)"
    else:
        split = "split fixed: seeds vary initialisation and order only"
    lines += [
        f"- **{n} seed(s)** ({', '.join(map(str, seeds))}), {len(set(map(str, plan.datasets.values())))} "
        f"split(s): {split}.",
        f"- Bundle `{plan.bundle.name}`, engine `{plan.engine}`, {plan.rounds} round(s) x {plan.local_epochs} local "
        f"epoch(s), batch size {plan.batch_size or 'the bundle default'}; client lr {DEFAULT_LR} for every row "
        "unless set below.",
        f"- Options: {opts}; floor: client {floor_method(task)} {plan.floor_client}.",
        f"- Test split: {len(first.test)} fully labeled cases (seed {seeds[0]}); scored at round {rnd}"
        + (f" (eval rounds {plan.eval_rounds})" if len(plan.eval_rounds) > 1 else "") + "; cells are mean ± sd "
        "over seeds (sample sd; (k/n): defined for k of n seeds -- a class without positives and negatives in "
        "the scored cases is undefined, never 0).",
        "- `last`: the global model after the round; `best`: the global model the sites received with the best "
        f"mean site-validation `{key}` so far (never chosen on test data)"
        + "; at the last round the final model, validated at every site, is a candidate too.",
        f"- Floor `{FLOOR}:site-k`: that site alone ({floor_method(task)} client, {rnd} x {plan.local_epochs} "
        "epoch(s)), with its share of all sites' training cases.",
        f"- Column heads: class (number of sites annotating it, seed {seeds[0]}).",
        "",
    ]
    for group in groups:
        for metric, per_class in TEST_METRICS[task]:
            cols = ([c for c in classes] if per_class else []) + [MEAN]
            heads = [f"{c} ({counts[c]})" if c in counts else c for c in cols]
            title = "pooled test split" if group == POOLED else f"test group `{group}`"
            lines += [f"## {metric} -- {title}, round {rnd}", "",
                      "| row | " + " | ".join(heads) + " |", "|---|" + "---|" * len(cols)]
            for label, method, model in labels:
                cells_ = [_fmt(_values(by_key, method, model, rnd, group, c, metric, seeds), n) for c in cols]
                lines.append(f"| {label} | " + " | ".join(cells_) + " |")
            lines.append("")
    if len(plan.eval_rounds) > 1:
        metric = PRIMARY[task]
        lines += [f"## mean {metric} over eval rounds -- pooled test split", "",
                  "| row | " + " | ".join(f"round {r}" for r in plan.eval_rounds) + " |",
                  "|---|" + "---|" * len(plan.eval_rounds)]
        for label, method, model in labels:
            lines.append(f"| {label} | " + " | ".join(
                _fmt(_values(by_key, method, model, r, POOLED, MEAN, metric, seeds), n) for r in plan.eval_rounds)
                + " |")
        lines.append("")
    secs = [results[(c.method, c.seed)].get("seconds", 0.0) for c in todo]
    lines += [f"{len(todo)} cells, {sum(secs):.0f} s of training and scoring in all. Plots: `plots/`; every "
              "number: `results.csv`; per cell: `cells/`.", ""]
    return "\n".join(lines)


def plot(plan: Plan, todo: list, results: dict) -> list:
    """Per-class bars (mean ± sd over seeds) and the validation metric per round; PNGs under OUT/plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    from .config import KEY_METRICS

    out = plan.out / "plots"
    out.mkdir(parents=True, exist_ok=True)
    first = plan.scenarios[plan.seeds[0]]
    task, classes = first.task, list(first.classes)
    metric, rnd, seeds = PRIMARY[task], plan.last_round, plan.seeds
    rows = [r for c in todo for r in results[(c.method, c.seed)]["rows"]]
    by_key = {(r["method"], r["seed"], r["round"], r["model"], r["group"], r["class"], r["metric"]): r["value"]
              for r in rows}
    groups = list(dict.fromkeys(r["group"] for r in rows))
    labels = _row_labels(plan, todo, results)
    written = []
    cols = classes + [MEAN]
    for group in groups:
        for model in ("last", "best"):
            chosen = [(lab, m, mod) for lab, m, mod in labels if mod == model or m.startswith(f"{FLOOR}:")]
            fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cols) * max(1, len(chosen)) / 3), 4.5))
            width = 0.8 / max(1, len(chosen))
            x = np.arange(len(cols))
            for j, (lab, m, mod) in enumerate(chosen):
                stats = [_stats(_values(by_key, m, mod, rnd, group, c, metric, seeds)) for c in cols]
                means = [s[0] if s[0] is not None else np.nan for s in stats]
                sds = [s[1] if s[1] is not None else 0.0 for s in stats]
                floor = m.startswith(f"{FLOOR}:")
                ax.bar(x + (j - (len(chosen) - 1) / 2) * width, means, width, yerr=sds, capsize=2,
                       label=lab if floor else m, hatch="//" if floor else None, alpha=0.55 if floor else 0.9)
            ax.set_xticks(x)
            ax.set_xticklabels(cols, rotation=30, ha="right")
            ax.set_ylabel(f"test {metric}")
            ax.set_ylim(0, 1.05)
            ax.set_title(f"test {metric} per class, {group}, {model} model, round {rnd} "
                         f"(mean ± sd over {len(seeds)} seed(s))", fontsize=9)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            fig.tight_layout()
            path = out / f"test_{metric}_{_slug(group)}_{model}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    key = KEY_METRICS[task]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    drawn = False
    for m in plan.methods:
        curves = {}
        for s in seeds:
            for rec in results[(m, s)].get("records", []):
                if rec.get(f"mean_{key}") is not None:
                    curves.setdefault(rec["round"], []).append(rec[f"mean_{key}"])
        if not curves:
            continue
        xs = sorted(curves)
        mean = np.array([np.mean(curves[r]) for r in xs])
        sd = np.array([np.std(curves[r], ddof=1) if len(curves[r]) > 1 else 0.0 for r in xs])
        ax.plot(xs, mean, marker="o", ms=3, label=m)
        ax.fill_between(xs, mean - sd, mean + sd, alpha=0.2)
        drawn = True
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("round (the global model the sites received: after that many rounds)")
    ax.set_ylabel(f"mean site-validation {key}")
    ax.set_title(f"validation {key} per round (mean ± sd over {len(seeds)} seed(s))", fontsize=9)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no round reported {key}", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    path = out / f"validation_{key}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in str(text))


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
    s.add_argument("--bundle", help="bundle name under bundles/ or a bundle folder (default: the --protocol's)")
    s.add_argument("--protocol", help="a paper's preset (fedlabels.presets, e.g. isofed, isofed_rscfed, fedmix): "
                                      "input scaling, augmentation, network, optimizer, batch, epochs, rounds and "
                                      "method options of every row")
    s.add_argument("--methods", required=True, help="comma-separated registered methods (fedlabels methods)")
    s.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    s.add_argument("--rounds", type=int, help="federated rounds R (required without --protocol)")
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
