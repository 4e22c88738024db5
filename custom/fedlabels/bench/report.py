"""A ``fedlabels bench`` run's results: ``results.md`` (mean ± sd over seeds) and its plots."""

from __future__ import annotations


from .plan import DEFAULT_LR, FLOOR, MEAN, POOLED, PRIMARY, TEST_METRICS, Plan, floor_method

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
    from ..config import KEY_METRICS

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

    from ..config import KEY_METRICS

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


