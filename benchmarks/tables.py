"""Run a paper's comparison table from its declarative plan, and write the table.

    python benchmarks/tables.py benchmarks/plans/fedmlp-preset.yaml [--jobs 2] [--only main,oracle]
    python benchmarks/tables.py benchmarks/plans/fedmlp-preset.yaml --table-only

A plan (YAML, ``benchmarks/plans/``) says what a table holds; this script holds no paper:

* ``title``, ``intro``: the table's heading and the paragraph under it;
* ``out``: the results folder (relative to the repository), where runs, logs and TABLE.md go;
* ``seeds``: each seed is its own split (a Dirichlet or random draw: report over splits, never one);
* ``prepare``: the ``fedlabels`` command that makes one split (``{seed}``, ``{data}``, ``{src}`` and the
  section's and run's variables are filled in); skipped where ``{data}/scenario.yaml`` exists;
* ``bench``: ``fedlabels bench`` options of every run (the preset, rounds, eval rounds);
* ``columns``: what each table shows, each a mapping with ``label`` and either a value
  (``metric``; optional ``model`` last|best, ``round`` (default the run's last), ``group`` pooled,
  a group name or ``sites`` = the mean over the site-k groups; ``per_split: true`` lists the splits'
  values in seed order instead of their mean ± sd) or ``recalled: true`` (per split, the
  classes the model recalls at all; 1 = one class predicted) or ``records: [keys]`` (from the round
  records, per split: ``agg`` sum|mean over sites and rounds, ``last`` N rounds, ``per_site``); a value
  column with ``minus: METHOD`` (e.g. ``local:site-1``, a floor row) shows, per split, the row's value less
  that method's in the same run and split, as the mean ± sd of those paired differences and how many
  splits are above 0 (the spread of the difference itself, not of either row);
* ``paper``: ``source`` and ``columns`` (the labels the printed values fill, in order), and
  ``values``: key -> ``{table, row, values}``, the numbers as the paper prints them;
* ``for``: a list of factors, each a list of variable mappings; a section is written once per
  combination (their product), its strings' ``{name}`` filled in; a section's own ``for`` replaces it;
* ``sections``: each a ``heading``, an optional ``note``, ``runs`` (name -> ``methods``, optional
  ``bench`` options, ``data`` (default ``prepare.data``), ``dir`` (default ``runs/<name>``) and ``vars``)
  and ``rows``: ``{run, method, label, paper: key or keys}`` (a ``local:site-k`` method is that site
  alone, the floor) or ``{run, floor: true}`` (every site trained alone in that run, with its share of
  the training cases); ``class_floor: true`` adds
  local learning with one model per class (each class scored by the best site that annotates it);
* ``glance`` (optional): ``{column, heading, rows}``, one line per section that has any of ``rows`` (row
  labels; default every row), one column per row;
* ``extends``: a base plan whose keys this one replaces; ``x-...`` fields hold YAML anchors only.

A misspelt field anywhere, a row naming no run, a paper key that is not there or a ``{name}`` no
variable fills stops the plan before anything runs, naming the file and the field.

Runs are resumable: ``fedlabels bench`` keeps finished cells, so a run interrupted and started again
computes only what is missing, and a run copies a finished cell of another run of the plan that has its
settings (``--reuse``: an ablation's floor rows are the main run's) instead of training it again. Each (run, seed) is one bench process; ``--jobs 2`` runs two at once with
one torch thread each; a last pass per run with every seed writes the run's results.md over all of
them. The exit status is 1 when a run failed. TABLE.md is assembled from every finished cell (``not run`` where none yet) and
written under a temporary name first. What the table needs from the prepared splits (each site's share
of the training cases, the classes it annotates) is kept in ``splits.json`` beside it, so that
``--table-only`` on a checkout without the data writes the same table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
FLOOR = "local:"


class PlanError(ValueError):
    """A plan that cannot be run: the message names the file and the field."""


PLACEHOLDER = re.compile(r"\{(\w+)\}")


def fill(obj, values: dict):
    """obj with every string's {name} filled from values; other braces (a name no variable fills, such as
    {seed}, or JSON in an option) are left as they are."""
    if isinstance(obj, str):
        return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), obj)
    if isinstance(obj, list):
        return [fill(o, values) for o in obj]
    if isinstance(obj, dict):
        return {k: fill(v, values) for k, v in obj.items()}
    return obj


@dataclass
class Run:
    dir: str                     # relative to the plan's out
    data: str                    # '{seed}' in it: one prepared split per seed
    methods: list
    bench: list = field(default_factory=list)
    vars: dict = field(default_factory=dict)


@dataclass
class TablePlan:
    path: Path
    raw: dict
    out: Path
    seeds: list
    sections: list               # [(heading, note, rows, class_floor)], rows: [dict]
    runs: dict                   # dir -> Run, in the order the sections name them
    section_runs: list           # per section, its runs' (name, dir)


KEYS = {"title", "intro", "out", "seeds", "prepare", "bench", "columns", "paper", "for", "sections", "glance"}
# the fields of each part of a plan: a misspelt one stops the plan (it would otherwise be silently ignored)
FIELDS = {"prepare": {"data", "command"}, "paper": {"source", "columns", "values"}, "glance": {"column", "heading", "rows"},
          "paper value": {"table", "row", "values"}, "section": {"heading", "note", "for", "runs", "rows", "class_floor"},
          "run": {"methods", "bench", "data", "dir", "vars"}, "row": {"run", "method", "label", "paper", "floor"},
          "column": {"label", "metric", "model", "round", "group", "per_split", "recalled", "records", "agg", "last",
                     "per_site", "minus"}}
FILLED_LATER = {"seed", "data", "src"}  # filled per split, by the driver


def flat(items) -> list:
    """Options as strings; nested lists (a YAML anchor inside a list) are spliced in."""
    return [str(x) for item in items for x in (flat(item) if isinstance(item, list) else [item])]


def _fields(d, part: str, where: str) -> dict:
    if not isinstance(d, dict):
        raise PlanError(f"{where}: a {part} is a mapping of fields")
    unknown = sorted(set(d) - FIELDS[part])
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {unknown}; a {part} has {sorted(FIELDS[part])}")
    return d


def _unfilled(obj, where: str, allowed=()) -> None:
    """Stop at a {name} no variable filled (a misspelt variable would otherwise reach a folder name)."""
    texts = [obj] if isinstance(obj, str) else flat(obj) if isinstance(obj, list) else []
    left = sorted({m for t in texts for m in PLACEHOLDER.findall(t)} - set(allowed))
    if left:
        raise PlanError(f"{where}: {{{left[0]}}} is filled by no variable (the section's 'for' or the run's 'vars')")


def _need(d: dict, key: str, where: str, kind=None):
    if key not in d:
        raise PlanError(f"{where}: missing field '{key}'")
    if kind is not None and not isinstance(d[key], kind):
        raise PlanError(f"{where}: field '{key}' must be a {kind.__name__ if isinstance(kind, type) else kind}")
    return d[key]


def read_yaml(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path}: plan not found") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: a plan is a mapping of fields")
    if "extends" in raw:
        base = read_yaml((path.parent / raw["extends"]).resolve())
        raw = {**base, **{k: v for k, v in raw.items() if k != "extends"}}
    return raw


def load_plan(path: Path, out: Path | None = None) -> TablePlan:
    path = Path(path).resolve()
    raw = read_yaml(path)
    where = str(path)
    unknown = [k for k in raw if k not in KEYS and not k.startswith("x-")]  # x-: YAML anchors only
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {unknown}; a plan has {sorted(KEYS)} (and x-... anchors)")
    _need(raw, "title", where, str)
    seeds = _need(raw, "seeds", where, list)
    if not seeds or not all(isinstance(s, int) for s in seeds):
        raise PlanError(f"{where}: field 'seeds' must be a list of integers")
    columns = _need(raw, "columns", where, list)
    for i, col in enumerate(columns):
        _fields(col, "column", f"{where}: columns[{i}]")
        if "label" not in col or not ({"metric", "recalled", "records"} & col.keys()):
            raise PlanError(f"{where}: columns[{i}] needs 'label' and one of 'metric', 'recalled', 'records'")
        if col.get("model", "last") not in ("last", "best") or col.get("agg", "sum") not in ("sum", "mean"):
            raise PlanError(f"{where}: columns[{i}]: 'model' is last or best, 'agg' is sum or mean")
    paper = _fields(raw.get("paper") or {}, "paper", f"{where}: paper")
    values = paper.get("values") or {}
    for key, v in values.items():
        _fields(v, "paper value", f"{where}: paper.values[{key!r}]")
        if len(v.get("values") or []) != len(paper.get("columns") or []) or not {"table", "row"} <= v.keys():
            raise PlanError(f"{where}: paper.values[{key!r}] needs 'table', 'row' and one value per paper.columns")
    labels = {c["label"] for c in columns}
    glance = _fields(raw.get("glance") or {}, "glance", f"{where}: glance")
    if glance and glance.get("column") not in labels:
        raise PlanError(f"{where}: glance.column {glance.get('column')!r} is not a column label")
    prepare = _fields(raw.get("prepare") or {}, "prepare", f"{where}: prepare")
    default_data = prepare.get("data")
    sections, runs, section_runs = [], {}, []
    for i, template in enumerate(_need(raw, "sections", where, list)):
        factors = template.get("for", raw.get("for", []))
        combos = [dict(kv for d in combo for kv in d.items()) for combo in itertools.product(*factors)] or [{}]
        for combo in combos:
            sec = fill(_fields({k: v for k, v in template.items() if k != "for"}, "section",
                               f"{where}: sections[{i}]"), combo)
            swhere = f"{where}: sections[{i}] ({sec.get('heading', '?')})"
            heading = _need(sec, "heading", swhere, str)
            _unfilled([heading, sec.get("note") or ""], swhere)
            mine = []
            for name, spec in _need(sec, "runs", swhere, dict).items():
                rwhere = f"{swhere}: runs.{name}"
                _fields(spec, "run", rwhere)
                data = spec.get("data", default_data)
                if not data:
                    raise PlanError(f"{rwhere}: missing field 'data' (and the plan has no prepare.data)")
                run_vars = {**combo, **spec.get("vars", {})}  # what the prepare command fills in
                run = Run(dir=spec.get("dir", f"runs/{name}"), data=fill(data, run_vars),
                          methods=list(_need(spec, "methods", rwhere, list)), bench=flat(spec.get("bench", [])),
                          vars=run_vars)
                _unfilled([run.dir, run.data, run.bench], rwhere, allowed={"seed"})
                _unfilled(fill(prepare.get("command") or [], run_vars), f"{where}: prepare.command, for {rwhere}",
                          allowed=FILLED_LATER)
                if run.dir in runs:
                    same = runs[run.dir]
                    if (same.data, same.methods, same.bench) != (run.data, run.methods, run.bench):
                        raise PlanError(f"{rwhere}: the folder {run.dir} is already another run's")
                    run = same
                runs[run.dir] = run
                mine.append((name, run.dir))
            names = dict(mine)
            rows = []
            for j, row in enumerate(_need(sec, "rows", swhere, list)):
                _fields(row, "row", f"{swhere}: rows[{j}]")
                if row.get("run") not in names:
                    raise PlanError(f"{swhere}: rows[{j}]: 'run' must name one of this section's runs {sorted(names)}")
                row = {**row, "dir": names[row["run"]]}
                if not row.get("floor"):
                    _need(row, "method", f"{swhere}: rows[{j}]", str)
                    _need(row, "label", f"{swhere}: rows[{j}]", str)
                    if row["method"] not in runs[row["dir"]].methods and not row["method"].startswith(FLOOR):
                        raise PlanError(f"{swhere}: rows[{j}]: run {row['run']} does not train {row['method']!r}")
                    keys = row.get("paper") or []
                    for key in [keys] if isinstance(keys, str) else keys:
                        if key not in values:
                            raise PlanError(f"{swhere}: rows[{j}]: paper value {key!r} is not in paper.values")
                rows.append(row)
            sections.append((heading, sec.get("note"), rows, bool(sec.get("class_floor"))))
            section_runs.append(mine)
    shown = {r["label"] for _, _, rows, _ in sections for r in rows if not r.get("floor")}
    missing = [label for label in glance.get("rows") or [] if label not in shown]
    if missing:
        raise PlanError(f"{where}: glance.rows: {missing[0]!r} is the label of no row")
    out = (out or REPO / _need(raw, "out", where, str)).resolve()
    from fedlabels import cli

    parser = cli.build_parser(flare=False)  # one parser for every command line of the plan
    later = {k: 0 if k == "seed" else f"<{k}>" for k in FILLED_LATER}
    for run in runs.values():  # a misspelt option fails here, before any split is prepared or any cell trains
        if prepare.get("command"):
            _parses(parser, fill(flat(prepare["command"]), {**run.vars, **later}),
                    f"{where}: prepare.command, for {run.dir}")
        _parses(parser, ["bench", "--data", "<data>", "--methods", ",".join(run.methods), "--out", "<out>",
                         *flat(raw.get("bench", [])), *run.bench], f"{where}: bench (with the run's own), for {run.dir}")
    return TablePlan(path, raw, out, seeds, sections, runs, section_runs)


def _parses(parser, argv: list, where: str) -> None:
    """``fedlabels argv`` must parse (names and types of the options; nothing runs)."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args([str(a) for a in argv])
    except SystemExit:
        said = (err.getvalue().strip().splitlines() or ["not a fedlabels command line"])[-1]
        raise PlanError(f"{where}: {said}") from None


# ------------------------------------------------------------------ running


def fedlabels() -> str:
    return str(Path(sys.executable).with_name("fedlabels"))


def data_path(plan: TablePlan, run: Run, seed: int | None = None) -> str:
    if run.data.startswith("embedded:"):
        return run.data
    path = str(plan.out / run.data)
    return path if seed is None else path.replace("{seed}", str(seed))


def prepare(plan: TablePlan, run: Run, seed: int, src: Path) -> None:
    target = data_path(plan, run, seed)
    if target.startswith("embedded:") or (Path(target) / "scenario.yaml").is_file():
        return
    command = (plan.raw.get("prepare") or {}).get("command")
    if not command:
        raise PlanError(f"{plan.path}: {target} does not exist and the plan has no prepare.command")
    cmd = [fedlabels(), *fill(flat(command), {**run.vars, "seed": seed, "data": target, "src": src})]
    print(f"[tables] prepare: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def bench(plan: TablePlan, run: Run, seeds: list, threads: int) -> int:
    # The plan's other runs lend their finished cells that have this run's settings (bench checks them):
    # an ablation run's floor rows are the main run's.
    others = [plan.out / d for d in plan.runs if d != run.dir and (plan.out / d / "cells").is_dir()]
    cmd = [fedlabels(), "bench", "--data", data_path(plan, run), "--methods", ",".join(run.methods),
           "--seeds", ",".join(map(str, seeds)), *flat(plan.raw.get("bench", [])), *run.bench,
           "--out", str(plan.out / run.dir), *[a for d in others for a in ("--reuse", str(d))]]
    which = f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ",".join(map(str, seeds))
    log = plan.out / "logs" / f"{run.dir.replace('/', '-')}-{which.replace(' ', '').replace(',', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"[tables] {run.dir} {which}: {' '.join(cmd)}", flush=True)
    with open(log, "a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)}).returncode
    print(f"[tables] {run.dir} {which}: exit {rc} after {time.time() - t0:.0f}s (log {log})", flush=True)
    return rc


def tasks(plan: TablePlan, only=None) -> list:
    """(run, seed) in the plan's order: section by section, seed by seed, so that a table fills evenly."""
    out = []
    for names in plan.section_runs:
        for seed in plan.seeds:
            for name, d in names:
                if (only is None or {name, d, Path(d).name} & only) and (d, seed) not in out:
                    out.append((d, seed))
    return out


def record_splits(plan: TablePlan) -> dict:
    """splits.json: per prepared split, each site's training cases and annotated classes (kept beside the
    table: the splits themselves are not committed)."""
    path = plan.out / "splits.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    sys.path.insert(0, str(REPO / "custom"))
    from fedlabels.profile import load_scenario

    for run in plan.runs.values():
        for seed in plan.seeds:
            folder = data_path(plan, run, seed)
            if folder.startswith("embedded:") or not (Path(folder) / "scenario.yaml").is_file():
                continue
            key = os.path.relpath(folder, plan.out)
            if key in known:
                continue
            sc = load_scenario(Path(folder), check_files=False, with_test=False)
            known[key] = {name: {"training": len(json.loads((Path(folder) / name / "datalist.json").read_text())["training"]),
                                 "annotated": list(site.profile.annotated)} for name, site in sc.sites.items()}
    if known:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")
        tmp.replace(path)
    return known


# ------------------------------------------------------------------ the table


def read_cells(plan: TablePlan) -> dict:
    """(run dir, method, seed) -> finished cell."""
    cells = {}
    for d in plan.runs:
        for path in sorted((plan.out / d / "cells").glob("*.json")):
            cell = json.loads(path.read_text())
            cells[(d, cell["config"]["method"], int(cell["config"]["seed"]))] = cell
    return cells


def _rows(cell, col, cls="mean"):
    rnd = col.get("round") or cell["config"]["rounds"]
    return [r for r in cell["rows"] if r["round"] == rnd and r["model"] == col.get("model", "last")
            and r["class"] == cls and r["metric"] == col["metric"]]


def value(cell, col, cls="mean"):
    """One number of one cell for a value column (None where the cell does not hold it)."""
    group = col.get("group", "pooled")
    hits = _rows(cell, col, cls)
    if group == "sites":
        vals = [r["value"] for r in hits if r["group"].startswith("site-")]
        return None if not vals or any(v is None for v in vals) else float(np.mean(vals))
    vals = [r["value"] for r in hits if r["group"] == group]
    return None if not vals or vals[0] is None else float(vals[0])


def recalled(cell) -> int:
    last = cell["config"]["rounds"]
    return sum(1 for r in cell["rows"] if r["round"] == last and r["model"] == "last" and r["group"] == "pooled"
               and r["metric"] == "recall" and r["class"] != "mean" and (r["value"] or 0) > 0)


def records(cell, col) -> str:
    recs = cell.get("records", [])[-col["last"]:] if col.get("last") else cell.get("records", [])
    agg = np.mean if col.get("agg") == "mean" else np.sum
    sites = sorted({s for r in recs for s in r.get("sites", {})}, key=_site_order)

    def one(key, only=None):
        vals = [r["sites"][s].get(key) for r in recs for s in r.get("sites", {}) if only in (None, s)]
        vals = [v for v in vals if v is not None]
        return "-" if not vals else (f"{agg(vals):.2f}" if col.get("agg") == "mean" else f"{agg(vals):g}")

    parts = [one(k, s) for s in sites for k in col["records"]] if col.get("per_site") else \
        [one(k) for k in col["records"]]
    return "" if all(p == "-" for p in parts) else " / ".join(parts)  # a row that records none of them


def _site_order(name: str):
    tail = name.rsplit("-", 1)[-1]
    return (0, int(tail)) if tail.isdigit() else (1, name)


def fmt(vals) -> str:
    vals = [100 * v for v in vals if v is not None]
    if not vals:
        return "not run"
    return f"{np.mean(vals):.1f}" + (f" ± {np.std(vals, ddof=1):.1f}" if len(vals) > 1 else "")


def seed_cells(plan: TablePlan, cells: dict, row: dict) -> list:
    """The row's cell of each of the plan's seeds, in seed order; None where that seed has not finished."""
    return [cells.get((row["dir"], row["method"], s)) for s in plan.seeds]


def column_text(by_seed: list, col) -> str:
    """One column of one row; per-split columns list every seed in order, '-' where it has not finished."""
    got = [c for c in by_seed if c is not None]
    if not got:
        return "not run"
    if col.get("recalled"):
        return ",".join("-" if c is None else str(recalled(c)) for c in by_seed)
    if col.get("records"):
        texts = ["-" if c is None else records(c, col) or "-" for c in by_seed]
        return " ; ".join(texts) if any(t != "-" for t in texts) else ""
    vals = [value(c, col) for c in got]
    if all(v is None for v in vals):
        return "—"  # finished cells that do not hold this value: not "not run"
    if col.get("per_split"):
        return ", ".join("-" if c is None or value(c, col) is None else f"{100 * value(c, col):.1f}" for c in by_seed)
    return fmt(vals)


def paired_text(by_seed: list, ref_by_seed: list, col) -> str:
    """Per split, the row's value less the reference row's (``minus``): mean ± sd, and the splits above 0."""
    diffs = [value(a, col) - value(b, col) for a, b in zip(by_seed, ref_by_seed)
             if a is not None and b is not None and value(a, col) is not None and value(b, col) is not None]
    if not diffs:
        return "not run"
    mean = round(100 * float(np.mean(diffs)), 1) + 0.0  # + 0.0: no "-0.0"
    text = f"{mean:+.1f}" + (f" ± {100 * np.std(diffs, ddof=1):.1f}" if len(diffs) > 1 else "")
    return f"{text} ({sum(d > 0 for d in diffs)}/{len(diffs)} above)"


def share(plan: TablePlan, splits: dict, run: Run, site: str) -> float | None:
    """The site's share of the training cases (%), mean over the plan's splits of this run."""
    shares = []
    for seed in plan.seeds:
        counts = splits.get(os.path.relpath(data_path(plan, run, seed), plan.out))
        if counts and site in counts:
            shares.append(100 * counts[site]["training"] / sum(s["training"] for s in counts.values()))
    return float(np.mean(shares)) if shares else None


def expand_rows(plan: TablePlan, rows: list, cells: dict, splits: dict) -> list:
    """The section's rows with every floor entry replaced by one row per site trained alone."""
    out = []
    for row in rows:
        if not row.get("floor"):
            out.append({**row, "floor": True, "short": row["label"]} if row["method"].startswith(FLOOR) else row)
            continue
        sites = sorted({m for (d, m, _) in cells if d == row["dir"] and m.startswith(FLOOR)},
                       key=lambda m: _site_order(m[len(FLOOR):]))
        for m in sites:
            pct = share(plan, splits, plan.runs[row["dir"]], m[len(FLOOR):])
            label = f"{m} alone" + (f" ({pct:.0f} % of the training cases)" if pct is not None else "")
            short = m[len(FLOOR):] + (f", {pct:.0f} % of the training cases" if pct is not None else "")
            out.append({"dir": row["dir"], "method": m, "label": label, "short": short, "floor": True})
    return out


def class_floor(plan: TablePlan, rows: list, cells: dict, splits: dict, columns: list) -> list:
    """Local learning, one model per class: per split, each class scored by the best of the sites that
    annotate it trained alone (picked on test: an optimistic floor), then the mean over classes."""
    texts = []
    for col in columns:
        if not col.get("metric") or col.get("model", "last") != "last" or col.get("group", "pooled") != "pooled":
            texts.append("")
            continue
        per_seed = []
        for seed in plan.seeds:
            per_class, classes = {}, None
            for row in (r for r in rows if r.get("floor")):
                cell = cells.get((row["dir"], row["method"], seed))
                counts = splits.get(os.path.relpath(data_path(plan, plan.runs[row["dir"]], seed), plan.out))
                if cell is None or counts is None:
                    continue
                # the scenario's classes: prepare's class sets cover every class (partition.missing_class_sets)
                classes = {c for s in counts.values() for c in s["annotated"]}
                for c in counts[row["method"][len(FLOOR):]]["annotated"]:
                    v = value(cell, col, cls=c)
                    if v is not None:
                        per_class.setdefault(c, []).append(v)
            if classes and set(per_class) == classes:
                per_seed.append(float(np.mean([max(v) for v in per_class.values()])))
        texts.append(fmt(per_seed))
    return texts


def paper_text(plan: TablePlan, row) -> str:
    keys = row.get("paper") or []
    values = (plan.raw.get("paper") or {}).get("values", {})
    return "; ".join(" / ".join(f"{v:.1f}" for v in values[k]["values"]) + f" ({values[k]['table']}, {values[k]['row']})"
                     for k in ([keys] if isinstance(keys, str) else keys))


def section_table(plan: TablePlan, rows: list, cells: dict, splits: dict, with_class_floor: bool) -> list:
    columns = plan.raw["columns"]
    paper = plan.raw.get("paper")
    head = ["row", *[c["label"] for c in columns]] + ([f"paper {' / '.join(paper['columns'])}"] if paper else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        by_seed = seed_cells(plan, cells, row)
        got = [c for c in by_seed if c is not None]
        cols = [paired_text(by_seed, seed_cells(plan, cells, {**row, "method": c["minus"]}), c) if c.get("minus")
                else column_text(by_seed, c) for c in columns]
        lines.append(f"| {row['label']} ({len(got)}) | " + " | ".join(cols)
                     + (f" | {paper_text(plan, row)} |" if paper else " |"))
    if with_class_floor:
        cols = class_floor(plan, rows, cells, splits, columns)
        lines.append("| local learning, one model per class (each class by the best site annotating it, picked on "
                     "test) | " + " | ".join(cols) + (" |  |" if paper else " |"))
    return lines


def code_note(plan: TablePlan, rows: list, cells: dict) -> list:
    """Which code wrote which rows' cells, where a section's cells were not all written by one recorded
    version (``code`` in a cell, since the cells recorded it): rows of two versions are not one measurement."""
    by_code = {}
    for row in rows:
        for c in seed_cells(plan, cells, row):
            if c is not None:
                counts = by_code.setdefault(c.get("code") or "code not recorded", {})
                counts[row["label"]] = counts.get(row["label"], 0) + 1
    if len(by_code) < 2:
        return []
    parts = [f"{code}: " + ", ".join(f"{label} ({n})" for label, n in counts.items())
             for code, counts in sorted(by_code.items())]
    return ["Cells written by different code (cells per row in brackets): " + "; ".join(parts) + ".", ""]


def glance(plan: TablePlan, expanded: list, cells: dict, splits: dict) -> list:
    """One line per section, one column per row label (the plan's glance.rows, or every non-floor row) and
    the floor: local learning with one model per class where the section has it, else the best site alone."""
    spec = plan.raw["glance"]
    col = next(c for c in plan.raw["columns"] if c["label"] == spec["column"])
    paper = plan.raw.get("paper") or {}
    pi = paper.get("columns", []).index(col["label"]) if col["label"] in paper.get("columns", []) else None
    labels = spec.get("rows") or list(dict.fromkeys(r["label"] for _, rows, _ in expanded for r in rows
                                                    if not r.get("floor")))
    lines = [f"## {spec.get('heading', spec['column'] + ' at a glance')}", "",
             "| section | " + " | ".join(labels) + " | floor (chosen on test) |", "|---|" + "---|" * (len(labels) + 1)]
    for heading, rows, with_class_floor in expanded:
        if not any(r["label"] in labels for r in rows if not r.get("floor")):
            continue  # a section of other rows (an ablation) has no line here
        texts = []
        for label in labels:
            row = next((r for r in rows if r["label"] == label and not r.get("floor")), None)
            if row is None:
                texts.append("")
                continue
            by_seed = seed_cells(plan, cells, row)
            got = [c for c in by_seed if c is not None]
            text = column_text(by_seed, col)
            one = sum(1 for c in got if any(r["metric"] == "recall" and r["class"] != "mean" for r in c["rows"])
                      and recalled(c) == 1)
            text += f" ({one}/{len(got)} one class)" if one else ""
            keys = row.get("paper") or []
            if pi is not None and keys:
                key = keys if isinstance(keys, str) else keys[0]
                text += f" / {paper['values'][key]['values'][pi]:.1f}"
            texts.append(text)
        if with_class_floor:
            texts.append(class_floor(plan, rows, cells, splits, [col])[0] + " (one model per class)")
        else:
            floors = []
            for row in (r for r in rows if r.get("floor")):
                vals = [value(c, col) for c in seed_cells(plan, cells, row) if c is not None]
                if any(v is not None for v in vals):
                    floors.append((float(np.mean([v for v in vals if v is not None])), row))
            best = max(floors, key=lambda f: f[0])[1] if floors else None
            texts.append("not run" if best is None else
                         f"{column_text(seed_cells(plan, cells, best), col)} ({best['short']})")
        lines.append(f"| {heading} | " + " | ".join(texts) + " |")
    return lines + [""]


def table(plan: TablePlan) -> str:
    cells = read_cells(plan)
    splits = json.loads((plan.out / "splits.json").read_text()) if (plan.out / "splits.json").is_file() else {}
    rel = os.path.relpath(plan.path, REPO)
    lines = [f"# {plan.raw['title']}", ""]
    if plan.raw.get("intro"):
        lines += [plan.raw["intro"].strip(), ""]
    lines += [f"Written by `python benchmarks/tables.py {rel}` from the finished cells under this folder: mean ± sd "
              f"over the seeds {plan.seeds} (each seed its own split; the count of finished ones in brackets); "
              "`not run`: no finished cell yet. Floor rows: a site trained alone for as many epochs."
              + (f" Paper: {plan.raw['paper']['source']}." if plan.raw.get("paper") else ""), ""]
    expanded = [(h, expand_rows(plan, rows, cells, splits), cf) for h, _, rows, cf in plan.sections]
    if plan.raw.get("glance"):
        lines += glance(plan, expanded, cells, splits)
    for (heading, note, _, with_class_floor), (_, rows, _) in zip(plan.sections, expanded):
        lines += [f"## {heading}", ""] + ([note.strip(), ""] if note else [])
        lines += section_table(plan, rows, cells, splits, with_class_floor) + [""] + code_note(plan, rows, cells)
    return "\n".join(lines)


def write_table(plan: TablePlan) -> str:
    text = table(plan)
    plan.out.mkdir(parents=True, exist_ok=True)
    tmp = plan.out / ".TABLE.md.tmp"  # a reader never sees half a table
    tmp.write_text(text)
    tmp.replace(plan.out / "TABLE.md")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan", type=Path, help="a plan file (benchmarks/plans/*.yaml)")
    p.add_argument("--out", type=Path, help="results folder (default: the plan's out)")
    p.add_argument("--src", type=Path, default=REPO.parent / "shared" / "data",
                   help="the data folder a plan's prepare command reads ({src})")
    p.add_argument("--only", help="comma-separated run names (or their folders) to run (default: every run)")
    p.add_argument("--jobs", type=int, default=1, help="bench processes at once (one torch thread each when > 1)")
    p.add_argument("--table-only", action="store_true", help="only write TABLE.md from the finished cells")
    args = p.parse_args(argv)
    if args.table_only and args.only:
        p.error("--only chooses what runs; --table-only runs nothing")
    try:
        plan = load_plan(args.plan, args.out)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.table_only:
        todo = tasks(plan, set(args.only.split(",")) if args.only else None)
        if not todo:
            print(f"error: {args.plan}: --only {args.only} names no run of the plan", file=sys.stderr)
            return 2
        threads = 1 if args.jobs > 1 else int(os.environ.get("OMP_NUM_THREADS", "2"))
        for d, seed in todo:  # every split first, one at a time (runs share them)
            prepare(plan, plan.runs[d], seed, args.src.resolve())
        t0 = time.time()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            codes = list(pool.map(lambda t: bench(plan, plan.runs[t[0]], [t[1]], threads), todo))
        failed = [t for t, c in zip(todo, codes) if c]
        # Each bench process wrote its run's results.md / results.csv for its own seed: one more pass per
        # run with every seed (its cells finished, so it only reads them) makes them cover the run.
        for d in dict.fromkeys(d for d, _ in todo if len(plan.seeds) > 1 and not any(f[0] == d for f in failed)):
            if bench(plan, plan.runs[d], plan.seeds, threads):
                failed.append((d, plan.seeds))
        print(f"[tables] {len(todo)} runs in {time.time() - t0:.0f}s; failed: {failed or 'none'}", flush=True)
    else:
        failed = []
    record_splits(plan)
    print(write_table(plan))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
