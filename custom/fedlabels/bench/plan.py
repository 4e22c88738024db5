"""What a ``fedlabels bench`` run is: its options parsed and checked into a ``Plan`` (before anything
trains), and the per-seed scenario folders it reads prepared."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import progress
from ..scoring import MEAN, POOLED, TEST_METRICS  # noqa: F401 (names of the plan's results)

EMBEDDED = "embedded:"
FLOOR = "local"          # floor rows are named local:<site>
ORACLE = "oracle:"       # a row oracle:METHOD trains METHOD on every site's full labels
ALL = "all"              # --opt all:key=value applies to every method and the floor
DEFAULT_LR = 1e-3        # the one client lr default of every row
ENGINES = ("inprocess", "flare")
CSV_COLUMNS = ("method", "seed", "round", "model", "split", "group", "class", "metric", "value")
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


def floor_method(task: str) -> str:
    """The floor's client: the partial loss (fedavg_pl); segmentation: fedavg on pixel-labeled cases."""
    return "fedavg" if task == "segmentation" else "fedavg_pl"



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
    preset: str | None = None                     # a preset (fedlabels.presets) every row trains with
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
        out = {**({"preset": self.preset} if self.preset else {}),
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
    from .. import methods
    from ..bundle import bundle_path

    names = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    if not names:
        raise ValueError("--methods: name at least one method")
    registered = {n: methods.get(base_method(n)) for n in names}  # unknown -> ValueError naming the registered ones
    preset_name = getattr(args, "preset", None)
    preset = None
    if preset_name:
        from .. import presets

        preset = presets.load(preset_name, args.bundle)
        args.rounds = preset.rounds if args.rounds is None else args.rounds
    elif args.bundle is None or args.rounds is None:
        raise ValueError("--bundle and --rounds are required without --preset (a preset gives both)")
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
    # the preset's settings and method options reach the rows whose rules take them (presets.Preset.rule_options);
    # --opt below still overrides them
    options = {}
    for name in names:
        given = preset.rule_options(registered[name]) if preset else {"client": dict(client), "server": {}}
        options[name] = {"client": {**given["client"], "epochs": epochs}, "server": given["server"]}
    floor = dict(client)
    floor_rule = methods.get("fedavg_pl")
    for key, value in (preset.options if preset else {}).items():
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
        from ..data import synthetic

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
                preset=preset_name, reuse=reuse)


def full_summary(site) -> dict:
    """The label summary a site would send with its oracle labels (an ``oracle:`` row): every class annotated."""
    from ..profile import label_summary

    profile = site.profile
    full = replace(profile, annotated=profile.classes,
                   supervision="pixel" if profile.task == "segmentation" else "image")
    return label_summary(full, site.oracle()["training"])


def prepare_data(plan: Plan) -> None:
    """Generate the embedded scenarios (one per seed) and validate every seed's scenario before any training."""
    from .. import methods
    from ..profile import load_scenario, write_json_atomic
    from ..bundle import read

    for seed in plan.seeds:
        root = plan.data_for(seed)
        if plan.family:
            from ..data import synthetic

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
        from ..bundle import network

        try:
            network(plan.bundle, plan.network, dataset_dir=plan.datasets[plan.seeds[0]], class_names=list(first.classes),
                    **(plan.config or {}))
        except Exception as e:  # noqa: BLE001 -- MONAI wraps the constructor's TypeError in its own errors
            raise ValueError(f"--network {plan.network}: the bundle's network_def does not take it: "
                             f"{str(e).splitlines()[0]}") from None
    task = read(plan.bundle, plan.datasets[plan.seeds[0]]).get_parsed_content("task")
    if task != first.task:
        raise ValueError(f"bundle {plan.bundle.name}: task {task!r} does not match the scenario's task {first.task!r}")
    for name in plan.methods:  # each row's method must serve every site of every seed (oracle rows: full labels)
        m = methods.get(base_method(name))
        for seed, sc in plan.scenarios.items():
            summaries = {s: (full_summary(site) if name.startswith(ORACLE) else site.summary())
                         for s, site in sc.sites.items()}
            why = m.refusal(summaries)
            if why:
                raise ValueError(f"--methods {name}: {plan.datasets[seed]}: {why}")
    if plan.engine == "flare":
        for seed, sc in plan.scenarios.items():
            expected = [f"site-{i + 1}" for i in range(len(sc.sites))]
            if list(sc.sites) != expected:
                raise ValueError(f"{plan.datasets[seed]}: --engine flare needs sites named {expected} (the "
                                 f"simulator's names), got {list(sc.sites)}")


