"""Training and scoring the cells of a ``fedlabels bench`` plan (one method or floor row and one seed each),
in process or in the FLARE simulator; finished cells are kept, reused and never recomputed. A federated cell
trains one ``RunConfig`` (``cell_run``) on either engine and records its JSON (``run``)."""

from __future__ import annotations

import csv
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from .. import progress
from ..release import code_version
from ..scoring import Scorer
from .plan import CSV_COLUMNS, FLOOR, MEAN, ORACLE, POOLED, PRIMARY, Plan, _say, base_method, floor_method
from .report import markdown, plot

# ---------------------------------------------------------------- cells



def floor_sites(scenario) -> list:
    """Sites with something a supervised client learns from (labeled cases; segmentation: pixel masks)."""
    from ..bundle import data as bundle_data

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
              **({"preset": plan.preset} if plan.preset else {})}
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


def cell_run(plan: Plan, cell: Cell):
    """A federated cell's run configuration: what both engines train, the FLARE job carries and the cell records."""
    from .. import methods
    from ..config import DataSpec, RunConfig

    opts, method = plan.options[cell.method], base_method(cell.method)
    data = DataSpec(family=plan.family or "cxr", synth=dict(plan.synth), batch_size=plan.batch_size,
                    oracle=cell.method.startswith(ORACLE), image_size=plan.image_size, preset=plan.preset)
    return RunConfig(method=method, bundle=plan.bundle.name, client=dict(opts["client"]), server=dict(opts["server"]),
                     network=methods.get(method).network_options(plan.network), data=data, seed=cell.seed)


def run_federated_inprocess(plan: Plan, cell: Cell, scorer: Scorer, log) -> dict:
    """``references.federate``; the last model at each eval round and the best on site validation so far."""

    from .. import references
    from ..config import KEY_METRICS

    cfg = cell_run(plan, cell)
    key = KEY_METRICS[plan.scenarios[cell.seed].task]
    setups = references.setups(plan.bundle, plan.datasets[cell.seed], batch_size=cfg.data.batch_size, seed=cfg.seed,
                               method=cfg.method, oracle=cfg.data.oracle, network_overrides=cfg.network or None,
                               config=plan.config)
    captured = {}

    def on_round(record, weights, best):
        r = record["round"] + 1
        if r in plan.eval_rounds:
            captured[r] = {"last": _copy(weights), "best": _copy(best)}

    result = references.federate(cfg.method, setups, plan.rounds, seed=cfg.seed, log=log, client_options=cfg.client,
                                 server_options=cfg.server, on_round=on_round)
    # The final model is a best-model candidate too (validated at every site after the last round).
    captured[plan.rounds]["best"] = result["best"]
    rows = []
    for r in plan.eval_rounds:
        for model in ("last", "best"):
            rows += _rows(cell, r, model, scorer(captured[r][model]))
    return {"rows": rows, "records": result["records"], "key_metric": key, "run": cfg.to_json()}


def run_federated_flare(plan: Plan, cell: Cell, scorer: Scorer, log) -> dict:
    """The same run as a FLARE job in the simulator; its last and best global models scored."""
    from ..config import KEY_METRICS
    from ..run import Run
    from ..flare.simulator import simulate
    from ..flare.job import JobSpec, export

    data, sc, cfg = plan.datasets[cell.seed], plan.scenarios[cell.seed], cell_run(plan, cell)
    spec = JobSpec(f"bench_{cell_name(cell.method, cell.seed)}", cfg, sites=len(sc.sites), rounds=plan.rounds,
                   bundle_dir=str(plan.bundle))
    work = plan.out / "flare" / cell_name(cell.method, cell.seed)
    job_dir = export(spec, work / "jobs")
    log(f"FLARE simulator, {len(sc.sites)} sites x {plan.rounds} rounds; log: {work / 'simulator.log'}")
    run_dir = simulate(job_dir, work / "ws", len(sc.sites), data=data, log=work / "simulator.log")
    run = Run(run_dir)
    rows = []
    for model in ("last", "best"):
        rows += _rows(cell, plan.rounds, model, scorer(run.model(model)))
    return {"rows": rows, "records": run.rounds, "key_metric": KEY_METRICS[sc.task], "run_dir": str(run_dir),
            "run": cfg.to_json()}


def run_floor(plan: Plan, cell: Cell, scorer: Scorer, log) -> dict:
    """One site alone (``references.local``'s recipe), trained on to each eval round: round r = r x E epochs."""
    from .. import methods
    from ..methods.base import to_numpy
    from ..site import setup_site

    sc = plan.scenarios[cell.seed]
    st = setup_site(plan.bundle, plan.datasets[cell.seed], cell.site, batch_size=plan.batch_size, seed=cell.seed,
                    network_overrides=plan.network or None, config=plan.config)
    first = plan.eval_rounds[0] * plan.local_epochs
    client = methods.get(floor_method(sc.task)).make_client(st.net, st.context(), **{**plan.floor_client,
                                                                                      "epochs": first})
    rows, done, train_seconds = [], 0, []
    for i, r in enumerate(plan.eval_rounds):
        client.epochs = (r - done) * plan.local_epochs
        t0 = time.perf_counter()
        update = client.train(to_numpy(st.net.state_dict()), i)
        train_seconds.append(time.perf_counter() - t0)
        done = r
        loss = progress.number(update.metrics.get("train_loss"))
        log(f"[{cell.method}] {r * plan.local_epochs} epochs: train_loss={loss}")
        rows += _rows(cell, r, "last", scorer(to_numpy(st.net.state_dict())))
    total = sum(s.summary()["cases"] for s in sc.sites.values())
    cases = sc.site(cell.site).summary()["cases"]
    # training alone, per stretch between eval rounds (set-up and scoring excluded): what a round's seconds measure
    return {"rows": rows, "records": [], "share": cases / total, "cases": cases, "total_cases": total,
            "train_seconds": train_seconds}


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
    from ..profile import write_json_atomic

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


def _check_finished(plan: Plan, todo: list, code: str) -> dict:
    """Finished cells whose settings match (here, or copied from a ``--reuse`` folder); refuse (before
    training) one here computed with other settings. One written by other code than ``code`` stands (its
    settings match) but is named: a table mixing it with new cells mixes two versions of the code."""
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
    for (method, seed), saved in done.items():
        if saved.get("code") != code:
            _say(f"[bench] {method} seed {seed}: kept, written by {saved.get('code') or 'code not recorded'} "
                 f"(the code now: {code}); remove the cell to recompute it")
    return done


def run(plan: Plan) -> dict:
    """Every cell (finished ones skipped), then results.csv, results.md and the plots."""
    from ..profile import write_json_atomic

    t_start = time.time()
    todo = cells(plan)
    code = code_version()
    results = _check_finished(plan, todo, code)
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
        # torch's thread count and the CPU's vector kernels (AVX2, AVX512, ...) change float sums in the last
        # digits, and over many rounds a run's numbers with them
        import torch

        out.update(config=cell_config(plan, cell), seconds=time.time() - t0, torch_threads=torch.get_num_threads(),
                   cpu_capability=torch.backends.cpu.get_cpu_capability(), code=code)
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
    from ..profile import write_atomic

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "value": "" if r["value"] is None else repr(float(r["value"]))})
    write_atomic(path, buf.getvalue().encode())


